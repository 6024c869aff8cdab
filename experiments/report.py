"""Tables and plots of a sweep, regenerated from its MLflow runs.

    python -m experiments report --parent <run id or name> [--out runs] [--commit SHA] [--no-log]
    make report PARENT=seq_len [RESULTS=experiments/results]

Writes ``<out>/ablations/<name>/<device>/``: report.md, report.json (what the summary reads),
runs.csv and the plots, logged to the parent run with the comparison (metrics per point, ratios, the
table as its description, a saved view of its runs). What each holds: docs/experiments.md."""

from __future__ import annotations

import datetime as dt
import html
import json
import re
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from experiments import ablation, parser, runs as runs_
from experiments.proc import safe_name
from experiments.sections import (THROUGHPUT, _where, convergence_lines, convergence_rows, oracle_section,
                                  profile_section, ratio_section, ratios, recovery_section, seeds_section,
                                  target_rows, targets_section, with_whole_window)
from pipeline.errors import ConfigError, command
from pipeline.runenv import REPO_ROOT

if TYPE_CHECKING:
    import polars as pl
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


def _values(df: pl.DataFrame, col: str) -> list:
    """The column's distinct values that are set, in first-seen order."""
    return [v for v in dict.fromkeys(df[col].to_list()) if v]


def _distinct(df: pl.DataFrame, col: str) -> str:
    return ", ".join(f"`{v}`" for v in _values(df, col)) or "-"


def _environment(df: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[str, str]]]:
    """The runs whose tags describe the sweep (the finished ones, every run where none finished),
    and their data sets as (digest, directory name)."""
    ok = _where(df, status="OK")
    env = ok if ok.height else df
    pairs = dict.fromkeys(zip(env["tag.data_digest"].to_list(), env["tag.data_dir"].to_list()))
    return env, [(d, Path(p).name if p else "?") for d, p in pairs if d]


def header_lines(parent: Run, df: pl.DataFrame, commit: str | None, stop: str = "", by: str = "") -> list[str]:
    """The report's head; `stop`: early_stopping_words of the parent, '' for none; `by`: the command
    that writes it (default: this report's)."""
    tags = parent.data.tags
    name = tags.get("sweep.name", parent.info.run_name)
    counts = Counter(df["status"].to_list())
    commits = _distinct(df, "tag.git_commit")
    if commit and commits in ("-", "`unknown`"):
        commits = f"`{commit}` (given to the report; the runs recorded {commits})"
    env, data_sets = _environment(df)
    data = ", ".join(f"`{d}` ({folder})" for d, folder in data_sets)
    return [
        f"# Ablation `{name}`", "", tags.get("sweep.description", ""), "",
        f"- MLflow: parent run `{parent.info.run_id}` ({parent.info.status}), experiment id "
        f"`{parent.info.experiment_id}`; file `{tags.get('sweep.file', '?')}`; command `{tags.get('sweep.command', '?')}`",
        f"- points: {df.height} ({', '.join(f'{n} {s}' for s, n in counts.items())})",
        f"- device: {_distinct(env, 'tag.device')}; torch {_distinct(env, 'tag.torch_version')}, "
        f"triton {_distinct(env, 'tag.triton_version')}, CUDA {_distinct(env, 'tag.cuda_version')}, "
        f"Python {_distinct(env, 'tag.python_version')}, Lightning {_distinct(env, 'tag.lightning_version')}",
        f"- git commit: {commits}",
        f"- data digest: {data or '-'}",
        f"- budget and overrides of every run: `{tags.get('sweep.set', '{}')}`",
        *([f"- every run trains {stop}: the EarlyStopping callback of the ablation file's configs"] if stop else []),
        f"- written {dt.datetime.now().astimezone().isoformat(timespec='seconds')} by "
        f"`{by or f'python -m experiments report --parent {name}'}`",
        "",
        "Throughput is over steady-state training steps (warm-up and validation excluded); tokens are "
        "real history items. Wall time is the whole run's process (start-up and data loading included).",
        *shared_device_note(env),
    ]


def plot_subtitle(parent: Run, df: pl.DataFrame, stop: str = "") -> str:
    """What every plot's numbers depend on: device, data, budget (`stop`: early_stopping_words), commit."""
    env, data_sets = _environment(df)
    device = ", ".join(_values(env, "tag.device")) or "?"
    data = ", ".join(f"{folder} ({d[:8]})" for d, folder in data_sets) or "?"
    commits = ", ".join(str(v)[:12] for v in _values(env, "tag.git_commit")) or "?"
    budget = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in json.loads(parent.data.tags.get("sweep.set") or "{}").items()
                       if any(w in k for w in ("max_steps", "limit_train", "max_epochs", "batch_size", "warmup")))
    budget = ", ".join(w for w in (stop, budget) if w)
    return f"{device} | data {data} | {budget or 'budget: see report.md'} | commit {commits}"


