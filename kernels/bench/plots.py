"""The paper's figures redrawn from our rows: speedup and memory saving of ours against each peer
vs N and vs density (self-attention), vs Tq (target attention), and ops bandwidth. Every figure
carries the stamp (GPU, torch, triton, CUDA, commit, date) under its title.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kernels.bench.base import OURS  # noqa: E402
from kernels.bench.stamp import stamp_line  # noqa: E402

MODES = (("fwd", "forward"), ("fwd_bwd", "forward + backward"))


def _pick(values: list, preferred):
    """`preferred` when present, else the most common value."""
    return preferred if preferred in values else Counter(values).most_common(1)[0][0]


def _series(rows: list[dict], xkey: str, metric: str, mode: str) -> dict[str, list[tuple[float, float]]]:
    out = defaultdict(list)
    for r in rows:
        if r["provider"] != OURS and r["mode"] == mode and r.get(metric):
            out[r["provider"]].append((r["shape"][xkey], r[metric]))
    return {p: sorted(v) for p, v in sorted(out.items())}


def _figure(rows: list[dict], xkey: str, xlabel: str, title: str, stamp: dict, path: str, logx: bool) -> str:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), squeeze=False)
    for col, (mode, mode_title) in enumerate(MODES):
        for row, (metric, ylabel) in enumerate(
            (("ours_speedup", "speedup of ours (peer time / ours)"), ("ours_mem_ratio", "memory saving (peer peak / ours)"))
        ):
            ax = axes[row][col]
            series = _series(rows, xkey, metric, mode)
            for peer, pts in series.items():
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=peer)
            if series:
                ax.axhline(1.0, color="grey", lw=0.8, ls="--")
                ax.set_yscale("log")
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "no data (not measured here)", ha="center", va="center", transform=ax.transAxes)
            if logx and series:
                ax.set_xscale("log", base=2)
            ax.set_title(f"{mode_title}: {'speed' if row == 0 else 'peak memory'}", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=12)
    fig.text(0.5, 0.935, stamp_line(stamp), ha="center", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110, metadata={"Title": title, "Description": stamp_line(stamp)})
    plt.close(fig)
    return path


def _grid_rows(rows: list[dict]) -> list[dict]:
    grid = [r for r in rows if r["kind"] == "attention" and "grid" in r["shape"].get("tags", [])]
    if not grid:
        return []
    suite = _pick([r["suite"] for r in grid], "paper")
    return [r for r in grid if r["suite"] == suite]


def _bandwidth_figure(rows: list[dict], stamp: dict, path: str, copy: float | None) -> str:
    ops = [r for r in rows if r["kind"] == "ops" and r["status"] == "ok" and r.get("gbps")]
    fig, ax = plt.subplots(figsize=(12, 5))
    if ops:
        suite = _pick([r["suite"] for r in ops], "paper")
        ops = [r for r in ops if r["suite"] == suite]
        biggest = max(ops, key=lambda r: r["tokens"] or 0)["shape_id"]
        sel = [r for r in ops if r["shape_id"] == biggest]
        names = sorted({r["op"] for r in sel})
        provs = sorted({r["provider"] for r in sel}, key=lambda p: (p != OURS, p))
        width = 0.8 / max(1, len(provs))
        for i, p in enumerate(provs):
            vals = [next((r["gbps"] for r in sel if r["op"] == n and r["provider"] == p), 0.0) for n in names]
            ax.bar([k + i * width for k in range(len(names))], vals, width, label=p)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names, rotation=15, fontsize=8)
        if copy:
            ax.axhline(copy, color="black", ls="--", lw=1, label=f"device copy {copy:.0f} GB/s")
            ax.axhline(0.7 * copy, color="grey", ls=":", lw=1, label="70% of copy")
        ax.set_ylabel("GB/s (real bytes read + written)")
        ax.legend(fontsize=8)
        ax.set_title(f"Memory-bound jagged ops at {biggest} (suite {suite})", fontsize=10)
    else:
        ax.text(0.5, 0.5, "no ops measured", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("Jagged ops: achieved bandwidth", fontsize=12)
    fig.text(0.5, 0.9, stamp_line(stamp), ha="center", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    fig.savefig(path, dpi=110, metadata={"Title": "Jagged ops bandwidth", "Description": stamp_line(stamp)})
    plt.close(fig)
    return path


def write_plots(rows: list[dict], stamp: dict, folder: str, slug: str, copy_gbps: float | None = None) -> list[str]:
    paths = []
    grid = _grid_rows(rows)
    if grid:
        d_ref = _pick([r["shape"]["density"] for r in grid], 0.25)
        vs_n = [r for r in grid if r["shape"]["density"] == d_ref]
        s = vs_n[0]["shape"]
        paths.append(_figure(
            vs_n, "N", "N (max_seq_len)",
            f"Jagged flash attention vs peers, by N (H={s['H']}, D={s['D']}, density {d_ref:g}, B*N ~ const)",
            stamp, os.path.join(folder, f"attention-vs-N-{slug}.png"), logx=True,
        ))
        n_ref = _pick([r["shape"]["N"] for r in grid], 1024)
        vs_d = [r for r in grid if r["shape"]["N"] == n_ref]
        s = vs_d[0]["shape"]
        paths.append(_figure(
            vs_d, "density", "density (mean length / N)",
            f"Jagged flash attention vs peers, by density (B={s['B']}, N={n_ref}, H={s['H']}, D={s['D']})",
            stamp, os.path.join(folder, f"attention-vs-density-{slug}.png"), logx=False,
        ))
    dense = [r for r in rows if r["kind"] == "dense_attention"]
    if dense:
        groups = [(r["suite"], r["shape"]["B"], r["shape"]["N"], r["shape"]["H"], r["shape"]["D"], r["shape"]["density"]) for r in dense]
        key = _pick(groups, ("paper", 1024, 1024, 2, 64, 0.25))
        sel = [r for r, g in zip(dense, groups) if g == key]
        paths.append(_figure(
            sel, "Tq", "Tq (dense queries per sequence)",
            f"jagged_dense_attention vs peers, by Tq (B={key[1]}, N={key[2]}, H={key[3]}, D={key[4]}, density {key[5]:g})",
            stamp, os.path.join(folder, f"dense-attention-vs-Tq-{slug}.png"), logx=True,
        ))
    if any(r["kind"] == "ops" for r in rows):
        paths.append(_bandwidth_figure(rows, stamp, os.path.join(folder, f"ops-bandwidth-{slug}.png"), copy_gbps))
    return paths
