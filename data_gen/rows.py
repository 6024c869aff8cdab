"""Rows from histories: candidates, dense features, the planted label, the shard's columns.

Both modes build their rows here, and so plant the label the same way: the per-example mode
from fresh users (generate.generate_shard), the timeline mode from users' event streams cut at
impression times (timeline.py). Rows are made CHUNK_ROWS at a time, which bounds the memory of
the [T]-sized temporaries of history.py and planted.py."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .config import DataConfig
from .history import History, Users
from .planted import TERMS, planted_terms, sample_candidates
from .world import World

# Rows generated together. Part of the definition of the data (it orders the draws of a
# shard's stream), so changing it needs a new generate.GENERATOR_VERSION.
CHUNK_ROWS = 4096

# histories(lo, hi, out): the users and histories of rows lo..hi, their items, actions and
# ages written into out (the rows' slices of the shard's flat columns)
HistorySource = Callable[[int, int, tuple[np.ndarray, np.ndarray, np.ndarray]],
                         tuple[Users, History]]
# user_ids(lo, hi): the user_id column of rows lo..hi, int64 [hi - lo] (asked after the label)
UserIds = Callable[[int, int], np.ndarray]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def build_rows(world: World, cfg: DataConfig, rng: np.random.Generator, first_id: int,
               lengths: np.ndarray, histories: HistorySource,
               user_ids: UserIds) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """All columns of B = lengths.size rows whose histories have these lengths (int [B]), and
    the per-row statistics meta.json needs (lengths, label, p_true, every oracle view's logit
    and every term of it).

    Columns are numpy arrays; sequences are (offsets int64 [B + 1], flat values [T]). Per
    chunk the draws come in a fixed order: whatever `histories` draws, then candidates, dense
    features, labels, and whatever `user_ids` draws."""
    b = lengths.size
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    t = int(offsets[-1])
    item, action, age = np.empty(t, np.int32), np.empty(t, np.int8), np.empty(t, np.float32)
    cand = np.empty(b, np.int32)
    dense = np.empty((b, cfg.n_dense), np.float32)
    logits = np.empty((len(cfg.oracle_ks) + 1, b), np.float32)
    terms = np.empty((len(TERMS), len(cfg.oracle_ks) + 1, b), np.float32)
    p_true, label, user_id = np.empty(b, np.float32), np.empty(b, np.int8), np.empty(b, np.int64)
    for lo in range(0, b, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, b)
        flat = slice(offsets[lo], offsets[hi])
        users, hist = histories(lo, hi, (item[flat], action[flat], age[flat]))
        ci, cc = sample_candidates(world, cfg, rng, users, hist)
        dense[lo:hi] = rng.standard_normal((hi - lo, cfg.n_dense), dtype=np.float32)
        base, term = planted_terms(world, cfg, hist, ci, cc, dense[lo:hi])
        view = base + term.sum(axis=0)  # [n_views, B_chunk]
        p = sigmoid(view[-1]).astype(np.float32)
        label[lo:hi] = rng.random(hi - lo) < p  # drawn from the stored float32 p_true
        user_id[lo:hi] = user_ids(lo, hi)
        p_true[lo:hi], logits[:, lo:hi], terms[:, :, lo:hi], cand[lo:hi] = p, view, term, ci
    cols: dict[str, Any] = {
        "example_id": np.arange(first_id, first_id + b, dtype=np.int64),
        "user_id": user_id, "hist_item": (offsets, item), "hist_action": (offsets, action),
        "hist_age": (offsets, age), "hist_category": (offsets, world.shown_category[item]),
        "cand_item": cand, "cand_category": world.shown_category[cand],
        **{f"dense_{i}": np.ascontiguousarray(dense[:, i]) for i in range(cfg.n_dense)},
        "label": label, "p_true": p_true,
    }
    stats = {"lengths": lengths.astype(np.int32), "label": label, "p_true": p_true,
             "logits": logits, "terms": terms}
    return cols, stats