def early_stopping_words(parent: Run) -> str:
    """'until val/auc stops rising (at most 3 epochs)' where the ablation file's configs, as they are
    now, end runs by an EarlyStopping callback (the accuracy ablations' budget); '' otherwise."""
    trainer: dict = {}
    try:
        for name in ablation.read(REPO_ROOT / parent.data.tags.get("sweep.file", "")).get("configs") or []:
            path = ablation.config_path(name)
            if path.is_file():
                trainer.update((ablation.yaml_of(path.read_text(), str(path)) or {}).get("trainer") or {})
    except ConfigError:
        return ""
    stops = [(c.get("init_args") or {}) for c in trainer.get("callbacks") or []
             if isinstance(c, dict) and str(c.get("class_path", "")).endswith("EarlyStopping")]
    if not stops:
        return ""
    epochs = json.loads(parent.data.tags.get("sweep.set") or "{}").get("trainer.max_epochs", trainer.get("max_epochs"))
    cap = f" (at most {epochs} epochs)" if epochs else ""
    return f"until {stops[0].get('monitor', 'the monitored metric')} stops rising{cap}"


def shared_device_note(df: pl.DataFrame) -> list[str]:
    """A warning when runs shared the device (`experiments.sweep --parallel`), a note when they ran
    at once on GPUs of their own (`--gpus 0,1`)."""
    shared = sorted({int(p) for p in df["parallel"].to_list() if p and int(p) > 1})
    alone = _where(df, parallel="1") if "concurrent" in df.columns else None  # older runs.csv
    side = [] if alone is None else sorted({int(c) for c in alone["concurrent"].to_list() if c and int(c) > 1})
    lines = [] if not side else [
        "", f"{alone.filter(alone['concurrent'] != '1').height} runs had a GPU to themselves while up to "
            f"{max(side)} runs went at once on different GPUs of one host (`experiments.sweep --gpus`), each "
            "pinned to its own share of the CPU cores."]
    if shared:
        lines += ["", f"**{df.filter(df['parallel'] != '1').height} of these runs shared the GPU with other runs "
                  f"(`--parallel {', '.join(map(str, shared))}`): their throughput and wall time are not "
                  "comparable with runs that had the device alone; peak memory is per process and accuracy "
                  "does not depend on it.**"]
    return lines


def data_meta(client: MlflowClient, df: pl.DataFrame) -> dict:
    """The data's meta.json as logged by the first finished run ({} without one)."""
    import mlflow

    for run_id in _where(df, status="OK")["run_id"].to_list():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                return json.loads(Path(client.download_artifacts(run_id, "data/meta.json", tmp)).read_text())
            except mlflow.exceptions.MlflowException:
                continue
    return {}


