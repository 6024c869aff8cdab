"""PNG plots of a sweep: one metric against the x axis, one line per series (matplotlib, Agg).

Every plot carries a subtitle (device, data, budget, commit: what the numbers depend on), marks
the grid points without a number (OOM, FAILED, NOT RUN) on the x axis instead of leaving a line
to end silently, draws the mean and the spread (error bars: min to max) over a seeds axis, and
keeps its legend outside the data."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402

from experiments.figures import finish, legend_outside, mark_missing  # noqa: E402

_MISSING_MARK = {"OOM": "X", "FAILED": "x", "KILLED": "x", "NOT RUN": "1"}


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


def _categories_first(ax, order: list[str]) -> dict:
    """On a category axis, draw the categories in `order` before any series does (which fixes their
    places); -> the series' line style: no line between unordered categories."""
    if numeric(order) is not None:
        return {}
    ax.plot(order, [float("nan")] * len(order), alpha=0)
    return {"linestyle": "none"}


def _xs(labels: list[str], order: list[str]) -> list:
    """Plot positions: the numbers, or each category's index (`order` is plotted first, so a
    category axis places order[i] at i)."""
    if numeric(order) is None:
        return [order.index(x) if x in order else len(order) for x in labels]
    return [float(x) for x in labels]


ONE_SERIES = "measured"  # the label of a sweep without series axes (in a legend beside an oracle's lines)


def series_groups(df: pl.DataFrame, series: list[str]) -> dict[str, pl.DataFrame]:
    """Rows per series label ('attention=jagged', or ONE_SERIES without series axes), x in grid order."""
    if not series:
        return {ONE_SERIES: df}
    keys = df.select(series).unique(maintain_order=True).rows()
    return {"/".join(key): df.filter(pl.all_horizontal([pl.col(s) == v for s, v in zip(series, key)])) for key in keys}


def _finish(fig, title: str, subtitle: str, path: Path) -> Path:
    for ax in fig.axes:
        handles, labels = ax.get_legend_handles_labels()
        if handles and labels != [ONE_SERIES]:  # none for one series
            legend_outside(ax)
    return finish(fig, path, title, subtitle, dpi=120)


def _mark_missing(ax, xs: list, statuses: list[str], color, name: str) -> None:
    """Points without a number, marked by status, and one legend entry saying which."""
    for xv, status in zip(xs, statuses):
        mark_missing(ax, [(xv, status)], color, _MISSING_MARK.get(status, "x"))
    if xs:
        ax.plot([], [], marker="X", color=color, linestyle="none",
                label=f"{name}: no number ({', '.join(dict.fromkeys(statuses))})")


def _points(rows: pl.DataFrame, x: str, order: list[str], metric: str, seeds: str | None):
    """(x labels with a number, mean, low, high, n) and (x labels without one, their status)."""
    have, missing = [], []
    for label in order:
        at = rows.filter(pl.col(x) == label)
        ok = at.filter((pl.col("status") == "OK") & pl.col(metric).is_not_null())
        if ok.height and (not seeds or ok.height == at.height):
            vals = ok[metric].to_list()
            have.append((label, sum(vals) / len(vals), min(vals), max(vals), len(vals)))
        elif at.height:
            missing.append((label, next((s for s in at["status"].to_list() if s != "OK"), "NO METRIC")))
        else:
            missing.append((label, "NOT RUN"))
    return have, missing


def zoomed(ax, ylabel: str, baseline: float) -> None:
    """The y label, saying so where the axis starts above the metric's natural baseline (0; AUC 0.5):
    there a gap looks larger than it is, to be read against the seeds' spread."""
    lo = ax.get_ylim()[0]
    ax.set_ylabel(ylabel if lo <= baseline else f"{ylabel}\nzoomed: the axis starts at {lo:.4g}, not {baseline:g}")


