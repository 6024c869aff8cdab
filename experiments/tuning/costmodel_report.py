"""The cost model's report: ``costmodel.md`` and four PNG plots, from a sweep's Parquet.

Plots, each stamped with the sweep's GPU, versions and commits: predicted vs measured time on
held-out shapes, the slowdown of each method's pick, the forests' feature importances, and
energy vs time of every config of each family's first shape."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.tuning.costmodel import (ENERGY_SLACK, SWITCH_PREDICTED, by_family, evaluate,  # noqa: E402
                                     feature_names, fit)
from experiments.figures import finish  # noqa: E402
from experiments.runs import fmt  # noqa: E402
from experiments.tuning.families import RETUNED_ON_SMALL  # noqa: E402


def _stamp(rows: list[dict]) -> str:
    """GPU and versions of the first row; every commit the rows were timed at (a resumed sweep's
    rows may span several, and a sweep of some families re-times only theirs: each commit's share
    and families are named)."""
    r = rows[0]
    counts = Counter(str(x["commit"]) for x in rows)
    fams = {c: sorted({x["family"] for x in rows if str(x["commit"]) == c}) for c in counts}
    commits = (", ".join(f"{c} ({n} rows: {', '.join(fams[c])})" for c, n in counts.items())
               if len(counts) > 1 else r["commit"])
    return f"{r['gpu']} · torch {r['torch']} · triton {r['triton']} · CUDA {r['cuda']} · commit {commits}"


def plot_pred(res: dict, path: Path, stamp: str) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 6))
    lo, hi = math.inf, 0.0
    for fam, ev in res.items():
        p = ev.get("predictions", [])
        if p:
            x, y = [q["ms"] for q in p], [q["pred_ms"] for q in p]
            ax.scatter(x, y, s=8, alpha=0.6, label=fam)
            lo, hi = min(lo, *x, *y), max(hi, *x, *y)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1, ls="--", label="y = x")
    ax.set(xscale="log", yscale="log", xlabel="measured time per call (ms)",
           ylabel="predicted time per call (ms), shape held out")
    ax.legend(fontsize=7)
    return str(finish(fig, path, "Cost model: predicted vs measured (leave-shapes-out)", stamp))


def plot_slowdown(res: dict, path: Path, stamp: str) -> str:
    fams = list(res)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(fams)), 4.5))
    for k, (m, color) in enumerate((("model", "C0"), ("table", "C3"), ("hand", "C1"), ("autotune", "C2"))):
        data = [[s[m] for s in res[f].get("shapes", []) if m in s and math.isfinite(s[m])] or [math.nan]
                for f in fams]
        pos = np.arange(len(fams)) + (k - 1.5) * 0.2
        bp = ax.boxplot(data, positions=pos, widths=0.18, patch_artist=True, showfliers=True)
        for b in bp["boxes"]:
            b.set_facecolor(color)
        ax.plot([], [], color=color, lw=6, label=m)
    ax.axhline(1.05, color="gray", ls=":", lw=1, label="5% over the best")
    ax.set_xticks(np.arange(len(fams)), fams, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time / best measured time (x), held-out shapes")
    ax.legend(fontsize=8)
    return str(finish(fig, path, "Slowdown of each method's pick against the best config", stamp))


def plot_importance(models: dict, path: Path, stamp: str) -> str:
    n = len(models)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 4.5), squeeze=False)
    for ax, (fam, m) in zip(axes[0], models.items()):
        names, imp = feature_names(fam), m.time.feature_importances_
        order = np.argsort(imp)[-8:]
        ax.barh([names[i] for i in order], imp[order])
        ax.set_title(fam, fontsize=9)
        ax.set_xlabel("importance (fraction of impurity decrease)", fontsize=7)
        ax.tick_params(labelsize=7)
    return str(finish(fig, path, "Runtime model: forest feature importances (top 8 per family)", stamp))


def plot_energy(rows: list[dict], path: Path, stamp: str) -> str:
    fams = by_family([r for r in rows if r["status"] == "ok"])
    fig, axes = plt.subplots(1, max(1, len(fams)), figsize=(3.2 * max(1, len(fams)), 3.8), squeeze=False)
    for ax, (fam, rs) in zip(axes[0], fams.items()):
        sid = rs[0]["shape_id"]
        pts = [r for r in rs if r["shape_id"] == sid and r["energy_j"] is not None and math.isfinite(r["energy_j"])]
        ax.set_title(f"{fam}\n{sid}", fontsize=7)
        ax.set_xlabel("time per call (ms)", fontsize=7)
        ax.set_ylabel("energy per call (mJ)", fontsize=7)
        if not pts:
            ax.text(0.5, 0.5, "no energy-counter readings", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.scatter([r["ms"] for r in pts], [1e3 * r["energy_j"] for r in pts], s=10, alpha=0.6)
        best = min(pts, key=lambda r: r["ms"])
        frugal = min((r for r in pts if r["ms"] <= ENERGY_SLACK * best["ms"]), key=lambda r: r["energy_j"])
        ax.scatter([best["ms"]], [1e3 * best["energy_j"]], color="C3", marker="*", s=80, label="fastest")
        ax.scatter([frugal["ms"]], [1e3 * frugal["energy_j"]], color="C2", marker="D", s=40,
                   label="least energy within 5%")
        ax.legend(fontsize=6)
        ax.tick_params(labelsize=7)
    return str(finish(fig, path, "Energy vs time per config (first shape of each family)", stamp))


def _energy_note(rows: list[dict]) -> str:
    counted = sum(r.get("energy_src") == "counter" for r in rows)
    if not counted:
        return ("Energy: no row has a reading of the board's energy counter (a sweep from before the energy pass, or "
                "no NVML), so the energy columns are empty; sampled power over a 40 ms timing is not used "
                "(docs/tuning.md says why).")
    windows = [r["energy_window_s"] for r in rows if r.get("energy_src") == "counter" and r.get("energy_window_s")]
    least = f"{min(windows):.2g} s or more" if windows else "a window"
    return (f"Energy: {counted} rows (up to 3 configs within 5% of each shape's fastest, and the hand rule's) have the "
            f"energy per call from the board's energy counter over {least} of back-to-back calls.")


def markdown(rows: list[dict], res: dict, plots: list[str], res_k: dict | None = None) -> str:
    """The report; `res` the evaluation the verdicts come from, `res_k` (optional) another one
    with other folds, whose model slowdowns are shown beside."""
    ok = sum(r["status"] == "ok" for r in rows)
    first = next(iter(res.values()), {})
    k = next(iter(res_k.values()))["folds"] if res_k else None
    lines = [f"# Launch-config cost model on {rows[0]['gpu']}", "", f"_{_stamp(rows)}_", "",
             f"Sweep: {len(rows)} rows ({ok} ok), {len({r['shape_id'] for r in rows})} shapes, grid "
             f"{rows[0].get('grid', '?')}. Model, per family, on log time (and log energy): a power law in the shape "
             "for the shape's best plus a RandomForestRegressor (200 trees) on each config's slowdown against it, "
             "which alone ranks the configs of a shape; a forest averages measured leaves, so it never ranks a "
             "config by an extrapolation "
             "(experiments/tuning/costmodel.py says more). Evaluation: GroupKFold over whole shapes, "
             + ("one fold per shape (leave one shape out: each shape judged by a model fitted on all the others, "
                "as the table's picks come from a model fitted on every swept shape)"
                if first.get("folds", 0) <= 0 else f"{first['folds']} folds")
             + (f"; column 'model, {k} folds': the model's slowdowns with {k} folds (2-3 of a family's shapes held "
                "out at once)" if res_k else "") + ".", "",
             _energy_note(rows), "",
             "Slowdown = time of the chosen config / best measured time on a held-out shape (median / worst). "
             "Target: model within 1.05 median and 1.15 worst, better than the hand rule on average. "
             "'table' is what the exported launch table gives a shape it has not swept: the model's pick, or the "
             f"hand rule's config where the model predicts it at most {SWITCH_PREDICTED:g}x the pick's time or "
             "where the pick would launch fewer programs than any row the model was fitted on (softmax). "
             + ("Counted: every held-out shape." if first.get("judge_on", "all") == "all" else
                "Counted (column 'judged'): for the families whose hand rules were retuned on the small grid's "
                f"shapes ({', '.join(RETUNED_ON_SMALL)}), only the held-out shapes outside it; every shape still "
                "trains the folds it is not held out of."), "",
             "| family | shapes | judged | R² log time | err median | err worst | R² log energy | model "
             + (f"| model, {k} folds " if res_k else "") + "| table | hand "
             "| autotune | autotune cost (s/shape) | energy saved within 5% | target |",
             "|---|---:|---:|---:|---:|---:|---:|---|" + ("---|" if res_k else "") + "---|---|---|---:|---:|---|"]
    for fam, ev in res.items():
        s = ev["summary"]
        mm = lambda m: f"{fmt(s[m]['median'], '.3f')} / {fmt(s[m]['worst'], '.3f')}"  # noqa: E731
        lines.append(f"| {fam} | {ev['n_shapes']} | {s['model']['n']} | {fmt(ev.get('r2_log_ms'), '.3f')} | "
                     f"{fmt(ev.get('median_err_pct'), '.1f', '%')} | "
                     f"{fmt(ev.get('worst_err_pct'), '.1f', '%')} | "
                     f"{fmt(ev.get('r2_log_energy'), '.3f')} | {mm('model')} | "
                     + (f"{fmt(res_k[fam]['summary']['model']['median'], '.3f')} / "
                        f"{fmt(res_k[fam]['summary']['model']['worst'], '.3f')} | " if res_k else "")
                     + f"{mm('table')} | {mm('hand')} | "
                     f"{mm('autotune')} | "
                     f"{fmt(s['autotune_cost_s_per_shape'], '.1f')} | {fmt(s['energy_saving_pct'], '.1f', '%')} | "
                     f"{s['verdict']} |")
    lines += ["", "Per held-out shape (slowdowns; energy of the fastest vs the least-energy config within 5%, mJ):", "",
              "| family | shape | best ms | best config | model | table | hand | autotune | E fastest | E frugal |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for fam, ev in res.items():
        for s in ev.get("shapes", []):
            e = lambda k: fmt(1e3 * s[k], ".2f") if k in s else "-"  # noqa: E731
            lines.append(f"| {fam} | {s['shape_id']} | {fmt(s.get('best_ms'), '.4f')} | "
                         f"`{s.get('best_config', '-')}` | {fmt(s.get('model'), '.3f')} | "
                         f"{fmt(s.get('table'), '.3f')} | "
                         f"{fmt(s.get('hand'), '.3f')} | {fmt(s.get('autotune'), '.3f')} | "
                         f"{e('fastest_energy_j')} | {e('frugal_energy_j')} |")
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def write_report(rows: list[dict], out: str, folds: int = 0, seed: int = 0, judge_on: str = "all") -> list[str]:
    """Evaluate, fit on all rows, write costmodel.md and its plots into `out` (<gpu>: the rows' GPU)."""
    folder = Path(out.replace("<gpu>", rows[0]["gpu_slug"]))
    folder.mkdir(parents=True, exist_ok=True)
    stamp = _stamp(rows)
    res = evaluate(rows, folds, seed, judge_on=judge_on)
    res_k = evaluate(rows, 5, seed, judge_on=judge_on) if folds != 5 else None
    models = fit(rows, seed)
    plots = [plot_pred(res, folder / "costmodel-pred.png", stamp),
             plot_slowdown(res, folder / "costmodel-slowdown.png", stamp),
             plot_importance(models, folder / "costmodel-importance.png", stamp)]
    if any(r.get("energy_src") == "counter" for r in rows):  # else _energy_note says why there is none
        plots.append(plot_energy(rows, folder / "costmodel-energy.png", stamp))
    md = folder / "costmodel.md"
    md.write_text(markdown(rows, res, plots, res_k))
    return [str(md), *plots]
