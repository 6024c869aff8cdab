"""Candidates and the planted label model, with its per-term, history-truncated oracle views.

    logit = bias + quality[cand] + dense . dense_w + w_recent R + w_freq F + w_item X + w_motif M

R, F and M match TRUE categories (the files show a noisy copy); docs/data.md defines each term
and the ranker component that recovers it. `planted_terms` gives every weighted term for every
view: the last k items of each history for k in oracle_ks (k = 0: none), then the whole history
(the view p_true is drawn from). Caveat: a view is a plug-in score of this one function, not a
Bayes-optimal predictor for a k-item window."""

from __future__ import annotations

import numpy as np

from .config import DataConfig
from .history import History, Users, action_strength
from .world import World

TERMS = ("recent", "freq", "item", "motif")
CURRENT, PAST, RECONSUME, MOTIF, RANDOM = range(5)


def sample_candidates(world: World, cfg: DataConfig, rng: np.random.Generator, users: Users,
                      hist: History) -> tuple[np.ndarray, np.ndarray]:
    """One candidate per row: (item int32 [B], true category int16 [B]). Kinds: the current or
    past interests, an item seen >= far_start items ago, the b of the most recent motif pair
    planted in the history (true or decoy), or a random popular item; the two history-bound kinds fall back
    to a past interest where the history has nothing to offer."""
    b = users.switch.size
    bounds = np.cumsum([cfg.cand_current, cfg.cand_past, cfg.cand_reconsume, cfg.cand_motif])
    kind = np.searchsorted(bounds, rng.random(b), side="right")  # [B] in 0..4
    n_far = np.diff(hist.offsets) - cfg.far_start  # [B] items at recency >= far_start
    marks = np.flatnonzero(hist.motif >= 0)  # [P] planted pairs, grouped by row
    n_marks = np.bincount(hist.row[marks], minlength=b)  # [B]
    kind[((kind == RECONSUME) & (n_far <= 0)) | ((kind == MOTIF) & (n_marks == 0))] = PAST
    item = np.empty(b, dtype=np.int32)
    cat = np.empty(b, dtype=np.int16)
    cluster = np.empty(b, dtype=np.int32)

    rows = np.flatnonzero(kind <= PAST)
    group = (2 * rows + kind[rows]).astype(np.int32)  # the user's current or past mixture
    cluster[rows] = users.pick_clusters(group, rng.random(rows.size, dtype=np.float32))
    rand = np.flatnonzero(kind == RANDOM)
    cluster[rand] = world.sample_clusters_by_mass(rng.random(rand.size))
    drawn = np.flatnonzero((kind <= PAST) | (kind == RANDOM))
    item[drawn] = world.sample_items(cluster[drawn], rng.random(drawn.size))
    cat[drawn] = world.cluster_category[cluster[drawn]]

    again = np.flatnonzero(kind == RECONSUME)
    pos = hist.offsets[again] + (rng.random(again.size) * n_far[again]).astype(np.int64)
    item[again], cat[again] = hist.item[pos], hist.category[pos]

    mot = np.flatnonzero(kind == MOTIF)
    pick = marks[np.cumsum(n_marks)[mot] - 1]  # the row's most recent planted pair
    cat[mot] = world.motifs[hist.motif[pick], 1]
    item[mot] = world.sample_category_items(cat[mot], rng.random((2, mot.size)))
    return item, cat


def _view_edges(cfg: DataConfig) -> np.ndarray:
    """Recency bucket edges: bucket j holds items with edges[j-1] <= r < edges[j]."""
    return np.array([k for k in cfg.oracle_ks if k > 0], dtype=np.int64)


def _by_bucket(row: np.ndarray, recency: np.ndarray, edges: np.ndarray, b: int,
               weights: np.ndarray | None = None) -> np.ndarray:
    """Sums of weights (default 1) per row and recency bucket, cumulative over buckets (column
    j: items with r < edges[j]; the last column: the whole history): float64 [B, n_buckets]."""
    nb = edges.size + 1
    key = row.astype(np.int64) * nb + np.searchsorted(edges, recency, side="right")
    return np.cumsum(np.bincount(key, weights, minlength=b * nb).reshape(b, nb), axis=1,
                     dtype=np.float64)


