"""The floor of an attention row: the least time its bytes and its FLOPs allow on the device measured.

Per pass, ``floor = max(bytes / copy bandwidth, FLOPs / matmul rate)`` with both ceilings measured
in the same run; a fwd+bwd row's floor is the sum of its passes'. Bytes: every input read and
every output written once (``pass_bytes``); FLOPs: the tables' useful FLOPs over real tokens."""

from __future__ import annotations

from experiments.bench.base import OURS, ceilings_of
from experiments.bench.suites import BWD_FLOP_FACTOR

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
KINDS = ("dense_attention", "attention")


def pass_bytes(kind: str, shape: dict, tokens: int, elem: int) -> tuple[float, float]:
    """(forward bytes, backward bytes) any implementation must move: inputs read and outputs written
    once, `elem` bytes an element, lse in fp32. Target attention (q, out [B, Tq, H, D], k, v
    [T, H, D]): fwd e*(2Q + 2K) + 4S, bwd e*(4Q + 4K) + 4S with Q = B*Tq*H*D, K = T*H*D,
    S = B*Tq*H; self-attention: fwd e*4K + 4S, bwd e*8K + 4S with S = T*H."""
    H, D = shape["H"], shape["D"]
    K = tokens * H * D
    if kind == "dense_attention":
        Q, S = shape["B"] * shape["Tq"] * H * D, shape["B"] * shape["Tq"] * H
        return elem * (2 * Q + 2 * K) + 4 * S, elem * (4 * Q + 4 * K) + 4 * S
    S = tokens * H
    return elem * 4 * K + 4 * S, elem * 8 * K + 4 * S


def floor_ms(row: dict, ceilings: dict, elem: int) -> tuple[float, str] | None:
    """(floor in ms, 'bytes' or 'FLOPs': which bound sets the larger pass) for a timed attention
    row of any provider, or None (another kind, no FLOP count, no ceilings)."""
    copy, mm = ceilings.get("copy_gbps"), ceilings.get("matmul_tflops")
    if row["kind"] not in KINDS or not row.get("flops") or not copy or not mm:
        return None
    fwd_b, bwd_b = pass_bytes(row["kind"], row["shape"], row["tokens"], elem)
    fwd_f = row["flops"] / (1.0 if row["mode"] == "fwd" else 1.0 + BWD_FLOP_FACTOR)
    passes = [(fwd_b, fwd_f)] + ([(bwd_b, fwd_f * BWD_FLOP_FACTOR)] if row["mode"] == "fwd_bwd" else [])
    total, bound, worst = 0.0, "bytes", 0.0
    for nbytes, flops in passes:
        by_bytes, by_flops = nbytes / (copy * 1e9) * 1e3, flops / (mm * 1e12) * 1e3
        total += max(by_bytes, by_flops)
        if max(by_bytes, by_flops) > worst:
            worst, bound = max(by_bytes, by_flops), "bytes" if by_bytes >= by_flops else "FLOPs"
    return total, bound


def floor_table(rows: list[dict], ceilings: dict, dtype: str) -> list[str]:
    """Markdown: ours against the floor on every timed attention row (target attention first)."""
    elem = ELEMENT_BYTES.get(dtype)
    mine = [r for r in rows if r["kind"] in KINDS and r["provider"] == OURS and r["status"] == "ok"]
    if not mine or elem is None or not ceilings.get("copy_gbps"):
        return []
    lines = ["## Ours against the floor (attention)", "",
             f"Floor per pass = max(bytes at the measured copy bandwidth, FLOPs at the measured matmul rate); "
             f"bytes: every input read and every output written once ({dtype}); see `experiments/bench/floors.py`. "
             "'kernels': the row's kernels alone (--graph-ms), where the call is host-bound the measure of the "
             "kernels against their floor.", "",
             "| kind | suite | shape | mode | ours ms | floor ms | bound | ours / floor | kernels ms | kernels / floor |",
             "|---|---|---|---|---:|---:|---|---:|---:|---:|"]
    for r in sorted(mine, key=lambda r: (KINDS.index(r["kind"]), r["suite"], r["shape_id"], r["mode"])):
        f = floor_ms(r, ceilings_of(r, ceilings), elem)
        if f is None:
            continue
        mode = "fwd+bwd" if r["mode"] == "fwd_bwd" else r["mode"]
        k = r.get("gpu_ms")
        kernels = f"{k:.4g} | {k / f[0]:.2f}x" if k else "- | -"
        lines.append(f"| {r['kind']} | {r['suite']} | {r['shape_id']} | {mode} | {r['ms']:.4g} | {f[0]:.4g} | "
                     f"{f[1]} | {r['ms'] / f[0]:.2f}x | {kernels} |")
    return lines + [""]
