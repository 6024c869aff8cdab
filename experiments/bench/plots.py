"""The paper's figures from our rows: time, speedup and memory saving against each peer, vs N and
density (self-attention) and Tq (target attention); ops bandwidth. Each carries the stamp."""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402

from experiments.bench.base import OURS, ceilings_of  # noqa: E402
from experiments.figures import finish, legend_outside, mark_missing  # noqa: E402
from experiments.bench.stamp import stamp_line  # noqa: E402

MODES = (("fwd", "forward"), ("fwd_bwd", "forward + backward"))


class _Plain(LogFormatter):
    """Log-axis labels as plain numbers (0.06, 0.4, 3, 20), on the ticks matplotlib would label."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:g}"


def _pick(values: list, preferred):
    """`preferred` when present, else the most common value."""
    return preferred if preferred in values else Counter(values).most_common(1)[0][0]


def _series(rows: list[dict], xkey: str, metric: str, mode: str, ours: bool = False) -> dict[str, list[tuple[float, float]]]:
    """Provider -> sorted (x, metric) points: the peers, and ours first when `ours`."""
    out = defaultdict(list)
    for r in rows:
        if (ours or r["provider"] != OURS) and r["provider"] != "*" and r["mode"] == mode and r.get(metric):
            out[r["provider"]].append((r["shape"][xkey], r[metric]))
    return {p: sorted(out[p]) for p in sorted(out, key=lambda p: (p != OURS, p))}


def _figure(rows: list[dict], xkey: str, xlabel: str, title: str, stamp: dict, path: str, logx: bool) -> str:
    panels = (("ms", "time per call (ms, median; lower is better)", "time"),
              ("ours_speedup", "speedup of ours (peer time / ours)", "speed"),
              ("ours_mem_ratio", "memory saving (peer peak / ours)", "peak memory"))
    fig, axes = plt.subplots(3, 2, figsize=(12, 12.5), squeeze=False)
    for col, (mode, mode_title) in enumerate(MODES):
        for row, (metric, ylabel, what) in enumerate(panels):
            ax = axes[row][col]
            absolute = metric == "ms"
            series = _series(rows, xkey, metric, mode, ours=absolute)
            for peer, pts in series.items():
                style = dict(color="black", lw=2.2) if peer == OURS else {}
                (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                  label=f"{peer} (ours)" if peer == OURS else peer, **style)
                mark_missing(ax, [(r["shape"][xkey], f"{peer}: {'OOM' if r['status'] == 'OOM' else 'skipped'}")
                                  for r in rows if r["provider"] == peer and r["mode"] == mode and r["status"] != "ok"],
                             line.get_color())
            if series:
                if not absolute:
                    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(_Plain())
                ax.yaxis.set_minor_formatter(_Plain(minor_thresholds=(2, 0.5)))
                legend_outside(ax)
            else:
                ax.text(0.5, 0.5, "no data (not measured here)", ha="center", va="center", transform=ax.transAxes)
            if logx and series:
                ax.set_xscale("log", base=2)
            ax.set_title(f"{mode_title}: {what}", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    return finish(fig, path, title, stamp_line(stamp))


def _grid_rows(rows: list[dict]) -> list[dict]:
    grid = [r for r in rows if r["kind"] == "attention" and "grid" in r["shape"].get("tags", [])]
    if not grid:
        return []
    suite = _pick([r["suite"] for r in grid], "paper")
    return [r for r in grid if r["suite"] == suite]


def _bandwidth_figure(rows: list[dict], stamp: dict, path: str, copy: float | None) -> str:
    """Left: ours as a fraction of the device copy bandwidth, every op at every large shape (the
    70% target line; no shape left out, so a miss is visible). Right: absolute times, ours and
    each peer, per op and shape (ms, log scale)."""
    ops = [r for r in rows if r["kind"] == "ops" and r["status"] == "ok" and r.get("gbps")]
    fig, (ax, ax_ms) = plt.subplots(1, 2, figsize=(15, 5.2))
    if ops:
        suite = _pick([r["suite"] for r in ops], "paper")
        ops = [r for r in ops if r["suite"] == suite]
        large = [r for r in ops if "large" in r["shape"].get("tags", [])] or ops
        names = sorted({r["op"] for r in large})
        shapes = sorted({r["shape_id"] for r in large}, key=lambda sid: next(r["tokens"] for r in large
                                                                            if r["shape_id"] == sid))
        width = 0.8 / max(1, len(shapes))
        for i, sid in enumerate(shapes):
            mine = [next((r for r in large if r["op"] == n and r["provider"] == OURS and r["shape_id"] == sid), None)
                    for n in names]
            xs = [k + i * width for k, r in enumerate(mine) if r is not None]
            # each bar against the copy bandwidth of its own run (rows merged from several files)
            ys = [r["gbps"] / (ceilings_of(r, {}).get("copy_gbps") or copy) if copy else r["gbps"]
                  for r in mine if r is not None]
            ax.bar(xs, ys, width, label=sid)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names, rotation=15, fontsize=8)
        if copy:
            ax.axhline(0.7, color="black", ls=":", lw=1, label="target: 70% of copy")
            ax.axhline(1.0, color="grey", ls="--", lw=0.8, label=f"device copy ({copy:.0f} GB/s, newest run)")
            ax.set_ylabel("ours: achieved / copy bandwidth (real bytes read + written)")
        else:
            ax.set_ylabel("ours: GB/s (real bytes read + written)")
        legend_outside(ax)
        ax.set_title(f"ours at every large shape (suite {suite})", fontsize=10)
        provs = sorted({r["provider"] for r in large}, key=lambda p: (p != OURS, p))
        labels = [(n, sid) for n in names for sid in shapes]
        width = 0.8 / max(1, len(provs))
        for i, p in enumerate(provs):
            ms = [next((r["ms"] for r in large if (r["op"], r["shape_id"]) == lab and r["provider"] == p), None)
                  for lab in labels]
            ax_ms.bar([k + i * width for k, v in enumerate(ms) if v], [v for v in ms if v], width, label=p)
        ax_ms.set_xticks([k + 0.4 - width / 2 for k in range(len(labels))],
                         [f"{n}\n{sid}" for n, sid in labels], rotation=90, fontsize=6)
        ax_ms.set_yscale("log")
        ax_ms.set_ylabel("time per call (ms, median)")
        legend_outside(ax_ms)
        ax_ms.set_title("absolute times, ours and peers", fontsize=10)
    else:
        ax.text(0.5, 0.5, "no ops measured", ha="center", va="center", transform=ax.transAxes)
    return finish(fig, path, "Jagged ops: achieved bandwidth", stamp_line(stamp))


def write_plots(rows: list[dict], stamp: dict, folder: str, copy_gbps: float | None = None) -> list[str]:
    paths, at = [], lambda name: os.path.join(folder, name)  # noqa: E731
    grid = _grid_rows(rows)
    if grid:
        d_ref, n_ref = _pick([r["shape"]["density"] for r in grid], 0.25), _pick([r["shape"]["N"] for r in grid], 1024)
        vs_n, vs_d = [r for r in grid if r["shape"]["density"] == d_ref], [r for r in grid if r["shape"]["N"] == n_ref]
        s, t = vs_n[0]["shape"], vs_d[0]["shape"]
        paths += [_figure(vs_n, "N", "N (max_seq_len)", f"Jagged flash attention vs peers, by N (H={s['H']}, "
                          f"D={s['D']}, density {d_ref:g}, B*N ~ const)", stamp, at("attention-vs-N.png"), logx=True),
                  _figure(vs_d, "density", "density (mean length / N)", f"Jagged flash attention vs peers, by "
                          f"density (B={t['B']}, N={n_ref}, H={t['H']}, D={t['D']})", stamp,
                          at("attention-vs-density.png"), logx=False)]
    dense = [r for r in rows if r["kind"] == "dense_attention"]
    if dense:
        groups = [(r["suite"], *(r["shape"][k] for k in ("B", "N", "H", "D", "density"))) for r in dense]
        key = _pick(groups, ("paper", 1024, 1024, 2, 64, 0.25))
        paths.append(_figure([r for r, g in zip(dense, groups) if g == key], "Tq", "Tq (dense queries per sequence)",
                             f"jagged_dense_attention vs peers, by Tq (B={key[1]}, N={key[2]}, H={key[3]}, D={key[4]}, "
                             f"density {key[5]:g})", stamp, at("dense-attention-vs-Tq.png"), logx=True))
    if any(r["kind"] == "ops" for r in rows):
        paths.append(_bandwidth_figure(rows, stamp, at("ops-bandwidth.png"), copy_gbps))
    return paths
