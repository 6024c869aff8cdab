"""Timeline mode: returning users, each with one event stream, shown impressions over days.

Each user has one event stream (history.py's model, ending at the end of the last day) and a
Poisson number of impressions over the days; an example is one impression, its history the
events strictly before it, its candidate and label planted as in the per-example mode. Splits
are days (schema.split_days). Work is cut into blocks of users, one shard per split each; the
bytes depend on (config, seed) only. docs/data.md gives the details."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ConfigError, DataConfig
from .history import History, Users, row_and_recency, sample_history, sample_users
from .lengths import LengthModel
from .rows import HistorySource, build_rows
from .schema import SPLITS, split_days
from .world import World

TIMELINE_DEFINITION = (
    "one event stream per user (user_id 0..users-1), ending at the end of the last day; an "
    "example is an impression at impression_time (days since the start of day 1, "
    "impression_day = floor(impression_time) + 1) and its history is the user's events "
    "strictly before it, oldest first, hist_age in days before the impression. Splits are "
    "days (split_days). users: distinct users of the split; seen_in_train: how many of them "
    "have an impression in train; rows_seen_in_train: the split's rows of those users.")


@dataclass(frozen=True)
class TimelineBlock:
    """A block of users and their impressions: what one worker generates and writes."""

    index: int
    first_user: int  # user_id of the block's user 0
    n_users: int
    user: np.ndarray  # [N] int32, block-local user of each impression, in time order
    time: np.ndarray  # [N] float64, impression times (days since the start of day 1), sorted
    bounds: tuple[int, ...]  # rows bounds[i]:bounds[i + 1] belong to SPLITS[i]
    first_ids: tuple[int, ...]  # example_id of the first row of each split
    seed: np.random.SeedSequence  # the content's stream

    @property
    def rows(self) -> int:
        return int(self.user.size)

    def relpath(self, split: str) -> str:
        return f"{split}/part-{self.index:05d}.parquet"


def users_per_block(cfg: DataConfig) -> int:
    """Users whose expected impressions fill about rows_per_shard rows."""
    per_user = cfg.days * cfg.impressions_per_day
    return int(min(cfg.users, max(1, round(cfg.rows_per_shard / per_user))))


def impression_schedule(cfg: DataConfig, rng: np.random.Generator,
                        n_users: int) -> tuple[np.ndarray, np.ndarray]:
    """Impressions of n_users users: (user int32 [N], time float64 [N] in [0, days)), in time
    order."""
    shape = cfg.activity_shape
    rate = rng.gamma(shape, cfg.impressions_per_day / shape, size=n_users)  # [U] per day
    count = rng.poisson(rate * cfg.days)  # [U]
    time = rng.random(int(count.sum())) * cfg.days  # [N], < days (u < 1 rounds below days)
    user = np.repeat(np.arange(n_users, dtype=np.int32), count)
    order = np.argsort(time, kind="stable")
    return user[order], time[order]


def plan_blocks(cfg: DataConfig, seed: int) -> tuple[np.random.SeedSequence, list[TimelineBlock]]:
    """The world's seed stream and every block with its impression schedule. Raises
    ConfigError, before any work, when a split would have no rows."""
    size = users_per_block(cfg)
    starts = range(0, cfg.users, size)
    world_seed, *block_seeds = np.random.SeedSequence(seed).spawn(1 + len(starts))
    planned = []
    for first, block_seed in zip(starts, block_seeds):
        schedule_seed, content_seed = block_seed.spawn(2)
        n = min(size, cfg.users - first)
        user, time = impression_schedule(cfg, np.random.default_rng(schedule_seed), n)
        cuts = np.searchsorted(time, [cfg.days - 2, cfg.days - 1])  # days <= days-2 | days-1 | days
        planned.append((first, n, user, time, (0, *map(int, cuts), time.size), content_seed))
    rows = np.array([np.diff(p[4]) for p in planned]).reshape(-1, len(SPLITS))  # [blocks, 3]
    empty = [s for s, n in zip(SPLITS, rows.sum(axis=0)) if n == 0]
    if empty:
        raise ConfigError(f"the {empty[0]} split (day {split_days(cfg.days)[empty[0]][1]}) has no "
                          "impressions: raise --users or --impressions-per-day")
    # example ids run split by split (train, val, test), block by block within a split
    first_ids = np.cumsum(np.r_[0, rows.T.reshape(-1)])[:-1].reshape(len(SPLITS), -1).T
    blocks = [TimelineBlock(i, first, n, user, time, bounds, tuple(map(int, first_ids[i])), ss)
              for i, (first, n, user, time, bounds, ss) in enumerate(planned)]
    return world_seed, blocks


def events_before(offsets: np.ndarray, event_time: np.ndarray, user: np.ndarray,
                  time: np.ndarray) -> np.ndarray:
    """For each impression j, the number of user[j]'s events strictly before time[j]: int64
    [N]. offsets: the streams' [U + 1]; event_time: float64 [T], non-decreasing in a stream."""
    t = event_time.size
    event_user = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))  # [T]
    is_event = np.r_[np.ones(t, bool), np.zeros(user.size, bool)]
    # one merged order: by user, then time, an impression before an event at the same time
    order = np.lexsort((is_event, np.r_[event_time, time], np.r_[event_user, user]))
    events_so_far = np.cumsum(is_event[order]) - is_event[order]  # events before each position
    position = np.empty(order.size, np.int64)
    position[order] = np.arange(order.size)
    return events_so_far[position[t:]] - offsets[user]