def write_report(parent: Run, out_root: Path, commit: str | None = None, log: bool = True) -> Path:
    """Write report.md, report.json, runs.csv and the plots under
    out_root/ablations/<ablation>/<device>/; returns that folder."""
    from mlflow.tracking import MlflowClient

    from experiments import plots
    from kernels.launch_table import device_slug
    from pipeline.tracking import tracking_uri

    client = MlflowClient(tracking_uri())
    axes = runs_.parent_axes(parent)
    df = runs_.grid_frame(parent, json.loads(parent.data.tags.get("sweep.hashes") or "[]") or None)
    if df.height == 0:
        raise ConfigError(f"parent run {parent.info.run_id} has no child runs of its current grid")
    spec = json.loads(parent.data.tags.get("sweep.report") or "{}")
    names = list(axes)
    x = spec.get("x") or names[-1]
    series = [a for a in names if a != x]
    order = axes.get(x, [])
    name = parent.data.tags.get("sweep.name", parent.info.run_name)
    env, _ = _environment(df)
    devices = _values(env, "tag.device")
    out = out_root / "ablations" / safe_name(name) / ("cpu" if "cuda" not in _values(env, "tag.accelerator")
                                                      or not devices else device_slug(devices[0]))
    if lacked := points_lacked(out, df, names):  # a subset (--where, another budget): beside the whole report
        out = out / f"partial-{(commit or next(iter(_values(df, 'tag.git_commit')), 'unknown'))[:7]}"
    out.mkdir(parents=True, exist_ok=True)
    mem, mem_label = runs_.memory_metric(df)
    header, rows = runs_.summary_rows(df, names)
    stop = early_stopping_words(parent)
    lines = [*header_lines(parent, df, commit, stop), *(["", f"A partial report: the whole one in the folder above has "
             f"points this sweep has not run ({', '.join(sorted(lacked))})."] if lacked else []),
             "", "## Runs", "", runs_.markdown_table(header, rows)]
    sub, seeds = plot_subtitle(parent, df, stop), spec.get("seeds")
    made = [plots.line_plot(df, x, order, series, THROUGHPUT, "training examples/s (steady steps)",
                            "Training throughput", out / "throughput.png", subtitle=sub, seeds=seeds),
            plots.line_plot(df, x, order, series, mem, mem_label, "Peak memory", out / "memory.png", subtitle=sub,
                            seeds=seeds)]
    base, ser = spec.get("baseline"), spec.get("series")
    rat: dict = {}
    ratio_axes = [x, *(a for a in names if a not in (x, ser))]
    if base and ser in names and base in df[ser].to_list():
        rat = ratios(df, ratio_axes, ser, base, mem)
        lines += ratio_section(rat, x)
        if x not in (ser, seeds):  # no x to draw the ratios against: the series alone, or seeds (table only)
            made.append(plots.ratio_plot(rat, x, order, f"{base} against the other {ser} values",
                                         out / "speedup.png", baseline=base, subtitle=sub))
    lines += seeds_section(df, seeds, names)
    tol = float(spec.get("converged_within", 0.002))
    converged = convergence_rows(client, df, names, tol)
    lines += convergence_lines(converged, names, tol)
    lines += targets_section(df, spec, mem)
    lines += recovery_section(df, x, spec, mem, out)
    lines += profile_section(out_root, spec.get("profile"))
    meta = data_meta(client, df)
    test = (meta.get("splits") or {}).get("test") or {} if spec.get("oracle") else {}
    oracle = with_whole_window(test.get("oracle"), (test.get("length_stats") or {}).get("max"))
    window = spec["oracle"] if type(spec.get("oracle")) is int else None  # oracle: K, every run's window K
    if oracle:
        lines += oracle_section(df, x, oracle, series, window, test.get("oracle_terms"))
    made.append(plots.line_plot(df, x, order, series, "test/auc", "test AUC", "Test AUC", out / "auc.png",
                                oracle=oracle if window is None else None, subtitle=sub, seeds=seeds, baseline=0.5))
    if spec.get("pareto"):
        made.append(plots.pareto_plot(df, x, names, THROUGHPUT, out / "pareto.png", oracle, subtitle=sub))
    made = [p for p in made if p is not None]
    lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in made)]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    facts = {"targets": target_rows(df, spec, mem) if spec.get("targets") else [], "oracle": oracle,
             "data": meta.get("config"),  # the generator's settings: experiments.summary compares them with the file's
             "converged": [sum(r[-1] != "rising" for r in converged), len(converged)] if converged else None}
    (out / "report.json").write_text(json.dumps(report_json(parent, df, names, commit, facts), indent=1) + "\n")
    df.write_csv(out / "runs.csv")
    if log:
        for path in [out / "report.md", out / "report.json", out / "runs.csv", *made]:
            client.log_artifact(parent.info.run_id, str(path), artifact_path="report")
        title = f"{name}: {parent.data.tags.get('sweep.description', '')}"
        log_comparison(client, parent, df, names, ser if ser in names else None, rat,
                       [a for a in ratio_axes if a != ser], (header, rows), title.strip().rstrip(":"))
    return out


def points_lacked(out: Path, df: pl.DataFrame, axes: list[str]) -> set[str]:
    """The finished points of the report in `out` that this one lacks (the parent's last sweep ran a
    subset: --where, or --set of another budget); that report is then kept, this one goes beside it."""
    try:
        old = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):  # none, or a damaged one: nothing to keep
        return set()
    done = lambda rows, ax: {"/".join(f"{a}={r.get(a)}" for a in ax) for r in rows if r.get("status") == "OK"}  # noqa: E731
    return done(old.get("rows") or [], old.get("axes") or []) - done(df.iter_rows(named=True), axes)


