"""An MLflow experiment's runs as markdown on stdout (the GPU scripts' summaries): a row per configuration
(run name without ``#<k>``, the k-th repeat), each metric the mean of its finished repeats [range]; for runs
``<attention>-w<W>-ddp[-<variant>]`` the weak-scaling efficiency, examples/s / (W x that of the 1-process DDP
and plain runs; an eager variant's plain base is ``-w1-single-eager``); ``--plot PNG`` draws it against W.

    python experiments/gpu/runs_table.py <experiment> [metric ...] [--plot PNG]     # loop.sh, ddp.sh
"""

from __future__ import annotations

import re
import sys
from collections import Counter

import mlflow

DEFAULT = ("perf/train_examples_per_s", "perf/step_time_ms", "perf/step_time_median_ms", "perf/step_time_p90_ms",
           "perf/warmup_s", "perf/prepare_s", "perf/host_step_ms", "perf/host_gap_ms", "perf/gc_ms",
           "perf/steady_steps", "mem/train_peak_allocated_mb", "mem/peak_rss_mb", "comm/sent_mb_per_step",
           "perf/rank_tokens_max_over_mean", "comm/table_sent_mb_per_step", "comm/table_gather_mb_per_step",
           "test/auc")
SPEED = "perf/train_examples_per_s"


def _values(runs: list, key: str) -> list[float]:
    return [r.data.metrics[key] for r in runs if r.info.status == "FINISHED" and r.data.metrics.get(key) is not None]


def _cell(runs: list, key: str) -> str:
    v = _values(runs, key)
    return "-" if not v else f"{sum(v) / len(v):.4g}" + (f" [{min(v):.4g}, {max(v):.4g}]" if len(v) > 1 else "")


def plot(points: dict[str, list[tuple[int, float, float]]], path: str, stamp: str) -> None:
    import matplotlib.pyplot as plt
    from experiments.figures import finish, legend_outside

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in points.items():  # (W, examples/s, efficiency) from W = 1
        w, speed, eff = zip(*sorted(pts))
        axes[0].plot(w, speed, "o-", label=name)
        axes[1].plot(w, eff, "o-", label=name)
    axes[1].axhline(0.9, color="gray", linestyle="--", label="90%")
    for ax, label in zip(axes, ("examples/s, all GPUs", "weak-scaling efficiency")):
        ax.set(xlabel="GPUs", ylabel=label, xticks=sorted({p[0] for v in points.values() for p in v}), ylim=(0, None))
    legend_outside(axes[1])
    finish(fig, path, "Weak scaling: the same batch per GPU", stamp)


def main(argv: list[str]) -> None:
    png = argv[argv.index("--plot") + 1] if "--plot" in argv else None
    argv = [a for a in argv if a not in ("--plot", png)]
    exp = mlflow.get_experiment_by_name(argv[0])
    keys = tuple(argv[1:]) or DEFAULT
    runs = mlflow.search_runs([exp.experiment_id], output_format="list", order_by=["attributes.start_time ASC"]) \
        if exp else []
    groups: dict[str, list] = {}
    for r in runs:
        groups.setdefault(r.info.run_name.split("#")[0], []).append(r)
    tags = runs[-1].data.tags if runs else {}
    stamp = (f"{tags.get('device')}, torch {tags.get('torch_version')}, triton {tags.get('triton_version')}, "
             f"commit {tags.get('git_commit')}")
    print(stamp + "\n" if runs else "", end="")
    print("| run | status | world size | " + " | ".join(k.split("/")[-1] for k in keys) + " |\n|---|---|---:|"
          + "---:|" * len(keys))
    for name, rs in groups.items():
        status = ", ".join(f"{n} {s}" for s, n in Counter(r.info.status for r in rs).items())
        print(f"| {name} | {status} | {rs[-1].data.tags.get('world_size', '-')} | "
              + " | ".join(_cell(rs, k) for k in keys) + " |")
    scaling = [(m, groups[name]) for name in groups
               if (m := re.fullmatch(r"(\w+)-w(\d+)-ddp(-sharded|-sharded-fixed|-sharded-graphs|-sharded-sparse|-eager)?", name))
               and m.group(2) != "1"]
    if scaling:
        print("\n| attention | W | variant | efficiency vs 1-process DDP | vs single process |\n|---|---:|---|---:|---:|")
    points: dict[str, list] = {}
    for m, rs in scaling:
        attention, world, variant, cells = m.group(1), int(m.group(2)), m.group(3) or "", []
        eager = "-eager" if variant in ("-sharded", "-sharded-fixed", "-eager") else ""
        for base in (f"{attention}-w1-ddp{variant}", f"{attention}-w1-single{eager}"):
            speeds, refs = _values(rs, SPEED), _values(groups.get(base, []), SPEED)
            pairs = [s / (world * r) for s in speeds for r in refs]
            mean = sum(speeds) / len(speeds) / (world * sum(refs) / len(refs)) if pairs else None
            cells.append("-" if not pairs else f"{mean:.1%}" + (f" [{min(pairs):.1%}, {max(pairs):.1%}]" if len(pairs) > 1 else ""))
        if mean is not None:  # against the plain single process
            line = points.setdefault(f"{attention} {variant[1:] or 'replicated'}", [(1, sum(refs) / len(refs), 1.0)])
            line.append((world, sum(speeds) / len(speeds), mean))
        print(f"| {attention} | {world} | {variant[1:] or 'allreduce'} | " + " | ".join(cells) + " |")
    if png and points:
        plot(points, png, f"{stamp}; MLflow experiment {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