def history_before(stream: History, event_time: np.ndarray, user: np.ndarray,
                   time: np.ndarray, lengths: np.ndarray,
                   out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> History:
    """Histories of B impressions: the first lengths[j] events of user[j]'s stream (those
    before time[j]), ages counted from time[j]. out: (item, action, age) [T] to fill."""
    offsets = np.zeros(user.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    row, recency = row_and_recency(offsets)  # [T] each
    pos = np.arange(offsets[-1]) + np.repeat(stream.offsets[user] - offsets[:-1], lengths)
    item, action, age = out
    np.take(stream.item, pos, out=item)
    np.take(stream.action, pos, out=action)
    # > 0 (events strictly before); float64 rounded to float32 keeps the order: oldest first
    np.subtract(np.repeat(time, lengths), event_time[pos], out=age, casting="same_kind")
    return History(offsets=offsets, item=item, action=action, age=age,
                   category=stream.category[pos], row=row, recency=recency,
                   motif=stream.motif[pos])


def _impressions(users: Users, stream: History, event_time: np.ndarray, user: np.ndarray,
                 time: np.ndarray, lengths: np.ndarray) -> HistorySource:
    def histories(lo: int, hi: int, out) -> tuple[Users, History]:
        return users.take(user[lo:hi]), history_before(
            stream, event_time, user[lo:hi], time[lo:hi], lengths[lo:hi], out)
    return histories


def seen_counts(user: np.ndarray, train_users: np.ndarray) -> dict[str, int]:
    """Distinct users among these rows' users, how many of them are in train_users, and the
    rows of those."""
    seen_rows = np.isin(user, train_users)
    return {"users": int(np.unique(user).size),
            "seen_in_train": int(np.unique(user[seen_rows]).size),
            "rows_seen_in_train": int(seen_rows.sum())}


def generate_block(world: World, cfg: DataConfig, lengths_model: LengthModel,
                   spec: TimelineBlock) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(split, columns, statistics) of the block's shard of each split (see rows.build_rows;
    statistics also hold the seen-user counts under "users")."""
    rng = np.random.default_rng(spec.seed)
    lengths = lengths_model.sample(rng, spec.n_users)  # [U] events per stream
    users = sample_users(world, cfg, rng, lengths)
    stream = sample_history(world, cfg, rng, users, lengths)
    event_time = cfg.days - stream.age.astype(np.float64)  # [T]
    before = events_before(stream.offsets, event_time, spec.user, spec.time)  # [N]
    train_users = np.unique(spec.user[:spec.bounds[1]])
    out = []
    for i, split in enumerate(SPLITS):
        rows = slice(spec.bounds[i], spec.bounds[i + 1])
        user, time = spec.user[rows], spec.time[rows]
        histories = _impressions(users, stream, event_time, user, time, before[rows])
        cols, stats = build_rows(world, cfg, rng, spec.first_ids[i], before[rows], histories,
                                 lambda lo, hi, user=user: spec.first_user + user[lo:hi])
        cols["impression_day"] = (np.floor(time) + 1).astype(np.int32)
        cols["impression_time"] = time
        stats["users"] = seen_counts(user, train_users)
        out.append((split, cols, stats))
    return out


def split_users(counts: list[dict[str, int]]) -> dict[str, Any]:
    """A split's seen-user figures for meta.json from its blocks' seen_counts (blocks hold
    disjoint users, so the counts add up)."""
    total = {k: sum(c[k] for c in counts) for k in ("users", "seen_in_train",
                                                    "rows_seen_in_train")}
    total["seen_share"] = total["seen_in_train"] / max(total["users"], 1)
    return total


def seen_users_line(meta: dict[str, Any]) -> str:
    """One line for people: the share of val and test users already seen in train."""
    parts = []
    for split in ("val", "test"):
        u = meta["splits"][split]["users"]
        parts.append(f"{split} {u['seen_in_train']:,} of {u['users']:,} ({u['seen_share']:.1%})")
    return "users seen in train: " + ", ".join(parts)