def line_plot(df: pl.DataFrame, x: str, order: list[str], series: list[str], metric: str, ylabel: str,
              title: str, path: Path, oracle: dict | None = None, subtitle: str = "",
              seeds: str | None = None, baseline: float = 0.0) -> Path | None:
    """`metric` vs `x` per series (the `seeds` axis, if any, averaged: error bars from min to max) and
    `oracle`'s lines; without seeds the title says there is no spread. With the seeds axis as x, a
    line across seeds means nothing: :func:`seed_spread_plot`."""
    if metric not in df.columns or df[metric].is_null().all():
        return None
    series = [s for s in series if s != seeds]
    if seeds and x == seeds:
        return seed_spread_plot(df, seeds, series, metric, ylabel, title, path, subtitle, baseline)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    style = _categories_first(ax, order)
    for name, rows in series_groups(df, series).items():
        have, missing = _points(rows, x, order, metric, seeds)
        xs = _xs([h[0] for h in have], order)
        means = [h[1] for h in have]
        if seeds and have:
            n = max(h[4] for h in have)
            err = [[h[1] - h[2] for h in have], [h[3] - h[1] for h in have]]
            line = ax.errorbar(xs, means, yerr=err, marker="o", capsize=3, **style,
                               label=f"{name} (mean of {n} seeds; bars: min to max)")[0]
        else:
            (line,) = ax.plot(xs, means, marker="o", label=name, **style)
        _mark_missing(ax, _xs([m[0] for m in missing], order), [m[1] for m in missing], line.get_color(), name)
    if oracle:
        oracle_lines(ax, oracle)
    _style_x(ax, x, order, tuple(oracle_ks(oracle)) if oracle else ())
    zoomed(ax, ylabel, baseline)
    return _finish(fig, title if seeds else f"{title} (one run per point: no seed spread)", subtitle, path)


def seed_spread_plot(df: pl.DataFrame, seeds: str, series: list[str], metric: str, ylabel: str, title: str,
                     path: Path, subtitle: str = "", baseline: float = 0.0) -> Path:
    """One column per series: every seed's value as a dot, the mean as a bar from min to max;
    a series with a seed that has no number says so under its column."""
    fig, ax = plt.subplots(figsize=(8, 4.6))
    groups, counts = series_groups(df, series), []
    for i, (name, rows) in enumerate(groups.items()):
        vals = rows.filter((pl.col("status") == "OK") & pl.col(metric).is_not_null())[metric].to_list()
        color, first = f"C{i}", not any(counts)  # the first column with values labels the legend
        counts.append(len(vals))
        if vals:  # one legend for all columns (their names and counts are the ticks)
            spread = [len(vals) - 1 and (j / (len(vals) - 1) - 0.5) * 0.3 for j in range(len(vals))]
            ax.plot([i + d for d in spread], vals, "o", color=color, alpha=0.5, markersize=5,
                    label=f"one dot per {seeds} (how many: beside the name)" if first else None)
            mean = sum(vals) / len(vals)
            ax.errorbar([i], [mean], yerr=[[mean - min(vals)], [max(vals) - mean]], marker="_", markersize=22,
                        capsize=6, color=color, linestyle="none", label="mean, bar min to max" if first else None)
        bad = [s for s in rows["status"].to_list() if s != "OK"]
        if bad or not vals:
            _mark_missing(ax, [i], [bad[0] if bad else "NO METRIC"], color, name)
    tilt = len(groups) > 4 or sum(map(len, groups)) > 48  # long names would overlap
    ax.set_xticks(range(len(groups)), [f"{name} ({n})" for name, n in zip(groups, counts)],
                  rotation=30 if tilt else 0, ha="right" if tilt else "center", rotation_mode="anchor")
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_xlabel("/".join(series) or "runs")
    zoomed(ax, ylabel, baseline)
    ax.grid(True, axis="y", alpha=0.3)
    return _finish(fig, f"{title} over {seeds}", subtitle, path)


