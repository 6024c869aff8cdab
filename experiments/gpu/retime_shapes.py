"""Is a held-out shape's slowdown the model's error or the sweep's timing noise? Every config of
the named (family, shape) pairs of a sweep Parquet timed again, ROUNDS times, the configs in a new
random order each round, with the sweep's timing (CUDA-graph replay, `--rep-ms` ms a config).

    python experiments/gpu/retime_shapes.py --data SWEEP.parquet --shapes softmax_bwd:B256-N4096-f0.1-H64-D0-Tq0-bfloat16 \
        [--rounds 3] [--rep-ms 40] [--out retimed.json]

Writes, per (family, shape, config): the sweep's ms and each round's ms. Read it with the cost
model's picks (`costmodel eval`'s JSON: model_config, best_config per shape) to see whether the
pick's slowdown holds when both configs are timed again.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels._launch_configs import forced
from experiments.tuning.costmodel import shape_of
from experiments.bench.measure import graph_ms
from experiments.bench.stamp import make_stamp
from experiments.tuning.families import complete, make_case


def main(argv=None) -> int:
    import polars as pl

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python experiments/gpu/retime_shapes.py", description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the sweep's Parquet")
    p.add_argument("--shapes", required=True, help="comma-separated family:shape_id pairs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--out", default="retimed.json")
    args = p.parse_args(argv)
    pairs = [pair.split(":", 1) for pair in args.shapes.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        p.error(f"--shapes {args.shapes!r}: give family:shape_id pairs, comma-separated")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the sweep's timing is CUDA-graph replay)", file=sys.stderr)
        return 2
    rows = pl.read_parquet(args.data).filter(pl.col("status") == "ok").to_dicts()
    device = torch.device("cuda")
    rng = random.Random(0)
    out = {"stamp": make_stamp(device), "rounds": args.rounds, "rep_ms": args.rep_ms, "configs": []}
    t0 = time.perf_counter()
    for family, shape_id in pairs:
        pair = f"{family}:{shape_id}"
        mine = [r for r in rows if r["family"] == family and r["shape_id"] == shape_id]
        if not mine:
            print(f"error: no ok rows of {pair} in {args.data}", file=sys.stderr)
            return 2
        fn, _ = make_case(family, shape_of(mine[0]), device)
        recs = [{"family": family, "shape_id": shape_id, "config": r["config"], "sweep_ms": r["ms"], "ms": []}
                for r in mine]
        for _ in range(args.rounds):
            for rec in rng.sample(recs, len(recs)):
                with forced(family, complete(family, json.loads(rec["config"]))):
                    fn()  # compile (cached after the first round)
                    rec["ms"].append(graph_ms(fn, device, args.rep_ms))
        out["configs"] += recs
        best = min(recs, key=lambda r: statistics.median(r["ms"]))
        print(f"{pair}: {len(recs)} configs x {args.rounds} rounds, fastest by median {best['config']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
