"""Recompute the planted model from the files: the oracle for any history window.

The label model of planted.py is a function of the stored columns alone (history, actions,
candidate, dense features) plus the item world, which the seed and config in meta.json
rebuild exactly. So the oracle logit can be recomputed from the data for any window k, e.g.
a model's own max_seq_len, and the recomputed full-history p must equal the stored p_true
(which is how the tests check that nothing hidden leaks into the labels)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pyarrow as pa

from .config import config_from_dict
from .history import History, row_and_recency
from .planted import TERMS, planted_terms
from .schema import load_meta, read_split
from .world import World, build_world, world_seed


def _history(world: World, table: pa.Table) -> tuple[History, np.ndarray, np.ndarray,
                                                      np.ndarray]:
    """History, candidate items, their true categories and dense features of a table's rows."""
    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        arr = table.column(name).combine_chunks()
        off = arr.offsets.to_numpy().astype(np.int64)
        vals = arr.values.slice(off[0], off[-1] - off[0]).to_numpy(zero_copy_only=False)
        return off - off[0], vals

    offsets, item = flat("hist_item")
    action, age = flat("hist_action")[1], flat("hist_age")[1]
    row, recency = row_and_recency(offsets)
    hist = History(offsets=offsets, item=item, action=action, age=age,
                   category=world.item_category[item], row=row, recency=recency)
    cand = table.column("cand_item").to_numpy()
    n_dense = sum(1 for n in table.column_names if n.startswith("dense_"))
    dense = np.stack([table.column(f"dense_{i}").to_numpy() for i in range(n_dense)], axis=1) \
        if n_dense else np.zeros((offsets.size - 1, 0), np.float32)
    return hist, cand, world.item_category[cand], dense


def oracle_logits(data_dir: str | Path, split: str, ks: list[int], without: str | None = None,
                  recency: bool = True, validate: bool = True) -> dict[str, np.ndarray]:
    """Planted logits of every row of `split` seeing only the last k items, for each k in ks
    (0 = no history), plus "full" (the logit p_true was drawn from). float64 [N] each.
    without: a term of planted.TERMS to leave out (what a ranker blind to it can reach).
    recency=False: R weighs its matches alike (what a read of the candidate's category without
    positions can reach of R). validate=False: read the split unchecked (its caller validated it)."""
    meta = load_meta(data_dir)
    cfg = config_from_dict(meta["config"])
    cfg = dataclasses.replace(cfg, oracle_ks=tuple(sorted(set(int(k) for k in ks))),
                              recent_halflife=cfg.recent_halflife if recency else math.inf)
    world = build_world(cfg, world_seed(int(meta["seed"])))
    table = read_split(data_dir, split, validate=validate)
    hist, cand, cand_cat, dense = _history(world, table)
    base, terms = planted_terms(world, cfg, hist, cand, cand_cat, dense)
    if without is not None:
        terms[TERMS.index(without)] = 0.0
    logits = base + terms.sum(axis=0)
    out = {str(k): logits[i] for i, k in enumerate(cfg.oracle_ks)}
    out["full"] = logits[-1]
    return out
