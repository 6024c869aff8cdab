"""The kernel benchmark targets, checked on measured rows: PASS / MISS (or N/A, INCOMPLETE) with numbers.

Never relaxed: "at least as fast" is speedup >= 1.0 exactly, and a shape where ours has no time
but the peer has counts as a miss."""

from __future__ import annotations

import math
from collections import defaultdict

from experiments.bench.base import OURS, ceilings_of

HEADLINE = "B1024-N1024-H2-D64-d0.25"
MODES = ("fwd", "fwd_bwd")


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def pairs(rows: list[dict], kind: str, peer: str, mode: str, suites=None, op=None) -> list[tuple[dict, dict | None]]:
    """(peer row, ours row or None) for every shape where the peer has a time."""
    at = lambda r, who: (r["kind"], r["provider"], r["mode"], r.get("op")) == (kind, who, mode, op)  # noqa: E731
    ours = {(r["suite"], r["shape_id"]): r for r in rows if at(r, OURS) and r["status"] == "ok"}
    return [(r, ours.get((r["suite"], r["shape_id"]))) for r in rows
            if at(r, peer) and r["status"] == "ok" and (suites is None or r["suite"] in suites)]


def geomean_table(rows: list[dict]) -> list[dict]:
    """Geometric-mean speedup of ours over each peer, per kind, suite and mode."""
    groups = defaultdict(list)
    for r in rows:
        if r["provider"] != OURS and r.get("ours_speedup"):
            groups[(r["kind"], r.get("op") or "", r["suite"], r["mode"], r["provider"])].append(r["ours_speedup"])
    return [dict(zip(("kind", "op", "suite", "mode", "peer"), key), geomean=geomean(xs), n=len(xs))
            for key, xs in sorted(groups.items())]


def _result(name: str, status: str, detail: str) -> dict:
    return {"target": name, "status": status, "detail": detail}


BY_KERNELS = " (by the kernels' own time, CUDA-graph replay)"


def _titled(name: str, key: str) -> str:
    """A target's name; its twin judged by the kernels' time ('gpu_ms') says so."""
    return name + (BY_KERNELS if key == "gpu_ms" else "")


def _timed_pairs(rows, kind: str, peer: str, mode: str, key: str, **kw) -> list[tuple[dict, dict | None]]:
    """`pairs` where the peer has a time by `key` ('ms' the call, 'gpu_ms' the kernels); ours
    without one counts as None (a miss)."""
    return [(r, o if o is not None and o.get(key) else None) for r, o in pairs(rows, kind, peer, mode, **kw) if r.get(key)]


def _every_shape(rows, mode: str, key: str = "ms") -> dict:
    name = _titled(f"attention {mode}: ours at least as fast as varlen_attn on every shape", key)
    ps = _timed_pairs(rows, "attention", "varlen_attn", mode, key)
    if not ps:
        return _result(name, "N/A", "no varlen_attn rows with a time")
    misses = [(r["suite"], r["shape_id"], None if o is None else r[key] / o[key]) for r, o in ps]
    misses = [m for m in misses if m[2] is None or m[2] < 1.0]
    ratios = [r[key] / o[key] for r, o in ps if o is not None]
    worst = f"min {min(ratios):.2f}x" if ratios else "ours never timed"
    if not misses:
        return _result(name, "PASS", f"{len(ps)} shapes, {worst}")
    listed = ", ".join(f"{s}/{i} {'ours failed' if x is None else f'{x:.2f}x'}" for s, i, x in misses[:8])
    more = f" (+{len(misses) - 8} more)" if len(misses) > 8 else ""
    return _result(name, "MISS", f"{len(misses)}/{len(ps)} shapes below 1.0x ({worst}): {listed}{more}")


GEOMEAN_VS_VARLEN = 1.5  # self-attention fwd+bwd over varlen_attn, geometric mean over paper + recsys


