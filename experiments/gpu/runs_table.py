"""Print the perf and memory metrics of every run of an MLflow experiment (GPU-call logs).

    python experiments/gpu/runs_table.py <experiment name> [metric ...]
"""

from __future__ import annotations

import sys

import mlflow

DEFAULT = ("perf/train_examples_per_s", "perf/step_time_ms", "perf/step_time_median_ms", "perf/step_time_p90_ms",
           "perf/warmup_s", "perf/prepare_s", "perf/host_step_ms", "perf/host_gap_ms", "perf/gc_ms",
           "perf/steady_steps", "mem/train_peak_allocated_mb", "test/auc")


def main(argv: list[str]) -> None:
    name, keys = argv[0], tuple(argv[1:]) or DEFAULT
    exp = mlflow.get_experiment_by_name(name)
    if exp is None:
        print(f"no experiment {name!r}")
        return
    runs = mlflow.search_runs([exp.experiment_id], output_format="list", order_by=["attributes.start_time ASC"])
    short = [k.split("/")[-1].replace("train_", "").replace("_allocated", "") for k in keys]
    print("| run | status | " + " | ".join(short) + " |")
    print("|---|---|" + "---:|" * len(keys))
    for r in runs:
        m = r.data.metrics
        cells = [f"{m[k]:.4g}" if k in m else "-" for k in keys]
        print(f"| {r.info.run_name} | {r.info.status} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
