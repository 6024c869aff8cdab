"""Rerun one MLflow run from its logged config and data digest; print its metrics beside the original.

    python -m experiments reproduce --run <run id> [--data DIR] [--rtol R] [--out experiments/results]
    make reproduce RUN=<run id>

Quality metrics must match exactly on CPU, within ``--rtol`` (5e-3) on CUDA (docs/experiments.md).
Exit 0 when every compared metric matches, 1 when one does not, 2 for bad input."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

import yaml

from experiments import parser, proc as _proc, runs as runs_, sweep
from pipeline.errors import ConfigError, command

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


QUALITY_PREFIXES = ("train/", "val/", "test/")
INFO_PREFIXES = ("perf/", "mem/")
GPU_RTOL = 5e-3


def rename_old_keys(config: dict) -> list[str]:
    """model.ranker.backend renamed model.ranker.attention in a nested config, in place (a run
    recorded before the rename); returns 'old -> new' per key renamed."""
    ranker = (config.get("model") or {}).get("ranker")
    if not isinstance(ranker, dict) or "backend" not in ranker:
        return []
    ranker["attention"] = ranker.pop("backend")
    return ["model.ranker.backend -> model.ranker.attention"]


def regenerate_hint(client: MlflowClient, run: Run, data_dir: str) -> str:
    """The data_gen command that rebuilds the run's data, from the meta.json it logged."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        try:
            meta = json.loads(Path(client.download_artifacts(run.info.run_id, "data/meta.json", tmp)).read_text())
        except (mlflow.exceptions.MlflowException, OSError):
            return "regenerate it with the data_gen command and seed it was made with"
    from data_gen.config import PRESETS, resolve_config

    preset, config = meta.get("preset", "custom"), meta.get("config", {})
    base = resolve_config(preset if preset in PRESETS else "tiny").to_dict()
    overrides = [f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
                 for k, v in config.items() if k in base and base[k] != v and not (isinstance(v, list) and list(base[k]) == v)]
    return (f"regenerate it: python -m data_gen generate --preset {preset} --seed {meta.get('seed', 0)} "
            + " ".join(overrides) + f" --out {data_dir}").replace("  ", " ")


def check_data(client: MlflowClient, run: Run, data_dir: str) -> None:
    want = run.data.tags.get("data_digest")
    meta_path = Path(data_dir) / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"no data set at {data_dir} (run {run.info.run_id} trained on digest {want}); "
                          f"{regenerate_hint(client, run, data_dir)}")
    have = json.loads(meta_path.read_text()).get("digest")
    if want and have != want:
        raise ConfigError(f"data digest mismatch: {meta_path} has {have}, but run {run.info.run_id} trained on "
                          f"{want}; {regenerate_hint(client, run, data_dir)} (or pass --data DIR)")


def compare(orig: dict[str, float], new: dict[str, float], rtol: float) -> tuple[list[list[str]], bool, float]:
    """(rows: metric, original, reproduced, rel. diff, verdict), all matched, largest rel. diff."""
    rows, ok, worst = [], True, 0.0
    for key in sorted(k for k in orig if k.startswith(QUALITY_PREFIXES + INFO_PREFIXES)):
        a, b = orig[key], new.get(key)
        rel = None if b is None else abs(a - b) / max(abs(a), 1e-12)
        if key.startswith(INFO_PREFIXES):
            verdict = "not compared"
        else:
            match = b is not None and (a == b if rtol == 0 else rel <= rtol)
            ok &= match
            worst = max(worst, rel if rel is not None else float("inf"))
            verdict = "match" if match else "DIFFERS"
        rows.append([key, f"{a:.10g}", "-" if b is None else f"{b:.10g}", "-" if rel is None else f"{rel:.2e}", verdict])
    return rows, ok, worst


