"""The summary of experiments/gpu/ddp.sh from its MLflow runs: weak-scaling efficiency and the
embedding-gradient modes side by side (markdown on stdout).

    python experiments/gpu/ddp_table.py ddp

Runs are named ``<attention>-w<devices>-<single|ddp>`` and ``jagged-w<devices>-<mode>`` (``#<k>``:
the k-th repeat). A cell is the mean over repeats [their range]; efficiency = examples/s at W
processes / (W x the same layout's at 1), against the 1-process DDP run and the plain one.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

import mlflow

KEYS = ("perf/train_examples_per_s", "perf/step_time_median_ms", "comm/sent_mb_per_step",
        "mem/train_peak_allocated_mb", "mem/peak_rss_mb", "perf/rank_tokens_max_over_mean", "test/auc")
SPEED = "perf/train_examples_per_s"


def _runs(experiment: str) -> dict[str, list]:
    """FINISHED runs of the experiment grouped by configuration (the name without ``#k``)."""
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = mlflow.search_runs([exp.experiment_id], output_format="list", order_by=["attributes.start_time ASC"])
    groups: dict[str, list] = defaultdict(list)
    for r in runs:
        if r.info.status == "FINISHED":
            groups[r.info.run_name.split("#")[0]].append(r)
    return dict(groups)


def _values(runs: list, key: str) -> list[float]:
    return [r.data.metrics[key] for r in runs if r.data.metrics.get(key) is not None]


def _cell(runs: list, key: str) -> str:
    values = _values(runs, key)
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:.4g}" + (f" [{min(values):.4g}, {max(values):.4g}]" if len(values) > 1 else "")


def main(argv: list[str]) -> None:
    groups = _runs(argv[0] if argv else "ddp")
    any_run = next((runs[-1] for runs in groups.values()), None)
    if any_run is not None:
        tags = any_run.data.tags
        print(f"{tags.get('device')}, torch {tags.get('torch_version')}, triton {tags.get('triton_version')}, "
              f"commit {tags.get('git_commit')}\n")
    short = [k.split("/")[-1] for k in KEYS]
    print("| run | repeats | world size | " + " | ".join(short) + " |\n|---|---:|---:|" + "---:|" * len(KEYS))
    for name, runs in groups.items():
        print(f"| {name} | {len(runs)} | {runs[-1].data.tags.get('world_size', '-')} | "
              + " | ".join(_cell(runs, k) for k in KEYS) + " |")
    print("\n| attention | W | table sync | efficiency vs 1-process DDP | vs single process |\n|---|---:|---|---:|---:|")
    for name, runs in groups.items():
        m = re.fullmatch(r"(\w+)-w(\d+)-ddp(-rows)?", name)
        if not m or m.group(2) == "1":
            continue
        attention, world = m.group(1), int(m.group(2))
        speeds = _values(runs, SPEED)
        cells = []
        for base in (f"{attention}-w1-ddp", f"{attention}-w1-single"):
            refs = _values(groups.get(base, []), SPEED)
            if not speeds or not refs:
                cells.append("-")
                continue
            ratio = (sum(speeds) / len(speeds)) / (world * sum(refs) / len(refs))
            pairs = [s / (world * r) for s in speeds for r in refs]
            spread = f" [{min(pairs):.1%}, {max(pairs):.1%}]" if len(pairs) > 1 else ""
            cells.append(f"{ratio:.1%}{spread}")
        sync = "rows" if m.group(3) else "allreduce"
        print(f"| {attention} | {world} | {sync} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
