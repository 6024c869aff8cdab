"""Users and their histories: sparse interest mixtures that drift, drawn with popularity.

Each user has a *current* and a *past* mixture of `interests_per_user` clusters: the most
recent `switch` items (mean `switch_mean`) come from the current one, older ones from the past
one, a `noise` share from global popularity; motif pairs are planted on top. Vectorised over
the flat [T] layout of a chunk of rows. docs/data.md: why the drift makes old history matter."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .config import DataConfig
from .world import World

INTEREST_ACTION_DECAY = 0.6  # P(action a) ~ decay^a: engaged interactions are more common ...
NOISE_ACTION_DECAY = 0.25  # ... on interest items than on stray ones, so actions carry signal


@dataclass(frozen=True)
class Users:
    """B users' latent state; S = interests_per_user, mixture 0 = current, 1 = past.

    A (row, mixture) pair is a *group* g = 2 * row + mixture; per-draw lookups index groups
    with int32 and float32 to keep the memory traffic of the [T]-sized passes low."""

    slots: np.ndarray  # [B * 2 * S] int32, cluster of slot s of group g at g * S + s
    slot_cdf: np.ndarray  # [S - 1, B * 2] float32, cumulative weight of slots 0..j of group g
    switch: np.ndarray  # [B] int32, the last `switch` items come from the current mixture
    gap_days: np.ndarray  # [B] float32, mean days between two interactions

    def pick_clusters(self, group: np.ndarray, u: np.ndarray) -> np.ndarray:
        """One cluster per draw: group int32 [N] (2 * row + mixture), u float32 [N] in [0, 1).
        Returns int32 [N]."""
        slot = np.zeros(group.shape, dtype=np.int32)
        for cdf_j in self.slot_cdf:  # S - 1 comparisons beat a per-draw search for S ~ 3
            slot += u >= cdf_j[group]
        s = self.slot_cdf.shape[0] + 1
        return self.slots[group * s + slot]

    def take(self, rows: np.ndarray) -> "Users":
        """The users at `rows` (int [B'], repeats allowed) as a new B'-row Users."""
        s = self.slot_cdf.shape[0] + 1
        groups = (2 * rows[:, None] + np.arange(2)).reshape(-1)  # [B' * 2]
        return Users(slots=self.slots.reshape(-1, s)[groups].reshape(-1),
                     slot_cdf=self.slot_cdf[:, groups], switch=self.switch[rows],
                     gap_days=self.gap_days[rows])


@dataclass(frozen=True)
class History:
    """A chunk's histories in the flat jagged layout, oldest item first within each row."""

    offsets: np.ndarray  # [B + 1] int64
    item: np.ndarray  # [T] int32
    action: np.ndarray  # [T] int8
    age: np.ndarray  # [T] float32, days before the request; non-increasing within a row
    category: np.ndarray  # [T] int16, each item's true category
    row: np.ndarray  # [T] int32, local row of each item
    recency: np.ndarray  # [T] int32, items after this one in its row (0 = most recent)
    motif: np.ndarray | None = None  # [T] int16, the motif planted from here on, or -1


def row_and_recency(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For jagged rows with offsets [B + 1]: each position's row and the number of items after
    it in its row (0 = most recent), both int32 [T]."""
    lengths = np.diff(offsets)
    t = int(offsets[-1])
    row = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)  # [T]
    recency = np.repeat((offsets[1:] - 1).astype(np.int32), lengths)
    recency -= np.arange(t, dtype=np.int32)  # [T]
    return row, recency


def action_strength(n_actions: int) -> np.ndarray:
    """Weight of each action type in the planted model, rising with engagement, centred on an
    interest item's mean (so that R says how engaged, not whether matched): float64 [A]."""
    s = 2.0 * np.arange(1, n_actions + 1) / (n_actions + 1)
    p = INTEREST_ACTION_DECAY ** np.arange(n_actions)
    return s - (s * p).sum() / p.sum()


@functools.lru_cache(maxsize=8)
def _action_table(n_actions: int) -> np.ndarray:
    """Action of each 16-bit uniform: interest draws at [0, 2^16), noise draws at [2^16, 2^17).
    A table lookup is ~3x cheaper than comparing against A - 1 thresholds; the price is that
    action probabilities are multiples of 2^-16. int8 [2^17]."""
    u = (np.arange(1 << 16) + 0.5) / (1 << 16)
    table = []
    for decay in (INTEREST_ACTION_DECAY, NOISE_ACTION_DECAY):
        p = decay ** np.arange(n_actions)
        table.append(np.searchsorted(np.cumsum(p / p.sum())[:-1], u, side="right"))
    return np.concatenate(table).astype(np.int8)


def sample_users(world: World, cfg: DataConfig, rng: np.random.Generator,
                 lengths: np.ndarray) -> Users:
    """Latent state of B users with history lengths `lengths` (int [B])."""
    b, s = lengths.size, cfg.interests_per_user
    slots = world.sample_clusters_by_mass(rng.random((b, 2, s)))  # [B, 2, S]
    w = rng.gamma(cfg.interest_concentration, size=(b * 2, s)) + 1e-12  # Dirichlet via gammas
    cdf = np.cumsum(w / w.sum(axis=1, keepdims=True), axis=1)[:, :-1]  # [B * 2, S - 1]
    switch = np.ceil(rng.exponential(cfg.switch_mean, size=b))  # r >= switch <=> past
    span = cfg.history_days * rng.uniform(0.2, 1.0, size=b)  # heavy users act more often
    gap = span / np.maximum(lengths, 1)
    return Users(slots=slots.reshape(-1).astype(np.int32),
                 slot_cdf=np.ascontiguousarray(cdf.T, dtype=np.float32),
                 switch=np.minimum(switch, 2**31 - 1).astype(np.int32),
                 gap_days=gap.astype(np.float32))


def _ages(rng: np.random.Generator, users: Users, offsets: np.ndarray, lengths: np.ndarray,
          out: np.ndarray) -> None:
    """Ages in days into out (float32 [T]): the sum of exponential gaps from each item to the
    request, so they never increase toward the most recent item."""
    t = out.size
    gaps = rng.standard_exponential(t, dtype=np.float32)
    gaps *= np.repeat(users.gap_days, lengths)  # [T]
    tail_sum = np.zeros(t + 1)
    np.cumsum(gaps[::-1], dtype=np.float64, out=tail_sum[-2::-1])  # sum of gaps[i:]
    # Subtracting the row's own end keeps only this row's gaps; the result is monotone in i,
    # and stays so after rounding to float32.
    np.subtract(tail_sum[:-1], np.repeat(tail_sum[offsets[1:]], lengths), out=out,
                casting="same_kind")


def sample_history(world: World, cfg: DataConfig, rng: np.random.Generator, users: Users,
                   lengths: np.ndarray, out: tuple[np.ndarray, np.ndarray, np.ndarray]
                   | None = None) -> History:
    """Histories for B users with the given lengths (int [B]); see the module docstring.

    out: optional (item int32 [T], action int8 [T], age float32 [T]) arrays to fill, so that a
    shard's columns are written in place instead of copied."""
    b = lengths.size
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    t = int(offsets[-1])
    item, action, age = out if out is not None else (
        np.empty(t, np.int32), np.empty(t, np.int8), np.empty(t, np.float32))
    row, recency = row_and_recency(offsets)  # [T] each
    group = row * 2
    group += recency >= np.repeat(users.switch, lengths)  # [T] 2 * row + (draw is past)
    # One uniform decides noise vs interest and, rescaled, the slot: saves a [T] draw.
    # (float32 is plenty for these two choices; item draws below need float64.)
    u = rng.random(t, dtype=np.float32)  # [T]
    noise = u < cfg.noise
    if cfg.noise < 1.0:
        cluster = users.pick_clusters(group, (u - cfg.noise) / (1.0 - cfg.noise))  # [T]
    else:
        cluster = np.zeros(t, dtype=np.int32)
    if cfg.noise > 0.0:
        stray = np.flatnonzero(noise)
        cluster[stray] = world.sample_clusters_by_mass(rng.random(stray.size))
    world.sample_items(cluster, rng.random(t), out=item)
    category = world.cluster_category[cluster]  # [T]
    motif = _plant_motifs(world, cfg, rng, offsets, row, item, category)
    _actions(rng, cfg.n_actions, noise, out=action)
    _ages(rng, users, offsets, lengths, out=age)
    return History(offsets=offsets, item=item, action=action, age=age, category=category,
                   row=row, recency=recency, motif=motif)


def _plant_motifs(world: World, cfg: DataConfig, rng: np.random.Generator, offsets: np.ndarray,
                  row: np.ndarray, item: np.ndarray, category: np.ndarray) -> np.ndarray:
    """Overwrite pairs of items with motif pairs (in place); return the motif index planted
    from each position (int16 [T], -1: none). A pair starts at a position with probability
    motif_rate, its second item 1..motif_window later in the same row; a motif_decoy share of
    the pairs is reversed (b then a), so that only their order tells them apart."""
    motif = np.full(item.size, -1, np.int16)
    if cfg.n_motifs == 0 or cfg.motif_rate == 0 or item.size == 0:
        return motif
    first = np.unique(rng.integers(0, item.size, rng.binomial(item.size, cfg.motif_rate)))  # [P]
    j = rng.integers(0, cfg.n_motifs, first.size)
    second = first + rng.integers(1, cfg.motif_window + 1, first.size)
    keep = second < offsets[row[first] + 1]
    first, second, j = first[keep], second[keep], j[keep]
    pair = world.motifs[j, :2]  # [P, 2] categories (a, b)
    decoy = rng.random(first.size) < cfg.motif_decoy
    pair[decoy] = pair[decoy, ::-1]
    pos, cat = np.concatenate([first, second]), pair.T.reshape(-1)  # firsts, then seconds
    item[pos] = world.sample_category_items(cat, rng.random((2, pos.size)))
    category[pos] = world.item_category[item[pos]]  # whichever pair wrote a position last
    motif[first] = j
    return motif


def _actions(rng: np.random.Generator, n_actions: int, noise: np.ndarray,
             out: np.ndarray) -> None:
    """Action types into out (int8 [T]); stray (noise) draws are less engaged."""
    idx = rng.integers(0, 1 << 16, size=noise.size, dtype=np.int32)
    idx += noise * np.int32(1 << 16)
    np.take(_action_table(n_actions), idx, out=out)
