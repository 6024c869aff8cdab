"""`python -m data_gen report DIR`: length histogram, log-log item popularity, markdown summary.

The plots are drawn from the data (not from the config), with the configured law overlaid, so
that they show whether the generator did what meta.json says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .config import config_from_dict
from .lengths import build_length_model
from .metrics import auc
from .oracle import oracle_logits
from .schema import SPLITS, is_timeline, read_split, split_days, validate_dataset


def fit_zipf_slope(counts: np.ndarray, min_count: int = 20) -> dict[str, float]:
    """Least-squares slope of log(count) on log(rank) over the head of the popularity curve.

    counts: per-item counts [V] (any order). Ranks run from 1 to the last rank whose count is
    at least `min_count` (below that, sampling noise and empty items flatten the curve). The
    fit uses ~50 log-spaced ranks, so every decade weighs the same, not the millions of tail
    ranks. Returns {slope, intercept, max_rank}; slope ~ -alpha for Zipf data."""
    c = np.sort(np.asarray(counts))[::-1]
    max_rank = int(np.searchsorted(-c, -min_count, side="right"))  # c[:max_rank] >= min_count
    if max_rank < 10:
        return {"slope": float("nan"), "intercept": float("nan"), "max_rank": max_rank}
    ranks = np.unique(np.geomspace(1, max_rank, 50).astype(np.int64))
    x, y = np.log(ranks), np.log(c[ranks - 1])
    slope, intercept = np.polyfit(x, y, 1)
    return {"slope": float(slope), "intercept": float(intercept), "max_rank": max_rank}


def _lengths_and_counts(table: pa.Table, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """History lengths [N] and per-item counts [V] of a table's hist_item column."""
    lengths, counts = [], np.zeros(vocab, dtype=np.int64)
    for chunk in table.column("hist_item").chunks:
        off = chunk.offsets.to_numpy()
        lengths.append(np.diff(off))
        values = chunk.values.slice(off[0], off[-1] - off[0]).to_numpy(zero_copy_only=False)
        counts += np.bincount(values, minlength=vocab)
    return np.concatenate(lengths), counts


