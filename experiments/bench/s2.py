"""S2 attention against dense jagged attention and varlen_attn: forward + backward time.

    python -m experiments bench-s2 [--out experiments/results/kernels/<gpu>]       # GPU

Rows: N 4096-16384, H 8, D 64, fill 0.5, S2 block 64, 4 local blocks, each stride; the ideal
speedup counts the visible (query block, key block) pairs. Writes s2.md and s2.png."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from experiments import parser
from experiments.bench.base import varlen_fn
from experiments.bench.measure import bench_ms, free_memory, is_oom
from experiments.bench.stamp import make_stamp, stamp_line
from experiments.bench.suites import make_lengths
from experiments.runs import fmt

if TYPE_CHECKING:
    from kernels import S2Shards

ROWS = (4096, 8192, 16384)
STRIDES = (2, 4, 8, 16)


def visible_fraction(lengths: torch.Tensor, shards: S2Shards, num_heads: int, causal: bool = False) -> float:
    """Visible (query block, key block) pairs over all, summed over sequences and heads, counting
    blocks of shards.block rows (the work a block-skipping kernel does, relative to dense)."""
    seen = total = 0
    for h, o in enumerate(shards.offsets_for(num_heads)):
        for n in lengths.tolist():
            nb = -(-n // shards.block)
            if causal:
                pairs = [(i, j) for i in range(nb) for j in range(i + 1)]
                vis = sum(1 for i, j in pairs if i - j < shards.local_blocks or (j + o) % shards.stride == 0)
                seen, total = seen + vis, total + len(pairs)
            else:
                vis = sum(1 for j in range(nb) if j < shards.local_blocks or (j + o) % shards.stride == 0)
                seen, total = seen + nb * vis, total + nb * nb
    return seen / max(total, 1)


def _check(q, k, v, offsets, N, shards) -> float:
    """Max |ours - reference| over the first two sequences (fp32 reference on the inputs)."""
    from kernels import jagged_flash_attention
    from kernels.s2 import s2_attention_reference

    two = offsets[:3].clone()
    t = int(two[-1])
    with torch.no_grad():
        got = jagged_flash_attention(q[:t], k[:t], v[:t], two, N, shards=shards, backend="triton")
        want = s2_attention_reference(q[:t].float(), k[:t].float(), v[:t].float(), two, N, shards)
    return float((got.float() - want).abs().max()) if t else 0.0


def run(device: torch.device, rows, strides, dtype, warmup_ms: float, rep_ms: float, H: int = 8, D: int = 64,
        block: int = 64, local_blocks: int = 4, padded_tokens: int = 2**18) -> list[dict]:
    from kernels import S2Shards, jagged_flash_attention, offsets_from_lengths

    results = []
    varlen = varlen_fn() if device.type == "cuda" else None
    for N in rows:
        B = max(2, padded_tokens // N)
        lengths = make_lengths(B, N, 0.5, seed=N)
        offsets = offsets_from_lengths(lengths, device)
        T = int(offsets[-1])
        q, k, v = (torch.randn(T, H, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grads = [q, k, v]

        def time_it(fn) -> float | None:
            try:
                return bench_ms(lambda: fn().backward(dout), device, warmup_ms, rep_ms, grad_to_none=grads)
            except Exception as err:  # noqa: BLE001  (an OOM or a missing peer is a row, not a crash)
                if is_oom(err):
                    free_memory(device)
                    return None
                raise

        dout = torch.randn(T, H, D, device=device, dtype=dtype)
        dense = time_it(lambda: jagged_flash_attention(q, k, v, offsets, N, backend="triton"))
        cu = offsets.to(torch.int32)
        peer = time_it(lambda: varlen(q, k, v, cu, cu, N, N)) if varlen is not None else None
        for stride in strides:
            shards = S2Shards(block, local_blocks, stride)
            err = _check(q.detach(), k.detach(), v.detach(), offsets, N, shards)
            ms = time_it(lambda: jagged_flash_attention(q, k, v, offsets, N, shards=shards, backend="triton"))
            ideal = 1.0 / visible_fraction(lengths, shards, H)
            speed = dense / ms if dense and ms else None
            results.append(dict(N=N, B=B, T=T, stride=stride, dense_ms=dense, varlen_ms=peer, s2_ms=ms,
                                speedup_dense=speed, speedup_varlen=peer / ms if peer and ms else None,
                                ideal=ideal, efficiency=speed / ideal if speed else None, max_err=err))
        free_memory(device)
    return results


def write(results: list[dict], stamp: dict, out: Path, args) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# S2 attention vs dense jagged attention and varlen_attn (forward + backward)", "",
             f"- {stamp_line(stamp)}",
             f"- command: `python -m experiments bench-s2 {' '.join(sys.argv[1:])}`",
             f"- H=8, D=64, {args.dtype}, fill 0.5, B x N = 2**18 padded tokens; S2 block 64, local_blocks 4; "
             "median ms of forward + backward (gradients reset); ideal = all / visible (query block, key block) "
             "pairs; efficiency = speedup over dense / ideal (target >= 0.7)", "",
             "| N | B | stride | dense ms | varlen ms | S2 ms | vs dense | vs varlen | ideal | efficiency | max err |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['N']} | {r['B']} | {r['stride']} | {fmt(r['dense_ms'], '.3f')} | {fmt(r['varlen_ms'], '.3f')} | "
                     f"{fmt(r['s2_ms'], '.3f')} | {fmt(r['speedup_dense'], '.2f', 'x')} | {fmt(r['speedup_varlen'], '.2f', 'x')} | "
                     f"{r['ideal']:.2f}x | {fmt(r['efficiency'], '.2f')} | {r['max_err']:.1e} |")
    md = out / "s2.md"
    md.write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.figures import finish

    fig, ax = plt.subplots(figsize=(6, 4))
    for N in sorted({r["N"] for r in results}):
        rs = [r for r in results if r["N"] == N]
        ax.plot([r["stride"] for r in rs], [r["speedup_dense"] or math.nan for r in rs], "o-", label=f"N={N}")
        ax.plot([r["stride"] for r in rs], [r["ideal"] for r in rs], ":", color=ax.lines[-1].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("stride")
    ax.set_ylabel("speedup over dense jagged attention (dotted: ideal)")
    ax.legend(fontsize=8)
    finish(fig, out / "s2.png", "S2 attention fwd+bwd", stamp_line(stamp), dpi=120)
    return md


def main(argv: list[str] | None = None) -> int:
    p = parser("bench-s2", __doc__)
    p.add_argument("--out", default="runs/kernels/<gpu>", help="folder (<gpu>: the GPU's slug)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--warmup-ms", type=float, default=50.0)
    p.add_argument("--rep-ms", type=float, default=200.0)
    p.add_argument("--commit", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("error: bench-s2 times the Triton kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results = run(device, ROWS, STRIDES, getattr(torch, args.dtype), args.warmup_ms, args.rep_ms)
    stamp = make_stamp(device, args.commit)
    md = write(results, stamp, Path(args.out.replace("<gpu>", stamp["gpu_slug"])), args)
    print(md.read_text())
    return 0