def reproduce(client: MlflowClient, run_id: str, data: str | None, rtol: float | None, out: str | None = None) -> int:
    import mlflow
    import torch

    from pipeline.tracking import check_tracking, tracking_uri  # MLflow: not imported for --help

    try:
        run = client.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise ConfigError(f"no MLflow run {run_id} at {tracking_uri()}") from None
    tmp = Path(tempfile.mkdtemp(prefix="reproduce-"))
    try:
        config_path = Path(client.download_artifacts(run_id, "config.yaml", str(tmp)))
    except mlflow.exceptions.MlflowException:
        raise ConfigError(f"run {run_id} has no config.yaml artifact: it was not recorded by `pipeline fit`") from None
    config = yaml.safe_load(config_path.read_text())
    renamed = rename_old_keys(config)
    if renamed:  # recorded before a key was renamed: rerun it under today's names
        print(f"note: the recorded config uses old keys, renamed: {', '.join(renamed)}", flush=True)
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    data_dir = str(Path(data or config["data"]["data_dir"]).resolve())
    check_data(client, run, data_dir)
    on_cpu = run.data.tags.get("accelerator") == "cpu" and not torch.cuda.is_available()
    rtol = (0.0 if on_cpu else GPU_RTOL) if rtol is None else rtol
    cmd = [*sweep.FIT_COMMAND, "--config", str(config_path), "--data.data_dir", data_dir,
           "--mlflow.parent_run_id", "null", "--mlflow.run_name", f"reproduce-{run.info.run_name}"]
    print(f"rerunning {run_id} ({run.info.run_name}) from its config.yaml on {data_dir}\n  " + " ".join(cmd[1:]), flush=True)
    experiments = [e.experiment_id for e in client.search_experiments()]
    query = f"tags.reproduces = '{run.info.run_id}'"  # the store's own (hex) id: no quoting
    known = {r.info.run_id for r in client.search_runs(experiments, query)}
    rc, output, _ = _proc.stream(cmd, _proc.child_env({"reproduces": run_id}), None)
    new = runs_.new_run(client, [e.experiment_id for e in client.search_experiments()], query, known)
    if rc != 0 or new is None or new.info.status != "FINISHED":
        print(f"error: the rerun failed ({_proc.error_line(output)})", file=sys.stderr)
        return 1
    rows, ok, worst = compare(run.data.metrics, new.data.metrics, rtol)
    print("\n" + runs_.text_table(["metric", "original", "reproduced", "rel. diff", ""], rows))
    print(f"original {run_id} ({run.data.tags.get('device')}), reproduction {new.info.run_id} "
          f"({new.data.tags.get('device')}); data digest {run.data.tags.get('data_digest')}")
    rule = "exact equality" if rtol == 0 else f"rtol {rtol:g}"
    verdict = f"{'REPRODUCED' if ok else 'NOT REPRODUCED'}: quality metrics, {rule}; largest relative difference {worst:.2e}"
    print(verdict)
    if out:  # what experiments.summary reads
        from kernels.launch_table import device_slug

        path = Path(out) / "training" / device_slug() / "reproduce.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "run": run_id, "reproduction": new.info.run_id, "device": new.data.tags.get("device"),
            "original_device": run.data.tags.get("device"), "data_digest": run.data.tags.get("data_digest"),
            "result": verdict, "rows": rows}, indent=1) + "\n")
        print(f"written to {path}")
    return 0 if ok else 1


@command
def main(argv: list[str] | None = None) -> int:
    p = parser("reproduce", __doc__)
    p.add_argument("--run", required=True, help="MLflow run id")
    p.add_argument("--data", default=None, help="data directory (default: the one in the run's config)")
    p.add_argument("--rtol", type=float, default=None,
                   help=f"relative tolerance of the quality metrics (default: 0 on CPU, {GPU_RTOL:g} on CUDA)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="results root: also write the verdict to DIR/training/<device>/reproduce.json")
    args = p.parse_args(argv)
    with runs_.tracking_store() as client:
        return reproduce(client, args.run, args.data, args.rtol, args.out)

