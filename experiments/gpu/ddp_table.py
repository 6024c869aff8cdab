"""The summary of experiments/gpu/ddp.sh from its MLflow runs: weak-scaling efficiency and the
embedding-gradient modes side by side (markdown on stdout).

    python experiments/gpu/ddp_table.py ddp

Run names are ``<backend>-w<devices>-<single|ddp>`` (scaling) and ``jagged-w<devices>-<mode>``.
Efficiency = global examples/s at W processes / (W x examples/s of the same backend at 1),
against the 1-process DDP run and against the plain single-process run.
"""

from __future__ import annotations

import re
import sys

import mlflow

KEYS = ("perf/train_examples_per_s", "perf/step_time_median_ms", "comm/sent_mb_per_step",
        "mem/train_peak_allocated_mb", "mem/peak_rss_mb", "perf/rank_tokens_max_over_mean", "test/auc")


def _runs(experiment: str) -> dict[str, object]:
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = mlflow.search_runs([exp.experiment_id], output_format="list", order_by=["attributes.start_time ASC"])
    return {r.info.run_name: r for r in runs if r.info.status == "FINISHED"}  # the newest of a name wins


def _cell(run, key: str) -> str:
    value = run.data.metrics.get(key) if run is not None else None
    return "-" if value is None else f"{value:.4g}"


def main(argv: list[str]) -> None:
    runs = _runs(argv[0] if argv else "ddp")
    any_run = next(iter(runs.values()), None)
    if any_run is not None:
        tags = any_run.data.tags
        print(f"{tags.get('device')}, torch {tags.get('torch_version')}, triton {tags.get('triton_version')}, "
              f"commit {tags.get('git_commit')}\n")
    short = [k.split("/")[-1] for k in KEYS]
    print("| run | world size | " + " | ".join(short) + " |\n|---|---:|" + "---:|" * len(KEYS))
    for name, r in runs.items():
        print(f"| {name} | {r.data.tags.get('world_size', '-')} | " + " | ".join(_cell(r, k) for k in KEYS) + " |")
    print("\n| backend | W | efficiency vs 1-process DDP | vs single process |\n|---|---:|---:|---:|")
    for name, r in runs.items():
        m = re.fullmatch(r"(\w+)-w(\d+)-ddp", name)
        if not m or m.group(2) == "1":
            continue
        backend, world = m.group(1), int(m.group(2))
        speed = r.data.metrics.get("perf/train_examples_per_s")
        cells = []
        for base in (f"{backend}-w1-ddp", f"{backend}-w1-single"):
            one = runs.get(base)
            ref = one.data.metrics.get("perf/train_examples_per_s") if one is not None else None
            cells.append(f"{speed / (world * ref):.1%}" if speed and ref else "-")
        print(f"| {backend} | {world} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
