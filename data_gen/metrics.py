"""Exact AUC, normalized entropy and length statistics for meta.json (numpy only)."""

from __future__ import annotations

from typing import Any

import numpy as np


def auc(label: np.ndarray, score: np.ndarray) -> float | None:
    """ROC AUC by the Mann-Whitney rank sum, ties counted as half. None if one class is absent.

    label: {0, 1} [N]; score: float [N] (any monotone transform of p gives the same AUC)."""
    y = np.asarray(label).astype(bool)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    s = np.asarray(score, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # average 1-based rank of each tie group
    first = np.r_[True, sorted_s[1:] != sorted_s[:-1]]
    group = np.cumsum(first) - 1  # [N] tie group of each sorted position
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], s.size]
    avg_rank = (starts + ends + 1) / 2.0  # [G]
    rank_sum = avg_rank[group][y[order]].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def normalized_entropy(label: np.ndarray, p: np.ndarray) -> float | None:
    """Log loss of p divided by the entropy of the base rate (He et al., 2014). Lower is better;
    1.0 is no better than predicting the CTR. None if one class is absent."""
    y = np.asarray(label, dtype=np.float64)
    ctr = y.mean()
    if ctr <= 0 or ctr >= 1:
        return None
    q = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1 - 1e-12)
    logloss = -(y * np.log(q) + (1 - y) * np.log1p(-q)).mean()
    base = -(ctr * np.log(ctr) + (1 - ctr) * np.log1p(-ctr))
    return float(logloss / base)


def length_stats(lengths: np.ndarray) -> dict[str, Any]:
    """mean, p50/p90/p99 (inverted-CDF quantiles, i.e. actual lengths), min, max, frac_zero and
    the fraction of rows longer than 64/256/1024/4096."""
    n = np.asarray(lengths)
    if n.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "min": None,
                "frac_zero": None, "frac_over": {}}
    q = np.quantile(n, [0.5, 0.9, 0.99], method="inverted_cdf")
    return {
        "mean": float(n.mean()),
        "p50": int(q[0]), "p90": int(q[1]), "p99": int(q[2]),
        "max": int(n.max()), "min": int(n.min()),
        "frac_zero": float((n == 0).mean()),
        "frac_over": {str(k): float((n > k).mean()) for k in (64, 256, 1024, 4096)},
    }