def report_json(parent: Run, df: pl.DataFrame, axes: list[str], commit: str | None, facts: dict) -> dict:
    """What experiments.summary reads: the report's facts and one row per grid point (its labels,
    status, accelerator and metrics)."""
    tags, (env, _) = parent.data.tags, _environment(df)
    commits = _values(df, "tag.git_commit")
    keep = [*axes, "status", "tag.accelerator", *runs_.METRICS]
    return {
        "name": tags.get("sweep.name", parent.info.run_name), "description": tags.get("sweep.description", ""),
        "file": tags.get("sweep.file"), "command": tags.get("sweep.command"), "parent_run": parent.info.run_id,
        "written": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": _values(env, "tag.device"), "commit": [commit] if commit and commits in ([], ["unknown"]) else commits,
        "budget": json.loads(tags.get("sweep.set") or "{}"), "axes": axes, **facts,
        "rows": [{k: r.get(k) for k in keep} for r in df.iter_rows(named=True)],
    }


# child metric -> (its name on the parent and its run's headline/<name>, the decimals shown)
HEADLINE = {"test/auc": ("test_auc", 4), "perf/train_examples_per_s": ("examples_per_s", 0),
            "perf/step_time_ms": ("step_ms", 1), "mem/train_peak_allocated_mb": ("peak_mem_mb", 0),
            "mem/peak_rss_mb": ("peak_rss_mb", 0)}
_BAD = re.compile(r"[^A-Za-z0-9_.\- ]")  # MLflow metric keys: alphanumerics and _ - . space / :


def _part(text: str) -> str:
    return _BAD.sub("_", str(text))


def point_key(row: dict, axes: list[str], series: str | None) -> str:
    """`batch_size_512.jagged`: the non-series axes as name_label, then the series label."""
    parts = [f"{_part(a)}_{_part(row[a])}" for a in axes if a != series]
    if series in axes:
        parts.append(_part(row[series]))
    return ".".join(parts) or "all"


def _headline(row: dict) -> dict[str, float]:
    """A finished run's headline metrics, rounded; the GPU's memory where it ran on one, else the RSS."""
    gpu = row.get("mem/train_peak_allocated_mb") is not None
    return {name: round(float(row[metric]), decimals) for metric, (name, decimals) in HEADLINE.items()
            if row.get(metric) is not None and not (gpu and metric == "mem/peak_rss_mb")}


def headline_metrics(df: pl.DataFrame, axes: list[str], series: str | None, ratios: dict,
                     ratio_axes: list[str]) -> dict[str, float]:
    """The parent's metrics; `ratio_axes` name the labels of each ratio's key (report.ratios)."""
    out: dict[str, float] = {}
    for row in df.filter(df["status"] == "OK").iter_rows(named=True):
        key = point_key(row, axes, series)
        out.update({f"{key}.{name}": value for name, value in _headline(row).items()})
    for pair, r in ratios.items():
        base, other = (p.strip() for p in pair.split("/", 1))
        for key_labels, speed, mem in zip(r["key"], r["throughput"], r["memory"]):
            prefix = ".".join(f"{_part(a)}_{_part(v)}" for a, v in zip(ratio_axes, key_labels))
            name = f"{prefix + '.' if prefix else ''}{_part(base)}_over_{_part(other)}"
            if speed is not None:
                out[f"{name}.speedup"] = round(float(speed), 2)
            if mem is not None:
                out[f"{name}.memory_saving"] = round(float(mem), 2)
    return out


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    style = "table{border-collapse:collapse;font-family:sans-serif;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px}"
    return f"<html><head><style>{style}</style></head><body><table><tr>{head}</tr>{body}</table></body></html>\n"


def log_comparison(client: MlflowClient, parent: Run, df: pl.DataFrame, axes: list[str], series: str | None,
                   ratios: dict, ratio_axes: list[str], table: tuple[list[str], list[list[str]]], title: str) -> str:
    """Put the comparison on the parent run (see the module docstring) and a view of its runs (their
    headline metrics, the parent's ratios); returns the view's link."""
    from mlflow.entities import Metric

    from pipeline.tracking import save_runs_view

    run_id, now = parent.info.run_id, int(time.time() * 1000)
    metrics = headline_metrics(df, axes, series, ratios, ratio_axes)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in sorted(metrics.items())])
    shown = {row["run_id"]: _headline(row) for row in df.filter(df["status"] == "OK").iter_rows(named=True)}
    view = save_runs_view(parent.info.experiment_id, parent.data.tags.get("sweep.name", parent.info.run_name),
                          [run_id, *filter(None, df["run_id"])], shown,  # and the ratios of the series alone:
                          [k for k in metrics if k.endswith(".speedup") and k.count(".") == 1], client=client)
    header, rows = table
    md = runs_.markdown_table(header, rows)
    note = (f"**{title}**\n\n{md}\n\n[The runs side by side]({view}) (their headline metrics first) · "
            "headline metrics of every point are this run's metrics (`<point>.examples_per_s`, "
            "`<point>.<baseline>_over_<other>.speedup`, ...)\n")
    client.set_tag(run_id, "mlflow.note.content", note)
    client.set_tag(run_id, "sweep.view", view)
    client.log_text(run_id, f"# {title}\n\n{md}\n", "comparison/comparison.md")
    client.log_text(run_id, html_table(header, rows), "comparison/comparison.html")
    return view


