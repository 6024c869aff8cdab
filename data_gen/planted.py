"""Candidates and the planted label model, with its history-truncated oracle views.

Each example's candidate is one of four kinds: from the user's current interests
(`cand_current`), from the past interests (`cand_past`), a re-consumption of an item the user
saw at least `far_start` items ago (`cand_reconsume`, falling back to a past interest when the
history is shorter), or a random popular item (the rest).

The label is Bernoulli(p_true), p_true = sigmoid(logit) with

    logit = bias + w_recent * R + w_freq * F + w_item * X + quality[cand] + dense . dense_w

    R  recency-weighted cluster match: sum_r 0.5^(r / recent_halflife) * strength(action_r)
       * [cluster_r == cluster(cand)] / sum_r 0.5^(r / recent_halflife)    (r = items after)
    F  cluster frequency over the whole history: min(#[cluster_r == cluster(cand)], freq_cap)
       / freq_cap
    X  long-range re-consumption: 1 if the candidate item itself occurs at r >= far_start

R is dominated by the last few dozen items; F and X need the old part of the history, which
the user's interest drift (history.py) fills with the past interests. So a model that sees
more of the history can do measurably better.

Oracle views: the same logit recomputed from only the last k items of each history (k in
`oracle_ks`; k = 0 means no history at all), next to the full-history logit that drew the
label. Their AUCs say how much of the planted signal is visible through a window of k items.
They are plug-in scores of this one function, not Bayes-optimal predictors for the window.
"""

from __future__ import annotations

import numpy as np

from .config import DataConfig
from .history import History, Users, action_strength
from .world import World

CURRENT, PAST, RECONSUME, RANDOM = 0, 1, 2, 3


def sample_candidates(world: World, cfg: DataConfig, rng: np.random.Generator, users: Users,
                      hist: History) -> tuple[np.ndarray, np.ndarray]:
    """One candidate per row: (item int32 [B], cluster int32 [B])."""
    b = users.switch.size
    bounds = np.cumsum([cfg.cand_current, cfg.cand_past, cfg.cand_reconsume])
    kind = np.searchsorted(bounds, rng.random(b), side="right")  # [B] in 0..3
    n_far = np.diff(hist.offsets) - cfg.far_start  # [B] items at recency >= far_start
    kind[(kind == RECONSUME) & (n_far <= 0)] = PAST
    item = np.empty(b, dtype=np.int32)
    cluster = np.empty(b, dtype=np.int32)

    rows = np.flatnonzero(kind <= PAST)
    group = (2 * rows + kind[rows]).astype(np.int32)  # the user's current or past mixture
    cluster[rows] = users.pick_clusters(group, rng.random(rows.size, dtype=np.float32))
    rand = np.flatnonzero(kind == RANDOM)
    cluster[rand] = world.sample_clusters_by_mass(rng.random(rand.size))
    drawn = np.flatnonzero(kind != RECONSUME)
    item[drawn] = world.sample_items(cluster[drawn], rng.random(drawn.size))

    again = np.flatnonzero(kind == RECONSUME)
    pos = hist.offsets[again] + (rng.random(again.size) * n_far[again]).astype(np.int64)
    item[again] = hist.item[pos]
    cluster[again] = hist.cluster[pos]
    return item, cluster


def _view_edges(cfg: DataConfig) -> np.ndarray:
    """Recency bucket edges: bucket j holds items with edges[j-1] <= r < edges[j]."""
    return np.array([k for k in cfg.oracle_ks if k > 0], dtype=np.int64)


def _bucket_sums(cfg: DataConfig, hist: History, cand_item: np.ndarray,
                 cand_cluster: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row and recency bucket: weighted matches, match counts, far item matches.

    Only the positions whose cluster matches the candidate's are touched after the first
    compare, which keeps this a small fraction of the generation time. Each output is
    float64 [B, n_buckets], cumulative over buckets (column j = items with r < edges[j]; the
    last column = the whole history).
    """
    b = cand_item.size
    edges = _view_edges(cfg)
    nb = edges.size + 1
    hit = np.flatnonzero(hist.cluster == cand_cluster[hist.row])  # [M] matched positions
    row, rec = hist.row[hit], hist.recency[hit]
    key = row * nb + np.searchsorted(edges, rec, side="right")  # [M]
    decay = np.exp2(-rec / cfg.recent_halflife)
    weight = decay * action_strength(cfg.n_actions)[hist.action[hit]]
    num = np.bincount(key, weights=weight, minlength=b * nb).reshape(b, nb)
    cnt = np.bincount(key, minlength=b * nb).reshape(b, nb).astype(np.float64)
    same = (hist.item[hit] == cand_item[row]) & (rec >= cfg.far_start)
    far = np.bincount(key[same], minlength=b * nb).reshape(b, nb).astype(np.float64)
    return np.cumsum(num, axis=1), np.cumsum(cnt, axis=1), np.cumsum(far, axis=1)


def planted_logits(world: World, cfg: DataConfig, hist: History, cand_item: np.ndarray,
                   cand_cluster: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """Logits of every oracle view: float64 [len(oracle_ks) + 1, B]; the last row is the full
    history (the one p_true comes from), row i < len(oracle_ks) sees only the last
    oracle_ks[i] items. dense: float32 [B, n_dense].
    """
    num, cnt, far = _bucket_sums(cfg, hist, cand_item, cand_cluster)
    lengths = np.diff(hist.offsets)
    q = 0.5 ** (1.0 / cfg.recent_halflife)
    base = cfg.bias + world.quality[cand_item] + dense.astype(np.float64) @ world.dense_w  # [B]
    edges = list(_view_edges(cfg))
    views = [(k, edges.index(k) if k > 0 else -1) for k in cfg.oracle_ks]
    views.append((None, len(edges)))  # the full history
    out = np.empty((len(views), cand_item.size))
    for i, (k, col) in enumerate(views):
        if col < 0:  # k = 0: no history visible
            out[i] = base
            continue
        seen = lengths if k is None else np.minimum(lengths, k)
        denom = (1.0 - q ** seen) / (1.0 - q)  # sum of the decay weights of the seen items
        r = np.divide(num[:, col], denom, out=np.zeros_like(denom), where=seen > 0)
        f = np.minimum(cnt[:, col], cfg.freq_cap) / cfg.freq_cap
        x = (far[:, col] > 0).astype(np.float64)
        out[i] = base + cfg.w_recent * r + cfg.w_freq * f + cfg.w_item * x
    return out