def _geomean_target(rows, key: str = "ms") -> dict:
    name = _titled(f"attention fwd_bwd: geomean speedup over varlen_attn >= {GEOMEAN_VS_VARLEN:g}x over paper + recsys",
                   key)
    ps = _timed_pairs(rows, "attention", "varlen_attn", "fwd_bwd", key, suites=("paper", "recsys"))
    suites = sorted({r["suite"] for r, _ in ps})
    xs = [r[key] / o[key] for r, o in ps if o is not None]
    if not ps:
        return _result(name, "N/A", "no varlen_attn rows in paper or recsys")
    failed = sum(1 for _, o in ps if o is None)
    g = geomean(xs)
    detail = f"{g:.3f}x over {len(xs)} shapes ({'+'.join(suites)})" if g else "ours never timed"
    if failed:
        detail += f"; ours has no time on {failed} shapes"
    if suites != ["paper", "recsys"]:
        return _result(name, "INCOMPLETE", detail + "; needs both suites measured")
    return _result(name, "PASS" if g and g >= GEOMEAN_VS_VARLEN and not failed else "MISS", detail)


def _strongest_peer(rows: list[dict]) -> list[tuple[dict | None, dict]]:
    """(ours or None, the fastest peer) per (kind, op, suite, shape, mode) where a peer has a time;
    None where ours has no time there."""
    groups = defaultdict(dict)
    for r in rows:
        if r["status"] == "ok" and r["provider"] != "*" and r.get("ms"):
            g = groups[(r["kind"], r.get("op"), r["suite"], r["shape_id"], r["mode"])]
            if r["provider"] == OURS or r["ms"] < g.get("peer", {"ms": math.inf})["ms"]:
                g["ours" if r["provider"] == OURS else "peer"] = r
    return [(g.get("ours"), g["peer"]) for g in groups.values() if "peer" in g]


def _memory_vs_strongest(rows) -> dict:
    name = "peak memory: ours <= the fastest peer's on every row (every kind, fwd and fwd_bwd)"
    ps = [(o, p) for o, p in _strongest_peer(rows) if p.get("peak_bytes")]
    if not ps:
        return _result(name, "N/A", "no memory measured (CPU run?)")
    # a row where ours has no time or no memory counts as over
    bad = [(o, p) for o, p in ps if o is None or not o.get("peak_bytes") or o["peak_bytes"] > p["peak_bytes"]]
    ratios = [o["peak_bytes"] / p["peak_bytes"] for o, p in ps if o is not None and o.get("peak_bytes")]
    worst = f"worst ours/peer = {max(ratios):.4f}" if ratios else "ours never measured"
    if not bad:
        return _result(name, "PASS", f"{len(ps)} rows, {worst}")
    excess = [o["peak_bytes"] - p["peak_bytes"] for o, p in bad if o is not None and o.get("peak_bytes")]
    if excess:
        worst += f", largest excess {max(excess) / 1024:,.1f} KiB"
    listed = ", ".join(f"{p['kind']}/{p.get('op') or ''}{p['shape_id']}/{p['mode']} vs {p['provider']}"
                       + ("" if o is not None else " (ours: no time)") for o, p in bad[:6])
    return _result(name, "MISS", f"{len(bad)}/{len(ps)} rows over ({worst}): {listed}")


def _headline(rows, peer: str, speed: float, mem: float, mem_text: str) -> list[dict]:
    out = []
    for mode in MODES:
        name = f"headline {HEADLINE} {mode} vs {peer}: >= {speed:g}x faster and {mem_text}"
        ps = [(r, o) for r, o in pairs(rows, "attention", peer, mode) if r["shape_id"] == HEADLINE]
        if not ps:
            out.append(_result(name, "N/A", f"{peer} has no time at {HEADLINE}"))
            continue
        r, o = ps[0]
        if o is None:
            out.append(_result(name, "MISS", "ours has no time at the headline shape"))
            continue
        sp = r["ms"] / o["ms"]
        mr = r["peak_bytes"] / o["peak_bytes"] if r.get("peak_bytes") and o.get("peak_bytes") else None
        ok = sp >= speed and mr is not None and mr >= mem
        mtxt = f"memory {mr:.2f}x less (ours {o['peak_bytes'] / 2**20:.0f} MiB, {peer} {r['peak_bytes'] / 2**20:.0f} MiB)" if mr else "memory n/a"
        out.append(_result(name, "PASS" if ok else "MISS", f"speed {sp:.2f}x ({o['ms']:.4g} vs {r['ms']:.4g} ms), {mtxt}"))
    return out