def ratio_plot(ratios: dict[str, dict[str, list]], x: str, order: list[str], title: str, path: Path,
               baseline: str = "jagged", subtitle: str = "") -> Path | None:
    """ratios["<baseline> / <other>"] = {"x": [...], "throughput": [...], "memory": [...], "note": [...]}:
    two panels, each saying which way its ratio goes; a point without a ratio is marked."""
    if not any(r["x"] for r in ratios.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    panels = (("throughput", f"speed-up: {baseline} examples/s / other's (x)\nabove 1: {baseline} faster"),
              ("memory", f"memory saving: other's peak / {baseline}'s (x)\nabove 1: {baseline} leaner"))
    for ax, (key, ylabel) in zip(axes, panels):
        style = _categories_first(ax, order)
        for name, r in ratios.items():
            other = name.split(" / ", 1)[-1]
            pts = [(xv, yv) for xv, yv in zip(r["x"], r[key]) if yv is not None]
            (line,) = ax.plot(_xs([p[0] for p in pts], order), [p[1] for p in pts], marker="o", label=f"vs {other}",
                              **style)
            gaps = [(xv, note or "NOT RUN") for xv, yv, note in zip(r["x"], r[key], r["note"]) if yv is None]
            gaps += [(xv, "NOT RUN") for xv in order if xv not in r["x"]]
            _mark_missing(ax, _xs([g[0] for g in gaps], order), [g[1] for g in gaps], line.get_color(), f"vs {other}")
        ax.axhline(1.0, color="grey", lw=0.8)
        _style_x(ax, x, order)
        ax.set_ylabel(ylabel)
    return _finish(fig, title, subtitle, path)


def oracle_ks(oracle: dict) -> list[int]:
    """The k > 0 of the oracle's auc_recent_<k> figures."""
    return sorted(k for k in (int(key.rsplit("_", 1)[1]) for key in oracle if key.startswith("auc_recent_")) if k > 0)


def oracle_lines(ax, oracle: dict) -> None:
    """The planted model's AUC, and its AUC from the last k items."""
    pos = oracle_ks(oracle)
    if pos:
        ax.plot(pos, [oracle[f"auc_recent_{k}"] for k in pos], ls="--", marker="s", color="black",
                label="oracle from the last k items (meta.json)")
    if "auc" in oracle:
        ax.axhline(oracle["auc"], color="black", lw=1, label=f"oracle, full history ({oracle['auc']:.4f})")
    if "auc_recent_0" in oracle:
        ax.axhline(oracle["auc_recent_0"], color="grey", lw=1, ls=":",
                   label=f"oracle, no history ({oracle['auc_recent_0']:.4f})")


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (speed, quality) points that no other point beats on both (higher is better on both), fastest first."""
    front, best = [], float("-inf")
    for speed, quality in sorted(points, key=lambda p: (-p[0], -p[1])):
        if quality > best:
            front.append((speed, quality))
            best = quality
    return front


def pareto_plot(df: pl.DataFrame, x: str, series: list[str], speed: str, path: Path, oracle: dict | None = None,
                subtitle: str = "") -> Path | None:
    """Test AUC against training examples/s, one point per finished run (marker by series, labelled
    with its x value), the Pareto front (no run both faster and more accurate) as a step line, and,
    with an oracle, the planted model's AUC from the last k items for each k on the x axis."""
    ok = df.filter((pl.col("status") == "OK") & pl.col(speed).is_not_null() & pl.col("test/auc").is_not_null()) \
        if {speed, "test/auc"} <= set(df.columns) else df.clear()
    if ok.height == 0:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.6))
    markers = "osD^v<>P*h"
    for i, (name, rows) in enumerate(series_groups(ok, [s for s in series if s != x]).items()):
        (dots,) = ax.plot(rows[speed].to_list(), rows["test/auc"].to_list(), marker=markers[i % len(markers)],
                          linestyle="none", label=name)
        for sp, auc, label in zip(rows[speed].to_list(), rows["test/auc"].to_list(), rows[x].to_list()):
            ax.annotate(f"{x}={label}", (sp, auc), xytext=(4, 4), textcoords="offset points", fontsize=6,
                        color=dots.get_color())
    front = pareto_front(list(zip(ok[speed].to_list(), ok["test/auc"].to_list())))
    ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="grey", lw=1, ls="--",
            label="Pareto front (no run faster and more accurate)")
    lengths = {str(v) for v in df[x].to_list()}
    for k in (oracle_ks(oracle) if oracle else []):
        if str(k) in lengths:
            ax.axhline(oracle[f"auc_recent_{k}"], color="black", lw=0.8, ls=":")
            ax.annotate(f"oracle, last {k} items", (1.0, oracle[f"auc_recent_{k}"]), xycoords=("axes fraction", "data"),
                        xytext=(-2, 2), textcoords="offset points", ha="right", fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("training examples/s (steady steps, log scale)")
    zoomed(ax, "test AUC", 0.5)
    return _finish(fig, "Accuracy against speed", subtitle, path)