def _category_matches(cfg: DataConfig, hist: History, cand_item: np.ndarray,
                      cand_cat: np.ndarray, edges: np.ndarray):
    """By bucket: the recency-weighted sums of the (centred) action strength and of the weights
    over the candidate category's matches, match counts, far same-item matches."""
    b = cand_item.size
    hit = np.flatnonzero(hist.category == cand_cat[hist.row])  # [M] matched positions
    row, rec = hist.row[hit], hist.recency[hit]
    weight = np.exp2(-rec / cfg.recent_halflife)
    engaged = weight * action_strength(cfg.n_actions)[hist.action[hit]]
    far = (hist.item[hit] == cand_item[row]) & (rec >= cfg.far_start)
    return (_by_bucket(row, rec, edges, b, engaged), _by_bucket(row, rec, edges, b, weight),
            _by_bucket(row, rec, edges, b), _by_bucket(row[far], rec[far], edges, b))


def _motif_matches(world: World, cfg: DataConfig, hist: History, cand_cat: np.ndarray,
                   edges: np.ndarray) -> np.ndarray:
    """Pairs of the motif that ends in each row's candidate category b (an a, then a b at most
    motif_window items later), by the bucket of their a (the older item). Only the rows whose
    candidate category ends a motif are read."""
    j_row = world.motif_of[cand_cat] if cfg.n_motifs else np.full(cand_cat.size, -1)  # [B]
    rows = np.flatnonzero(j_row >= 0)  # [R]
    n = np.diff(hist.offsets)[rows]
    local = np.zeros(rows.size + 1, np.int64)  # the R rows' offsets in the compacted layout
    np.cumsum(n, out=local[1:])
    pos = np.arange(local[-1]) + np.repeat(hist.offsets[rows] - local[:-1], n)  # [T'] in hist
    cat, j = hist.category[pos], np.repeat(j_row[rows], n)
    last_a = np.maximum.accumulate(np.where(cat == world.motifs[j, 0], np.arange(pos.size), -1))
    q = np.flatnonzero(cat[1:] == world.motifs[j[1:], 1]) + 1  # the pairs' b
    a = last_a[q - 1]  # the latest a before each b: any pair's a is no later
    a = a[(a >= q - cfg.motif_window) & (a >= np.repeat(local[:-1], n)[q])]
    return _by_bucket(np.repeat(rows, n)[a], hist.recency[pos[a]], edges, cand_cat.size)


def planted_terms(world: World, cfg: DataConfig, hist: History, cand_item: np.ndarray,
                  cand_cat: np.ndarray, dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(base float64 [B], terms float64 [len(TERMS), len(oracle_ks) + 1, B]): the history-free
    part of the logit and each weighted term (TERMS order) in each view; view i <
    len(oracle_ks) sees the last oracle_ks[i] items, the last view the whole history.
    A view's logit is base + terms[:, view].sum(0). dense: float32 [B, n_dense]."""
    edges = _view_edges(cfg)
    engaged, weight, cnt, far = _category_matches(cfg, hist, cand_item, cand_cat, edges)
    motif = _motif_matches(world, cfg, hist, cand_cat, edges)
    views = [(k, list(edges).index(k)) for k in cfg.oracle_ks if k > 0]
    views = [(0, -1)] * (len(cfg.oracle_ks) - len(views)) + views + [(None, edges.size)]
    terms = np.zeros((len(TERMS), len(views), cand_item.size))
    for i, (k, col) in enumerate(views):
        if col < 0:  # k = 0: no history visible
            continue
        w = weight[:, col]
        terms[0, i] = cfg.w_recent * np.divide(engaged[:, col], w, out=np.zeros_like(w), where=w > 0)
        terms[1, i] = cfg.w_freq * np.minimum(cnt[:, col], cfg.freq_cap) / cfg.freq_cap
        terms[2, i] = cfg.w_item * (far[:, col] > 0)
        terms[3, i] = cfg.w_motif * (motif[:, col] > 0)
    base = cfg.bias + world.quality[cand_item] + dense.astype(np.float64) @ world.dense_w
    return base, terms
