"""PNG plots of a sweep: one metric against the x axis, one line per series (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402


def numeric(labels: list[str]) -> list[float] | None:
    """The labels as numbers when they all are numbers, else None (a categorical axis)."""
    try:
        return [float(x) for x in labels]
    except (TypeError, ValueError):
        return None


def _style_x(ax, x_name: str, labels: list[str], extra_ticks: tuple[float, ...] = ()) -> None:
    values = numeric(labels)
    ax.set_xlabel(x_name)
    if values and min(values) > 0 and max(values) / min(values) >= 4:  # lengths: powers of two
        ticks = sorted(set(values) | set(extra_ticks))
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    elif not values:
        ax.tick_params(axis="x", labelrotation=30)
    ax.grid(True, alpha=0.3)


def _xs(labels: list[str], order: list[str]) -> list:
    values = numeric(order)
    if values is None:
        return labels  # matplotlib places categories in first-seen order: `order` is plotted first
    return [float(x) for x in labels]


def series_groups(df: pl.DataFrame, x: str, series: list[str]) -> dict[str, pl.DataFrame]:
    """Rows per series label ('backend=jagged', or 'all' without series axes), x in grid order."""
    if not series:
        return {"all": df}
    keys = df.select(series).unique(maintain_order=True).rows()
    out = {}
    for key in keys:
        mask = pl.all_horizontal([pl.col(s) == v for s, v in zip(series, key)])
        out["/".join(key)] = df.filter(mask)
    return out


def line_plot(df: pl.DataFrame, x: str, order: list[str], series: list[str], metric: str, ylabel: str,
              title: str, path: Path, extra=None, extra_ticks: tuple[float, ...] = (),
              logy: bool = False) -> Path | None:
    """`metric` vs `x` per series; OOM and failed points are named in the legend."""
    if metric not in df.columns or df[metric].is_null().all():
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if numeric(order) is None:  # fix the category order before any series draws
        ax.plot(order, [float("nan")] * len(order), alpha=0)
    for name, rows in series_groups(df, x, series).items():
        ok = rows.filter(pl.col(metric).is_not_null() & (pl.col("status") == "OK"))
        missing = rows.filter(pl.col("status") != "OK")
        label = name + "".join(f" ({s} at {x}={v})" for s, v in
                               zip(missing["status"].to_list(), missing[x].to_list()))
        ax.plot(_xs(ok[x].to_list(), order), ok[metric].to_list(), marker="o", label=label)
    if extra is not None:
        extra(ax)
    _style_x(ax, x, order, extra_ticks)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ratio_plot(ratios: dict[str, dict[str, list]], x: str, order: list[str], title: str, path: Path) -> Path | None:
    """ratios[name] = {"x": [...], "throughput": [...], "memory": [...]} -> two panels."""
    if not any(r["x"] for r in ratios.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("throughput", "train examples/s: ratio (x)"), ("memory", "peak memory: padded / jagged (x)"))
    for ax, (key, ylabel) in zip(axes, panels):
        if numeric(order) is None:
            ax.plot(order, [float("nan")] * len(order), alpha=0)
        for name, r in ratios.items():
            pts = [(xv, yv) for xv, yv in zip(r["x"], r[key]) if yv is not None]
            if pts:
                ax.plot(_xs([p[0] for p in pts], order), [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(2.0, color="grey", lw=0.8, ls=":")
        _style_x(ax, x, order)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def oracle_ks(oracle: dict) -> list[int]:
    """The k > 0 of the oracle's auc_recent_<k> figures."""
    return sorted(k for k in (int(key.rsplit("_", 1)[1]) for key in oracle if key.startswith("auc_recent_")) if k > 0)


def oracle_lines(oracle: dict):
    """An `extra` for line_plot: the planted model's AUC, and its AUC from the last k items."""
    def draw(ax) -> None:
        pos = oracle_ks(oracle)
        if pos:
            ax.plot(pos, [oracle[f"auc_recent_{k}"] for k in pos], ls="--", marker="s", color="black",
                    label="oracle from the last k items (meta.json)")
        if "auc" in oracle:
            ax.axhline(oracle["auc"], color="black", lw=1, label=f"oracle, full history ({oracle['auc']:.4f})")
        if "auc_recent_0" in oracle:
            ax.axhline(oracle["auc_recent_0"], color="grey", lw=1, ls=":",
                       label=f"oracle, no history ({oracle['auc_recent_0']:.4f})")
    return draw
