"""Do a launch table's changed entries pay? For every shape of the cost model's export grid (the
unswept shapes around the swept ones, `costmodel.dense_grid`, and the swept ones) whose entry in
the NEW table names another config than in the OLD one, both configs timed on that shape, ROUNDS
times, the two in a new random order each round, with the sweep's timing (CUDA-graph replay,
`--rep-ms` ms a config). The paper suite times the ops forward only; this times what a table
change touches, backward kernels included.

    python experiments/gpu/table_entries_ab.py --old OLD.json --new kernels/configs/<gpu>.json \
        --data SWEEP.parquet --families softmax_bwd [--rounds 3] [--rep-ms 40] [--out ab.json]

Prints and writes, per shape: the two configs, each round's ms, and new/old by median; then the
geometric mean of new/old and its worst shape.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels._launch_configs import forced
from experiments.tuning.costmodel import dense_grid, load, shape_of, table_shape
from experiments.bench.measure import graph_ms
from experiments.bench.report import read_json
from experiments.bench.stamp import make_stamp
from experiments.tuning.families import SweepShape, complete, hand_config, make_case
from kernels.launch_table import LaunchTable, shape_key


def _entries(path: str) -> dict[str, dict]:
    return {key: e["config"] for key, e in LaunchTable.load(path).exact.items()}


def changed_shapes(old: dict | None, new: dict, rows: list[dict], family: str) -> list[tuple[SweepShape, dict, dict]]:
    """(shape, old config, new config) for each grid shape of `family` whose exact entry differs
    (old None: from the hand rule's config for the shape)."""
    mine = [r for r in rows if r["family"] == family]
    swept = {r["shape_id"]: r for r in mine}  # one row per swept shape: its shape columns
    out, seen = [], set()
    for s in dense_grid(family, mine) + list(swept.values()):
        key = shape_key(family, table_shape(family, s))
        shape = shape_of(s)
        before = hand_config(family, shape) if old is None else old.get(key)
        if (shape.id in seen or before is None or key not in new
                or complete(family, before) == complete(family, new[key])):
            continue
        seen.add(shape.id)
        out.append((shape, before, new[key]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python experiments/gpu/table_entries_ab.py", description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the launch table before, or 'hand' (the hand rules)")
    p.add_argument("--new", required=True, help="the launch table after")
    p.add_argument("--data", required=True, help="the sweep's Parquet (its shapes span the export's grid)")
    p.add_argument("--families", required=True, help="comma-separated kernel families")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--skip-timed", default="", help="comma-separated outputs of earlier runs: their shapes are "
                   "left out (a second sample, disjoint from the first)")
    p.add_argument("--deadline-s", type=float, default=math.inf, help="start no shape after this many seconds")
    p.add_argument("--out", default="table-entries-ab.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the sweep's timing is CUDA-graph replay)", file=sys.stderr)
        return 2
    old = None if args.old == "hand" else _entries(args.old)
    new, rows = _entries(args.new), load(args.data)
    done = {(x["family"], x["shape_id"]) for f in args.skip_timed.split(",") if f
            for x in read_json(f)["shapes"]}
    device = torch.device("cuda")
    rng = random.Random(0)
    out = {"stamp": make_stamp(device), "old": args.old, "new": args.new, "rounds": args.rounds,
           "rep_ms": args.rep_ms, "shapes": []}
    t0 = time.perf_counter()
    for family in [f for f in args.families.split(",") if f]:
        todo = [t for t in changed_shapes(old, new, rows, family) if (family, t[0].id) not in done]
        print(f"{family}: {len(todo)} shapes whose entry changed (and not timed before)", flush=True)
        for shape, c_old, c_new in rng.sample(todo, len(todo)):
            if time.perf_counter() - t0 > args.deadline_s:
                print(f"  deadline: {family} shapes left untimed", flush=True)
                break
            fn, _ = make_case(family, shape, device)
            ms = {"old": [], "new": []}
            for _ in range(args.rounds):
                for which in rng.sample(["old", "new"], 2):
                    with forced(family, complete(family, c_old if which == "old" else c_new)):
                        fn()  # compile (cached after the first round)
                        ms[which].append(graph_ms(fn, device, args.rep_ms))
            ratio = statistics.median(ms["new"]) / statistics.median(ms["old"])
            out["shapes"].append({"family": family, "shape_id": shape.id, "old_config": c_old, "new_config": c_new,
                                  "old_ms": ms["old"], "new_ms": ms["new"], "new_over_old": ratio})
            print(f"  {shape.id:<44} new/old {ratio:.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    ratios = [s["new_over_old"] for s in out["shapes"]]
    if ratios:
        worst = max(out["shapes"], key=lambda s: s["new_over_old"])
        out["geomean_new_over_old"] = math.exp(statistics.fmean(math.log(r) for r in ratios))
        print(f"{len(ratios)} shapes: new/old geomean {out['geomean_new_over_old']:.3f}, best {min(ratios):.3f}, "
              f"worst {worst['new_over_old']:.3f} ({worst['family']}:{worst['shape_id']})")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