def _plot_lengths(lengths: np.ndarray, meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = meta["config"]
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.unique(np.linspace(0, cfg["max_len"] + 1, 129).astype(np.int64))
    ax.hist(lengths, bins=edges, color="tab:blue", alpha=0.8, label="train rows")
    # the configured law, as expected rows per bin
    cum = np.r_[0.0, np.cumsum(build_length_model(config_from_dict(cfg)).pmf)]
    expected = lengths.size * (cum[edges[1:]] - cum[edges[:-1]])
    ax.stairs(expected, edges, color="black", lw=1, label="expected from the config")
    for k in (64, 256, 1024, 4096):
        if k < cfg["max_len"]:
            ax.axvline(k, color="gray", ls=":", lw=1)
            ax.text(k, ax.get_ylim()[1] * 0.5, f" {k}", color="gray", fontsize=8)
    ax.axvline(lengths.mean(), color="tab:red", lw=1, label=f"mean {lengths.mean():.0f}")
    ax.set_yscale("log")
    ax.set_xlabel("history length (items)")
    ax.set_ylabel("rows")
    ax.set_title(f"History lengths: {cfg['length_dist']} on [{cfg['min_len']}, {cfg['max_len']}]")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_popularity(counts: np.ndarray, fit: dict[str, float], alpha: float,
                     path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = np.sort(counts)[::-1]
    c = c[c > 0]
    ranks = np.arange(1, c.size + 1)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.loglog(ranks, c, ".", ms=2, color="tab:blue", label="history items (train)")
    if np.isfinite(fit["slope"]):
        r = np.geomspace(1, fit["max_rank"], 20)
        ax.loglog(r, np.exp(fit["intercept"]) * r ** fit["slope"], color="tab:red",
                  label=f"fit: slope {fit['slope']:.3f}")
        ax.loglog(r, c[0] * r ** -alpha, color="gray", ls="--", label=f"Zipf alpha={alpha}")
    ax.set_xlabel("popularity rank")
    ax.set_ylabel("occurrences")
    ax.set_title("Item popularity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def _summary(meta: dict[str, Any], fit: dict[str, float], blind: dict[str, float] | None = None) -> str:
    cfg = meta["config"]
    ks = cfg.get("oracle_ks", [])
    head = ["split", "rows", "CTR", "mean len", "p50", "p90", "p99", "max", "zero-length",
            "oracle AUC", "oracle NE"] + [f"AUC last {k}" for k in ks]
    lines = [f"# Data set summary: preset `{meta['preset']}`, seed {meta['seed']}", "",
             f"generator {meta['generator_version']}, digest `{meta['digest']}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for split in SPLITS:
        s = meta["splits"][split]
        ls, o = s["length_stats"], s["oracle"]
        cells = [split, s["rows"], s["ctr"], ls["mean"], ls["p50"], ls["p90"], ls["p99"],
                 ls["max"], ls["frac_zero"], o["auc"], o["ne"]]
        cells += [o.get(f"auc_recent_{k}") for k in ks]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    lines += ["", f"Items: vocabulary {cfg['vocab_size']:,}, Zipf alpha {cfg['alpha']}, "
              f"{cfg['n_clusters']} clusters. Fitted log-log slope of train history item counts "
              f"over ranks 1..{fit['max_rank']}: {_fmt(fit['slope'])} (expected about "
              f"{-cfg['alpha']}).", "",
              f"Oracle: {meta.get('oracle_definition', '')}", "",
              *_term_lines(meta, blind),
              *_timeline_lines(meta),
              "![lengths](lengths.png)  ![popularity](popularity.png)", ""]
    return "\n".join(lines)


def _recency_blind(data_dir: Path, meta: dict[str, Any]) -> dict[str, float] | None:
    """The test split's oracle AUC with R's matches weighed alike, by window (None without R)."""
    if "recent" not in meta["splits"]["test"].get("oracle_terms", {}):
        return None
    ks = [k for k in meta["config"]["oracle_ks"] if k > 0]
    y = read_split(data_dir, "test", ["label"], validate=False).column(0).to_numpy()
    return {k: auc(y, logit) for k, logit in oracle_logits(data_dir, "test", ks, recency=False, validate=False).items()}


def _term_lines(meta: dict[str, Any], blind: dict[str, float] | None = None) -> list[str]:
    """The test split's oracle AUC of each planted term alone and of the logit without it, and
    with R blind to recency."""
    views = meta["splits"]["test"].get("oracle_terms", {})
    if not views:
        return []
    keys = [k.split("_", 1)[1] for k in next(iter(views.values())) if k.startswith("alone_")]
    head = ["term (test split)"] + [f"last {k}" if k != "full" else "full" for k in keys]
    lines = ["Oracle AUC of each planted term alone, of the planted logit without it" + (", and with R's matches "
             "weighed alike, what a read without positions reaches" if blind else "") + " (docs/data.md: which "
             "ranker component each term needs):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for term, v in views.items():
        for how in ("alone", "without"):
            lines.append("| " + " | ".join([f"{term} {how}"] + [_fmt(v[f"{how}_{k}"]) for k in keys]) + " |")
    if blind:  # what a read of the candidate's category without positions reaches of R
        lines.append("| " + " | ".join(["recent blind to recency"] + [_fmt(blind.get(k)) for k in keys]) + " |")
    return lines + [""]


def _timeline_lines(meta: dict[str, Any]) -> list[str]:
    if not is_timeline(meta):
        return []
    from .timeline import seen_users_line

    cfg = meta["config"]
    days = split_days(cfg["days"])
    return [f"Timeline: {cfg['users']:,} users over {cfg['days']} days (train days "
            f"{days['train'][0]}-{days['train'][1]}, val day {days['val'][0]}, test day "
            f"{days['test'][0]}); {seen_users_line(meta)}.", ""]


def write_report(data_dir: str | Path, out_dir: str | Path | None = None,
                 progress: bool = False) -> dict[str, Path]:
    """Validate the data set, then write lengths.png, popularity.png and summary.md into
    out_dir (default DATA_DIR/report). Returns the three paths."""
    data_dir = Path(data_dir)
    meta = validate_dataset(data_dir, progress=progress)
    out = Path(out_dir) if out_dir is not None else data_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = read_split(data_dir, "train", columns=["hist_item"], validate=False)
    lengths, counts = _lengths_and_counts(table, meta["config"]["vocab_size"])
    fit = fit_zipf_slope(counts)
    paths = {"lengths": out / "lengths.png", "popularity": out / "popularity.png",
             "summary": out / "summary.md"}
    _plot_lengths(lengths, meta, paths["lengths"])
    _plot_popularity(counts, fit, meta["config"]["alpha"], paths["popularity"])
    paths["summary"].write_text(_summary(meta, fit, _recency_blind(data_dir, meta)))
    return paths
