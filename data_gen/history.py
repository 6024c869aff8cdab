"""Users and their histories: sparse interest mixtures that drift, drawn with popularity.

Each user has two sparse mixtures of `interests_per_user` clusters: the *current* one and a
*past* one. Looking back from the request, the most recent `switch` items (an exponential
number with mean `switch_mean`) come from the current mixture and everything older from the
past mixture; a `noise` fraction of all items are stray draws from global popularity. This
drift is what makes old history informative: a candidate from a past interest is recognisable
only by a model that reads far enough back.

Slot clusters are drawn with probability Z_c / Z and slot weights are exchangeable (Dirichlet),
so averaged over users every item is drawn from the global Zipf law (see world.py).

All sampling is vectorised over the flat [T] layout of a chunk of rows (T = total items);
nothing loops over rows or items in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DataConfig
from .world import World

INTEREST_ACTION_DECAY = 0.6  # P(action a) ~ decay^a: engaged interactions are more common ...
NOISE_ACTION_DECAY = 0.25  # ... on interest items than on stray ones, so actions carry signal


@dataclass(frozen=True)
class Users:
    """B users' latent state; S = interests_per_user, mixture 0 = current, 1 = past."""

    slots: np.ndarray  # [B, 2, S] int64 cluster of each interest slot
    slot_cdf: np.ndarray  # [B, 2, S] float64 cumulative slot weights (last = 1)
    switch: np.ndarray  # [B] float64, items (from the end) drawn from the current mixture
    gap_days: np.ndarray  # [B] float64, mean days between two interactions

    def pick_clusters(self, row: np.ndarray, mixture: np.ndarray, u: np.ndarray) -> np.ndarray:
        """One cluster per draw from row's mixture (0/1) with uniforms u: int64, shape of row."""
        s = self.slots.shape[2]
        base = (row.astype(np.int64) * 2 + mixture) * s  # [N] index of slot 0
        cdf = self.slot_cdf.reshape(-1)
        slot = np.zeros(row.shape, dtype=np.int64)
        for j in range(s - 1):  # S - 1 comparisons beat a per-draw search for S ~ 3
            slot += u >= cdf[base + j]
        return self.slots.reshape(-1)[base + slot]


@dataclass(frozen=True)
class History:
    """A chunk's histories in the flat jagged layout, oldest item first within each row."""

    offsets: np.ndarray  # [B + 1] int64
    item: np.ndarray  # [T] int32
    action: np.ndarray  # [T] int8
    age: np.ndarray  # [T] float32, days before the request; non-increasing within a row
    cluster: np.ndarray  # [T] int64, the cluster each item was drawn from
    row: np.ndarray  # [T] int64, local row of each item
    recency: np.ndarray  # [T] int64, items after this one in its row (0 = most recent)


def action_strength(n_actions: int) -> np.ndarray:
    """Weight of each action type in the planted model, rising with engagement: float64 [A]."""
    return 2.0 * np.arange(1, n_actions + 1) / (n_actions + 1)


def _action_cdfs(n_actions: int) -> np.ndarray:
    """Interest CDF on [0, 1) then the noise CDF shifted to [1, 2): float64 [2 * A]."""
    a = np.arange(n_actions)
    tables = []
    for shift, decay in ((0.0, INTEREST_ACTION_DECAY), (1.0, NOISE_ACTION_DECAY)):
        p = decay ** a
        cdf = np.cumsum(p / p.sum())
        cdf[-1] = 1.0
        tables.append(shift + cdf)
    return np.concatenate(tables)


def sample_users(world: World, cfg: DataConfig, rng: np.random.Generator,
                 lengths: np.ndarray) -> Users:
    """Latent state of B users with history lengths `lengths` (int [B])."""
    b, s = lengths.size, cfg.interests_per_user
    slots = world.sample_clusters_by_mass(rng.random((b, 2, s)))  # [B, 2, S]
    w = rng.gamma(cfg.interest_concentration, size=(b, 2, s)) + 1e-12  # Dirichlet via gammas
    cdf = np.cumsum(w / w.sum(axis=2, keepdims=True), axis=2)
    cdf[:, :, -1] = 1.0
    switch = rng.exponential(cfg.switch_mean, size=b)  # [B]
    span = cfg.history_days * rng.uniform(0.2, 1.0, size=b)  # heavy users act more often
    gap = span / np.maximum(lengths, 1)
    return Users(slots=slots, slot_cdf=cdf, switch=switch, gap_days=gap)


def _ages(rng: np.random.Generator, users: Users, offsets: np.ndarray,
          row: np.ndarray) -> np.ndarray:
    """Ages in days: the sum of exponential gaps from each item to the request. float32 [T]."""
    t = row.size
    gaps = rng.standard_exponential(t, dtype=np.float32) * users.gap_days[row]  # [T] float64
    tail_sum = np.zeros(t + 1)
    np.cumsum(gaps[::-1], out=tail_sum[-2::-1])  # tail_sum[i] = sum of gaps[i:], [T + 1]
    # Subtracting the row's own end keeps only this row's gaps; monotone in i, so ages never
    # increase toward the most recent item, also after rounding to float32.
    return (tail_sum[:-1] - tail_sum[offsets[1:]][row]).astype(np.float32)


def sample_history(world: World, cfg: DataConfig, rng: np.random.Generator, users: Users,
                   lengths: np.ndarray) -> History:
    """Histories for B users with the given lengths (int [B]); see the module docstring."""
    b = lengths.size
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    t = int(offsets[-1])
    row = np.repeat(np.arange(b, dtype=np.int64), lengths)  # [T]
    recency = np.repeat(offsets[1:] - 1, lengths) - np.arange(t)  # [T]
    past = (recency >= users.switch[row]).astype(np.int64)  # [T] mixture of each draw
    # One uniform decides noise vs interest and, rescaled, which cluster: saves a pass.
    u = rng.random(t)  # [T]
    noise = u < cfg.noise
    if cfg.noise < 1.0:
        u_slot = (u - cfg.noise) / (1.0 - cfg.noise)
        cluster = users.pick_clusters(row, past, u_slot)  # [T]
    else:
        cluster = np.zeros(t, dtype=np.int64)
    if cfg.noise > 0.0:
        stray = np.flatnonzero(noise)
        cluster[stray] = world.sample_clusters_by_mass(u[stray] / cfg.noise)
    item = world.sample_items(cluster, rng.random(t))  # [T] int32
    u_act = rng.random(t, dtype=np.float32) + noise  # noise draws use the shifted table
    action = np.searchsorted(_action_cdfs(cfg.n_actions), u_act, side="right")
    # float32 rounding can lift a noise draw to exactly 2.0 (past the table): clamp it.
    action = np.minimum(action - cfg.n_actions * noise, cfg.n_actions - 1).astype(np.int8)
    age = _ages(rng, users, offsets, row)
    return History(offsets=offsets, item=item, action=action, age=age, cluster=cluster,
                   row=row, recency=recency)