def write_table(root: Path, abl, parent: Run, df: pl.DataFrame, table: tuple[list, list], total_s: float) -> str:
    """A sweep's summary table as a document (``sweep --results``): ``<root>/training/<device>/<name>.md``
    and its rows in ``.json``; data other than the preset's own (the last config's name, seed 0) adds
    ``_<data dir>-<digest[:8]>`` to the name. A table holding an OK point this one lacks is kept and
    this one goes beside it (``.failed.md`` or ``.partial.md``). Returns the line to print."""
    from data_gen.config import PRESETS, resolve_config
    from kernels.launch_table import device_slug

    (header, rows), data, n = table, abl.points[0].dataset, len(abl.axes)
    meta = json.loads(data.meta_path.read_text())
    preset, have = abl.configs[-1].stem, meta.get("config") or {}
    own = (preset in PRESETS and meta.get("preset") == preset and meta.get("seed") == 0
           and all(k in have and json.dumps(have[k]) == json.dumps(v) for k, v in resolve_config(preset).to_dict().items()))
    name = safe_name(abl.name + ("" if own else f"_{data.dir.name}-{str(meta.get('digest'))[:8]}"))
    out = table_at = root / "training" / device_slug() / f"{name}.md"
    old, done = out.with_suffix(".json"), {"/".join(r[:n]) for r in rows if r[n] == "OK"}
    lost = sorted({"/".join(r[:n]) for r in json.loads(old.read_text())["rows"] if r[n] == "OK"} - done
                  if old.is_file() else [])
    if lost:
        out = out.with_name(f"{name}.{'failed' if len(done) < len(rows) else 'partial'}.md")
    oracle = meta["splits"]["test"].get("oracle", {})
    recent = ", ".join(f"last {k.rsplit('_', 1)[1]}: {v:.3f}" for k, v in oracle.items() if k.startswith("auc_recent_"))
    lines = [*header_lines(parent, df, None, by=parent.data.tags.get("sweep.command", "")), "",
             f"Total wall time {total_s:.0f} s. Test split oracle (the planted model): AUC "
             f"{runs_.fmt(oracle.get('auc'), '.4f')} (from the most recent items only: {recent or '-'}), NE (own-split "
             f"CTR) {runs_.fmt(oracle.get('ne'), '.4f')}.", "", runs_.markdown_table(header, rows), "",
             f"The models' NE is the log loss over the entropy of the training split's CTR "
             f"({runs_.fmt(meta['splits']['train'].get('ctr'), '.4f')}), for every split (the oracle's, over its own "
             "split's CTR, as meta.json has it)."]
    if "cuda" not in df["tag.accelerator"].to_list():
        lines += ["", "On the CPU the jagged ranker runs the kernels' torch path (sequences grouped by length, each "
                  "group padded to its own longest history, torch's fused CPU attention); the Triton kernels, and "
                  "the speed and memory the project is about, are a GPU result."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"name": abl.name, "parent_run": parent.info.run_id,
                                                    "header": header, "rows": rows}, indent=1) + "\n")
    return f"table written to {out}" + (f"; {table_at} kept: it holds OK {', '.join(lost)}, which this run "
                                        f"{'did not finish' if len(done) < len(rows) else 'did not run'}" if lost else "")


@command
def main(argv: list[str] | None = None) -> int:
    p = parser("report", __doc__)
    p.add_argument("--parent", required=True, help="the sweep's parent run: id or name (the ablation's name)")
    p.add_argument("--out", default=str(REPO_ROOT / "runs"), help="results root of OUT/ablations/<name>/<device>/")
    p.add_argument("--commit", default=None, help="git commit to state when the runs recorded 'unknown'")
    p.add_argument("--no-log", action="store_true", help="do not log the files to the parent run")
    args = p.parse_args(argv)
    with runs_.tracking_store() as client:
        parent = runs_.find_parent(client, args.parent)
        out = write_report(parent, Path(args.out), args.commit, log=not args.no_log)
    print((out / "report.md").read_text())
    print(f"written to {out}/ and logged to parent run {parent.info.run_id} (artifacts: report/; its runs in the view "
          f"{parent.data.tags.get('sweep.name', parent.info.run_name)})" if not args.no_log else f"written to {out}/")
    return 0
