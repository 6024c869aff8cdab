"""`python -m experiments <verb> [options]`: one front door to the lab's commands.

A verb's module is imported only when it runs, so `--help` here answers at once."""

from __future__ import annotations

import importlib
import sys

VERBS = {  # verb: (module with main(argv), one line)
    "sweep": ("experiments.sweep", "run an ablation file's points (resumable) and report them"),
    "report": ("experiments.report", "tables and plots of a sweep's MLflow runs"),
    "summary": ("experiments.summary", "experiments/results/REPORT.md from the committed results"),
    "reproduce": ("experiments.reproduce", "rerun one MLflow run from its logged config, compare metrics"),
    "ddp-bench": ("experiments.ddp_bench", "DDP scaling and token balance measurements"),
    "balance": ("experiments.balance", "token balance of the sampler across ranks"),
    "loader-bench": ("experiments.loader_bench", "training loader throughput"),
    "bench": ("experiments.bench.cli", "kernel benchmarks against every peer"),
    "bench-compare": ("experiments.bench.compare", "compare two kernel benchmark result files"),
    "bench-s2": ("experiments.bench.s2", "S2 shards against dense attention: speed and error"),
    "gpu-check": ("experiments.bench.gpu_check", "compile every Triton kernel for a GPU target, no GPU needed"),
    "config-sweep": ("experiments.tuning.sweep", "time every launch config of every kernel family"),
    "costmodel": ("experiments.tuning.costmodel", "evaluate, report and export the launch-config cost model"),
}
DRIVERS = ("sweep",)  # it runs fits as children: SIGTERM or a reader that goes away must not orphan them


def usage() -> str:
    width = max(map(len, VERBS))
    rows = "\n".join(f"  {verb:<{width}}  {line}" for verb, (_, line) in VERBS.items())
    return f"usage: python -m experiments <verb> [options]   (<verb> --help for its options)\n\nverbs:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"error: unknown verb {verb!r}\n\n{usage()}", file=sys.stderr, end="")
        return 2
    if verb not in DRIVERS:
        return importlib.import_module(VERBS[verb][0]).main(rest) or 0
    from experiments.proc import sigterm_as_interrupt
    from pipeline.errors import outliving_readers  # the driver and its runs go on without a reader

    sigterm_as_interrupt()
    with outliving_readers():
        return importlib.import_module(VERBS[verb][0]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
