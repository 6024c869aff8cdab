"""Is a launch table's call time its own? Self-attention fwd+bwd call time with the table and with
the hand rules, interleaved in ONE process (the two switch every round), on the paper suite's
host-bound shapes, where two H100 runs of `experiments.bench attention` (hand first and table first)
had the table's call time 1.2-2.1x the hand rules' at equal kernel time.

    python experiments/gpu/table_call_ab.py [--rounds 8] [--calls 200] [--out DIR]

Per (shape, variant): the median over rounds of ms per call (wall over `calls` back-to-back calls,
synchronized at both ends) and of the host's ms per call (wall before the closing synchronize).
Then a cProfile of 200 calls of the first shape under each variant (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from kernels import _launch_configs as lc
from kernels import jagged_flash_attention, offsets_from_lengths
from experiments.bench.suites import make_lengths
from kernels.launch_table import LaunchTable, table_path

SHAPES = [(1024, 1024, 2, 64, 0.1), (1024, 256, 2, 64, 0.25), (512, 2048, 2, 64, 0.1), (2048, 512, 2, 64, 0.1),
          (4096, 128, 4, 32, 0.3), (1024, 1024, 2, 64, 0.25)]


def make_step(B: int, N: int, H: int, D: int, fill: float):
    lengths = make_lengths(B, N, fill, seed=0)
    offsets = offsets_from_lengths(lengths).to("cuda", torch.int32)
    T = int(lengths.sum())
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        out = jagged_flash_attention(q, k, v, offsets, N)
        torch.autograd.grad(out, (q, k, v), do)

    return step


def time_calls(step, calls: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3, host / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    path = table_path(torch.cuda.get_device_name())
    if path is None:
        raise SystemExit("no launch table for this GPU")
    variants = {"hand": None, "table": LaunchTable.load(path)}
    steps = {s: make_step(*s) for s in SHAPES}
    res: dict = {f"{s}": {v: {"ms": [], "host_ms": []} for v in variants} for s in SHAPES}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            lc.use_table(variants[name])
            for s, step in steps.items():
                for _ in range(5):
                    step()
                ms, host = time_calls(step, args.calls)
                res[f"{s}"][name]["ms"].append(ms)
                res[f"{s}"][name]["host_ms"].append(host)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; table {path.name} ({len(variants['table'])} entries)")
    print(f"{'shape (B, N, H, D, fill)':34s} {'hand ms':>8s} {'table ms':>8s} {'t/h':>6s} {'hand host':>9s} {'table host':>10s}"
          f"  spread (max/min over rounds) hand, table")
    for s in SHAPES:
        h, t = res[f"{s}"]["hand"], res[f"{s}"]["table"]
        mh, mt = statistics.median(h["ms"]), statistics.median(t["ms"])
        print(f"{str(s):34s} {mh:8.3f} {mt:8.3f} {mt / mh:6.3f} {statistics.median(h['host_ms']):9.3f} "
              f"{statistics.median(t['host_ms']):10.3f}  {max(h['ms']) / min(h['ms']):.2f}, {max(t['ms']) / min(t['ms']):.2f}")
    for name, table in variants.items():
        lc.use_table(table)
        step = steps[SHAPES[0]]
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        print(f"\n== cProfile, {name}, 200 calls of {SHAPES[0]}\n" + buf.getvalue()[-3500:])
    Path(args.out, "table_call_ab.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
