"""The main job: train one ranker per attention layout on the same data and compare them.

    python -m experiments main-job --preset small --data data/small --attention dense sdpa jagged
    make experiment [PRESET=paper]                       # the same, after `make data`

experiments/ablations/main.yaml run by :mod:`experiments.sweep` under a new parent run; extra
arguments after ``--`` go to every ``pipeline fit`` (e.g. ``-- --trainer.max_epochs 1``).
README.md ("The main job") describes the table, where it is written and when it is kept.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from pathlib import Path

import yaml

from models import ATTENTIONS
from experiments import runs as runs_
from experiments import sweep
from experiments.proc import sigterm_as_interrupt
from experiments.ablation import CONFIGS, expand, read
from experiments.comparison import parent_url
from pipeline.errors import ConfigError, command
from pipeline.tracking import REPO_ROOT, check_tracking, environment_tags, tracking_uri

MAIN = REPO_ROOT / "experiments" / "ablations" / "main.yaml"
EXPERIMENT = "main-job"


def main_ablation(args):
    """main.yaml with this job's preset config, layouts, MLflow experiment and data; the
    arguments after ``--`` as overrides of every run."""
    raw = read(MAIN)
    raw.update(name=f"main-{args.preset}", experiment=args.experiment_name, configs=["base", args.preset],
               grid={"model.ranker.attention": list(args.attention)})
    if "jagged" not in args.attention:
        raw["report"] = {k: v for k, v in raw.get("report", {}).items() if k != "baseline"}
    return expand(raw, MAIN, REPO_ROOT / "data", args.data_dir, fit_overrides(args.extra))


def fit_overrides(extra: list[str]) -> dict:
    """``--key value`` / ``--key=value`` pairs (what follows ``--``) -> {key: value read as YAML}."""
    from data_gen.config import ConfigError as OptionError, option_pairs

    try:
        return {key: yaml.safe_load(value) for key, value in option_pairs(extra).items()}
    except OptionError as err:
        raise ConfigError(f"after --: {err}") from None


def table_rows(results: list[dict], cuda: bool) -> tuple[list[str], list[list[str]]]:
    """The main job's table: one row per attention layout, the sweep report's columns and formats."""
    keys = ["test/auc", "test/ne", "test/logloss", "perf/train_examples_per_s", "perf/train_tokens_per_s",
            "perf/step_time_ms", "mem/train_peak_allocated_mb" if cuda else "mem/peak_rss_mb"]
    header = ["attention", "status", *(runs_.METRICS[k][0] for k in keys), "wall (s)", "MLflow run"]
    rows = [[r["attention"], r["status"], *(runs_.fmt(r["metrics"].get(k), runs_.METRICS[k][1]) for k in keys),
             f"{r['wall_s']:.0f}", r["run_id"] or "-"] for r in results]
    return header, rows


def results_file(results_dir: str, preset: str, data_dir: str, meta: dict, accelerator: str) -> Path:
    """``<dir>/main_<preset>_<device>.md``; data other than the preset's own (its config, seed 0)
    adds ``_<data dir name>-<digest[:8]>`` after the preset."""
    from data_gen.config import PRESETS, resolve_config

    have = meta.get("config") or {}
    own = (preset in PRESETS and meta.get("preset") == preset and meta.get("seed") == 0
           and all(k in have and json.dumps(have[k]) == json.dumps(v)
                   for k, v in resolve_config(preset).to_dict().items()))
    data = "" if own else f"_{Path(data_dir).name}-{str(meta.get('digest'))[:8]}"
    return Path(results_dir) / f"main_{preset}{data}_{accelerator}.md"


_ROW = re.compile(r"^\| (\w+) \| ([A-Z][A-Z ?]*) \|", re.MULTILINE)


def write_results(out: Path, md: str, results: list[dict]) -> tuple[Path, str | None]:
    """Write `md` to `out` unless that loses a FINISHED layout of the table there; then write it
    beside `out`. Returns (the path written, why `out` was kept or None)."""
    done = {r["attention"] for r in results if r["status"] == "FINISHED"}
    kept = {b for b, status in _ROW.findall(out.read_text()) if status == "FINISHED"} if out.is_file() else set()
    lost = sorted(kept - done)
    reason = None
    if lost:
        failed = len(done) < len(results)
        reason = f"it holds FINISHED {', '.join(lost)}, which this run {'did not finish' if failed else 'did not run'}"
        out = out.with_name(f"{out.name[:-len('.md')]}.{'failed' if failed else 'partial'}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    return out, reason


def report(args, results, parent, meta: dict, env: dict, total_s: float) -> tuple[str, str]:
    """(markdown document, plain-text table)."""
    header, rows = table_rows(results, env["accelerator"] == "cuda")
    oracle = meta["splits"]["test"].get("oracle", {})
    recent = ", ".join(f"last {k.rsplit('_', 1)[1]}: {v:.3f}" for k, v in oracle.items() if k.startswith("auc_recent_"))
    note = ("\nOn the CPU the jagged ranker runs the kernels' torch path (sequences grouped by length, "
            "each group padded to its own longest history, torch's fused CPU attention); the Triton kernels, "
            "and the speed and memory the project is about, are a GPU result.\n"
            if env["accelerator"] == "cpu" else "")
    lines = [
        f"# Main job: dense vs sdpa vs jagged rankers, preset `{args.preset}`",
        "",
        f"- command: `python -m experiments main-job --preset {args.preset} --data {args.data} "
        f"--attention {' '.join(args.attention)}`" + (f" `-- {' '.join(args.extra)}`" if args.extra else ""),
        f"- device: {env['device']}; torch {env['torch_version']}, triton {env['triton_version']}, "
        f"CUDA {env['cuda_version']}, Python {env['python_version']}",
        f"- git commit: `{env['git_commit']}`; data digest: `{meta['digest']}` ({args.data})",
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}; total wall time {total_s:.0f} s",
        f"- test split oracle (the planted model): AUC {runs_.fmt(oracle.get('auc'), '.4f')} "
        f"(from the most recent items only: {recent or '-'}), NE (own-split CTR) {runs_.fmt(oracle.get('ne'), '.4f')}",
        f"- MLflow: experiment `{args.experiment_name}`, parent run `{parent.info.run_id}`",
        "",
        runs_.markdown_table(header, rows),
        "",
        f"The models' NE is the log loss over the entropy of the training split's CTR "
        f"({runs_.fmt(meta['splits']['train'].get('ctr'), '.4f')}), for every split (the oracle's, over its own "
        "split's CTR, as meta.json has it). "
        "Throughput is over steady-state training steps (warm-up and validation excluded); "
        "tokens are real history items. Wall time is the whole process (start-up, data loading, "
        "training, validation, test).",
    ]
    # on the terminal without the run ids (printed below the table)
    return "\n".join(lines) + "\n" + note, runs_.text_table(header[:-1], [r[:-1] for r in rows])


@command
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m experiments main-job", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small", help="experiments/configs/<preset>.yaml (tiny, small, paper)")
    p.add_argument("--data", default=None, help="data directory (default: data/<preset>)")
    p.add_argument("--attention", "--backends", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS,
                   help="the attention layouts to train, one ranker each (--backends: the old name)")
    p.add_argument("--experiment-name", default=EXPERIMENT, help="MLflow experiment")
    p.add_argument("--results-dir", default=str(REPO_ROOT / "runs"),
                   help="where the markdown table goes (default: runs/, outside the tracked files; "
                        "experiments/results to update the committed tables; '' for nowhere)")
    args = p.parse_args(argv)
    args.extra = extra
    args.data = args.data or f"data/{args.preset}"
    args.data_dir = str(Path(args.data).resolve())
    return run(args)


def run(args) -> int:
    if not (CONFIGS / f"{args.preset}.yaml").is_file():
        presets = sorted(f.stem for f in CONFIGS.glob("*.yaml") if f.stem not in ("base", *ATTENTIONS))
        raise ConfigError(f"no config for preset {args.preset!r} in {CONFIGS}; one of {presets}")
    meta_path = Path(args.data_dir) / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"no data set at {args.data}: run `make data PRESET={args.preset}` first")
    check_tracking(tracking_uri())
    meta = json.loads(meta_path.read_text())
    job = sweep.Sweep(main_ablation(args), sweep.parse_args([str(MAIN), "--data", args.data_dir, "--new"]))
    job.quiet, job.command = True, "python -m experiments main-job " + " ".join(sys.argv[1:])
    env = environment_tags()
    t_start = time.perf_counter()
    rc = sweep.execute(job)
    if job.parent is None or rc == 130:  # refused before it began, or interrupted (said so already)
        return rc
    total = time.perf_counter() - t_start
    parent = job.client.get_run(job.parent.info.run_id)
    results = [child_result(parent, layout) for layout in args.attention]
    md, text = report(args, results, parent, meta, env, total)
    job.client.log_text(parent.info.run_id, md, "main_job.md")
    if args.results_dir:
        table = results_file(args.results_dir, args.preset, args.data_dir, meta, env["accelerator"])
        out, why_kept = write_results(table, md, results)
    print(f"\n{text}\n")
    print(f"MLflow tracking URI: {tracking_uri()}")
    print(f"experiment '{args.experiment_name}' (id {job.experiment_id}), parent run {parent.info.run_id}")
    print("runs: " + ", ".join(f"{r['attention']}={r['run_id']}" for r in results))
    print(f"dashboard: `make ui` (PORT=5000 unless given), then\n"
          f"  the comparison: http://127.0.0.1:5000/{parent_url(job.experiment_id, parent.info.run_id)}\n"
          f"  side by side:   http://127.0.0.1:5000/{job.compare_url}")
    if args.results_dir:
        print(f"table written to {out}" + (f"; {table} kept: {why_kept}" if why_kept else ""))
    return 0 if all(r["status"] == "FINISHED" for r in results) else 1


def child_result(parent, layout: str) -> dict:
    """One layout's row: its run (the newest, if several), status, metrics and process wall time.
    A run the sweep recorded for a fit that never started one has no parameters: NOT STARTED."""
    runs = [r for r in runs_.child_runs(parent) if r.data.tags.get("sweep.axis.attention") == layout]
    run_ = max(runs, key=lambda r: r.info.start_time, default=None)
    if run_ is None:
        return {"attention": layout, "wall_s": 0.0, "status": "NOT RUN", "run_id": None, "metrics": {}}
    metrics = dict(run_.data.metrics)
    return {"attention": layout, "wall_s": metrics.get("sweep/process_wall_s", 0.0),
            "status": run_.info.status if run_.data.params else "NOT STARTED",
            "run_id": run_.info.run_id, "metrics": metrics}

