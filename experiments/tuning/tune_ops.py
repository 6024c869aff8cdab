"""Tile/warp/stage candidates of the jagged feature-interaction kernels, timed on one GPU.

    python -m experiments tune-ops [--budget-s 200] [--ops a,b] [--densities 0.1,0.5]

(on the GPU machine: `python3 -m experiments tune-ops` after the wheel install line; a CPU
check of the machinery: `TRITON_INTERPRET=1 python -m experiments tune-ops --device cpu
--shape 6,64,32`). Output: one row per (op, candidate, density), then the best candidate per op
as the dict literal to put into the kernel module; docs/tuning.md records what was chosen.

Shapes: B=1024, N=1024, D=128 (K = M = D for the bmm ops), bf16, densities 0.1/0.25/0.5/0.75,
lengths and inputs exactly as `python -m experiments bench ops --suite paper` draws them (same
Shape, seed, make_jagged, OpSpec inputs and references). Each candidate overrides the module-
level launch dicts of kernels/_*_triton.py (restored afterwards; no file is edited), runs the
public op once against the fp32 reference (max abs error, FAIL above the bench's tolerance),
then is timed like the bench: triton.testing.do_bench median, L2 flushed, under no_grad.
Memory-bound ops: GB/s of the bench's byte count and % of the copy bandwidth measured here as
the bench measures it. bmm: TFLOP/s of real tokens, GB/s of the minimal traffic
(T*K + T*M + B*K*M elements), and the padded torch.bmm peer's time (speedup = torch / ours).
jagged_softmax_bwd (the launcher, not in the bench) is timed after the forward ops if time is
left. The run stops starting new work when --budget-s is spent. Softmax's STREAM_N takes effect
where the mean length fits BLOCK_N: longer, the hand rule (`_softmax_triton.softmax_config`)
streams in BLOCK_N-row tiles whatever the candidate says.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

import torch

from kernels import _bmm_triton, _conversions_triton, _elementwise_triton, _launch_configs, _softmax_triton
from experiments.bench.base import RunConfig
from experiments.bench.layouts import make_jagged
from experiments.bench.measure import CHECK_TOL, bench_ms, free_memory, measure_ceilings, rel_err
from experiments.bench.providers_ops import OPS
from experiments.bench.suites import Shape

DTYPE = torch.bfloat16
ES = 2  # bf16 element size: the bmm config tables are keyed by it

# op -> (the module dict its launcher reads, its keys, candidate values); the first candidate of
# each list is the shipped default.
P2J = ("BLOCK_N", "BLOCK_D", "num_warps")
SOFT = ("BLOCK_N", "SMALL_N", "BLOCK_H", "STREAM_N", "num_warps")
DBMM = ("BLOCK_T", "BLOCK_M", "BLOCK_K", "num_warps", "num_stages")
JBMM = ("BLOCK_K", "BLOCK_M", "BLOCK_T", "T_SPLITS", "num_warps", "num_stages")
ROW_TILES = [(64, 128, 4), (32, 128, 4), (128, 128, 4), (128, 128, 8)]
CANDIDATES = {
    "padded_to_jagged": (_conversions_triton.P2J_CONFIG, P2J, [(128, 128, 8), (64, 128, 4), (32, 128, 4),
                                                                (256, 128, 8)]),
    "jagged_dense_elementwise_add": (_elementwise_triton.FWD_CONFIG, P2J, ROW_TILES),
    "jagged_dense_elementwise_mul": (_elementwise_triton.FWD_CONFIG, P2J, ROW_TILES),
    # softmax: the shipped ladder (32-256 rows, 64-row streamed tiles), the two-tile config it
    # replaced (128 and 256 rows, 256-row streamed tiles), and wider column blocks with smaller
    # tiles for short sequences
    "jagged_softmax": (_softmax_triton.SOFTMAX_CONFIG, SOFT,
                       [(256, 32, 16, 64, 4), (256, 128, 16, 256, 4), (128, 16, 32, 64, 4), (64, 16, 64, 32, 4)]),
    "jagged_dense_bmm": (_bmm_triton.DENSE_BMM_CONFIGS[ES], DBMM,
                         [(128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 128, 8, 1),
                          (64, 64, 32, 4, 3)]),  # the last: the old tiles, on the new slot grid
    "jagged_jagged_bmm": (_bmm_triton.JAGGED_BMM_CONFIGS[ES], JBMM,
                          [(128, 128, 64, 1, 8, 3), (64, 128, 64, 1, 4, 3), (128, 128, 64, 4, 8, 3),
                           (128, 128, 64, 8, 8, 3)]),  # the last two: split-T over 4 and 8 chunks
}
CANDIDATES["jagged_softmax_bwd"] = CANDIDATES["jagged_softmax"]


@contextlib.contextmanager
def patched(cfg: dict, keys: tuple, values: tuple):
    saved = dict(cfg)
    cfg.update(zip(keys, values))
    try:
        yield
    finally:
        cfg.clear()
        cfg.update(saved)


def label(keys: tuple, values: tuple) -> str:
    short = {"num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short.get(k, k.removeprefix('BLOCK_').replace('SMALL_N', 'S'))}{v}"
                    for k, v in zip(keys, values))


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.monotonic(), budget_s

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def softmax_bwd_case(j):
    """(fn, fp32 reference, bytes moved) of the softmax backward launcher on this input: g and y
    read, grad written; the reference y * (g - sum_rows(g * y)) per sequence (no truncation:
    lengths are clipped to N)."""
    from kernels import jagged_softmax

    with torch.no_grad():
        y = jagged_softmax(j.q, j.offsets, j.shape.N, backend="triton")
    g = torch.randn_like(y)
    seg = torch.repeat_interleave(torch.arange(j.shape.B, device=y.device), j.lengths.to(y.device))
    dot = torch.zeros(j.shape.B, y.shape[1], device=y.device).index_add_(0, seg, g.float() * y.float())
    ref = y.float() * (g.float() - dot[seg])
    fn = lambda: _softmax_triton.jagged_softmax_bwd_triton(g, y, j.offsets, j.shape.N)  # noqa: E731
    return fn, ref, 3.0 * j.T * j.shape.D * ES


def run_density(density: float, ops: list[str], clock: Clock, args, copy_gbps: float, rows: list):
    dev = torch.device(args.device)
    cfg = RunConfig(device=dev, dtype=DTYPE, ours_backend="triton", warmup_ms=args.warmup, rep_ms=args.rep)
    B, N, D = (int(x) for x in args.shape.split(","))
    shape = Shape(B, N, 1, D, density, tags=("large",))
    j = make_jagged(shape, dev, DTYPE, 0, per_head=False)
    print(f"-- density {density}: T={j.T:,} max_len={j.max_len}  ({clock.elapsed():.0f} s)", flush=True)
    specs = {op.name: op for op in OPS}
    for name in ops:
        if clock.left() < 5:
            print(f"   {name}: skipped (budget spent)", flush=True)
            continue
        table, keys, cands = CANDIDATES[name]
        peer_ms = None
        if name == "jagged_softmax_bwd":
            fn, ref, nbytes = softmax_bwd_case(j)
            flops = None
            conv = lambda o: o  # noqa: E731
        else:
            spec = specs[name]
            j.extra = spec.make_inputs(j)
            ref = spec.reference(j)
            ours = spec.providers[0].prepare(j, cfg)
            fn, conv = ours.fwd, ours.to_ref
            nbytes = spec.bytes_moved(j) if spec.bytes_moved else (2 * j.T * D + B * D * D) * ES
            flops = spec.flops(j) if spec.flops else None
            if flops:
                peer = next(p for p in spec.providers if p.name == "torch_padded").prepare(j, cfg)
                with torch.no_grad():
                    peer_ms = bench_ms(peer.fwd, dev, args.warmup, args.rep)
                del peer
        for values in cands:
            if clock.left() < 5:
                print(f"   {name} {label(keys, values)}: skipped (budget spent)", flush=True)
                continue
            with patched(table, keys, values):
                row = dict(op=name, cfg=label(keys, values), density=density)
                try:
                    with torch.no_grad():
                        out = conv(fn())
                        err = float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0
                        rel = rel_err(out.float(), ref.float())
                        del out
                        ms = bench_ms(fn, dev, args.warmup, args.rep)
                    ok = math.isfinite(err) and rel <= CHECK_TOL[DTYPE]
                    row.update(ms=ms, err=err, status="ok" if ok else f"FAIL rel {rel:.2e}")
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row
                    row.update(ms=None, err=None, status=f"error {type(exc).__name__}: {str(exc)[:120]}")
                    free_memory(dev)
            row["gbps"] = nbytes / row["ms"] / 1e6 if row["ms"] else None
            row["pct"] = 100 * row["gbps"] / copy_gbps if row["gbps"] else None
            row["tflops"] = flops / row["ms"] / 1e9 if flops and row["ms"] else None
            row["peer_ms"] = peer_ms
            rows.append(row)
            print(fmt(row), flush=True)
        j.extra = {}
        del fn, ref
        free_memory(dev)
    del j
    free_memory(dev)


HEADER = f"{'op':<29} {'config':<24} {'dens':>5} {'ms':>8} {'GB/s':>6} {'%copy':>6} {'TF/s':>6} {'torch ms':>8} {'x':>5} {'maxerr':>8}  status"


def fmt(r: dict) -> str:
    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    speed = r["peer_ms"] / r["ms"] if r.get("peer_ms") and r.get("ms") else None
    return (f"{r['op']:<29} {r['cfg']:<24} {r['density']:>5g} {f(r['ms'], '8.4f'):>8} {f(r['gbps'], '6.0f'):>6} "
            f"{f(r['pct'], '5.0f'):>5}% {f(r['tflops'], '6.1f'):>6} {f(r['peer_ms'], '8.4f'):>8} "
            f"{f(speed, '5.2f'):>5} {f(r['err'], '8.2e'):>8}  {r['status']}")


def summary(rows: list[dict]) -> None:
    print("\n== best config per op (geomean ms over the densities it ran; ok rows only) ==")
    for op in dict.fromkeys(r["op"] for r in rows):
        by_cfg: dict[str, list] = {}
        for r in rows:
            if r["op"] == op and r["status"] == "ok" and r["ms"]:
                by_cfg.setdefault(r["cfg"], []).append(r)
        n_max = max((len(v) for v in by_cfg.values()), default=0)
        full = {c: v for c, v in by_cfg.items() if len(v) == n_max}
        if not full:
            print(f"  {op}: no ok rows")
            continue
        gm = {c: math.exp(sum(math.log(r["ms"]) for r in v) / len(v)) for c, v in full.items()}
        best = min(gm, key=gm.get)
        worst_pct = min((r["pct"] for r in full[best] if r["pct"]), default=None)
        worst_x = min((r["peer_ms"] / r["ms"] for r in full[best] if r.get("peer_ms")), default=None)
        extra = f", min {worst_pct:.0f}% copy" if worst_pct else ""
        extra += f", min {worst_x:.2f}x torch" if worst_x else ""
        default = label(CANDIDATES[op][1], CANDIDATES[op][2][0])
        print(f"  {op:<29} best [{best}] geomean {gm[best]:.4f} ms over {n_max} densities{extra}"
              f"  (default [{default}] {gm.get(default, float('nan')):.4f} ms)")
        keys, cands = CANDIDATES[op][1], CANDIDATES[op][2]
        values = next(v for v in cands if label(keys, v) == best)
        print(f"  {'':<29} -> {dict(zip(keys, values))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m experiments tune-ops", description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no new work after this")
    ap.add_argument("--ops", default=",".join(CANDIDATES), help="comma-separated")
    ap.add_argument("--densities", default="0.1,0.25,0.5,0.75")
    ap.add_argument("--warmup", type=float, default=25.0)
    ap.add_argument("--rep", type=float, default=100.0)
    ap.add_argument("--shape", default="1024,1024,128", help="B,N,D (a CPU smoke run: TRITON_INTERPRET=1, "
                    "--device cpu --shape 6,64,32)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    clock = Clock(args.budget_s)
    _launch_configs.use_table(None)  # the candidates patch the hand-rule dicts: no table over them
    import triton

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{gpu} torch {torch.__version__} triton {triton.__version__}", flush=True)
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(CANDIDATES)
    if unknown:
        print(f"unknown ops {sorted(unknown)}; known {list(CANDIDATES)}")
        return 2
    ceil = measure_ceilings(torch.device(args.device), DTYPE, args.warmup, args.rep)
    copy_gbps = ceil["copy_gbps"]
    print(f"copy {copy_gbps:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s "
          f"({clock.elapsed():.0f} s)\n{HEADER}", flush=True)
    rows: list[dict] = []
    for d in (float(x) for x in args.densities.split(",")):
        if clock.left() < 5:
            print(f"-- density {d}: skipped (budget spent)")
            continue
        run_density(d, ops, clock, args, copy_gbps, rows)
    summary(rows)
    fails = [r for r in rows if r["status"] != "ok"]
    print(f"\n{len(rows)} rows, {len(fails)} not ok, {clock.elapsed():.0f} s")
    return 0