def _dense_attention(rows, peer: str, speed: float, key: str = "ms") -> dict:
    """The target-attention target, by call time (`key` 'ms') or, as a second row beside it, by
    the kernels' own time ('gpu_ms', --graph-ms: these fwd+bwd calls are host-bound, and the
    ranker's training step replays them as a CUDA graph)."""
    name = _titled(f"dense_attention fwd_bwd: >= {speed:g}x faster than {peer} at B1024 N1024 H2 D64 d0.25, Tq 1/16/64",
                   key)
    parts, ok_all, seen = [], True, 0
    for tq in (1, 16, 64):
        sid = f"{HEADLINE}-Tq{tq}"
        r, o = next(((r, o) for r, o in pairs(rows, "dense_attention", peer, "fwd_bwd") if r["shape_id"] == sid),
                    (None, None))
        if r is None or not r.get(key):  # the peer has no time (by `key`) at this Tq
            parts.append(f"Tq={tq} not measured")
            ok_all = False
            continue
        seen += 1
        sp = None if o is None or not o.get(key) else r[key] / o[key]
        ok_all &= sp is not None and sp >= speed
        parts.append(f"Tq={tq} {'ours failed' if sp is None else f'{sp:.2f}x'}")
    status = "N/A" if seen == 0 else ("PASS" if ok_all else ("MISS" if seen == 3 else "INCOMPLETE"))
    return _result(name, status, ", ".join(parts))


def _ops(rows, ceilings: dict | None) -> list[dict]:
    """Memory-bound ops against 70% of the copy bandwidth on the `large` shapes; bmm against torch."""
    from experiments.bench.providers_ops import BMM_OPS, MEMORY_BOUND_OPS

    out = []
    copy = (ceilings or {}).get("copy_gbps")
    for op in MEMORY_BOUND_OPS:
        name = f"ops {op}: >= 70% of the measured copy bandwidth on large inputs"
        large = [(r, ceilings_of(r, ceilings).get("copy_gbps") or copy) for r in rows if r["kind"] == "ops"
                 and r.get("op") == op and r["provider"] == OURS and "large" in r["shape"].get("tags", [])]
        if not large or not copy:
            out.append(_result(name, "N/A", "no large ops shapes measured on a GPU"))
            continue
        frac, sid, c = min(((r.get("gbps") or 0.0) / c, r["shape_id"], c) for r, c in large)
        out.append(_result(name, "PASS" if frac >= 0.7 else "MISS", f"worst {frac * 100:.0f}% at {sid} (copy {c:.0f} GB/s)"))
    for op in BMM_OPS:
        out += [_bmm(rows, op, key) for key in ("ms", "gpu_ms")]
    return out


def _bmm(rows, op: str, key: str) -> dict:
    name = _titled(f"ops {op}: >= padded torch.bmm at every density, faster below 0.5", key)
    ps = _timed_pairs(rows, "ops", "torch_padded", "fwd", key, op=op)
    if not ps:
        return _result(name, "N/A", "no torch_padded rows" + (" with kernel times" if key == "gpu_ms" else ""))
    bad, parts = [], []
    for r, o in ps:
        sp = None if o is None else r[key] / o[key]
        need_strict = r["shape"]["density"] < 0.5
        if sp is None or sp < 1.0 or (need_strict and sp <= 1.0):
            bad.append(f"{r['suite']}/{r['shape_id']}")
        parts.append(f"d{r['shape']['density']:g}:{'fail' if sp is None else f'{sp:.2f}x'}")
    below = f"; short at {', '.join(bad)}" if bad else ""
    return _result(name, "MISS" if bad else "PASS", ", ".join(parts[:12]) + below)


def evaluate(rows: list[dict], ceilings: dict | None = None) -> list[dict]:
    results = [_every_shape(rows, mode, key) for mode in ("fwd_bwd", "fwd") for key in ("ms", "gpu_ms")]
    results += [_geomean_target(rows, key) for key in ("ms", "gpu_ms")] + [_memory_vs_strongest(rows)]
    results += _headline(rows, "dense_torch", 9.0, 22.0, "22x less memory")
    results += _headline(rows, "sdpa_padded_mask", 3.0, 1.0 / 0.47, "53% less memory")
    results += [_dense_attention(rows, peer, speed, key) for key in ("ms", "gpu_ms")
                for peer, speed in (("sdpa_padded_mask", 3.0), ("varlen_attn", 1.5))]
    results += _ops(rows, ceilings)
    return results
