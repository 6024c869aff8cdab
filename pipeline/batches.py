"""Jagged batches from a Parquet split, without per-row Python loops.

A split is read once (through ``data_gen.schema.read_split``) into flat numpy buffers that
view Arrow's memory: the list columns become one values array plus one row-offsets array.
A batch is an index array; ``JaggedSplit.gather`` cuts every row's most recent
``max_seq_len`` items out of the values with one computed index vector (np.repeat / cumsum),
so its cost is a handful of vectorised gathers whatever the batch size.

A DataLoader over :class:`BatchDataset` with ``batch_size=None`` and an
:class:`EpochBatchSampler` hands each worker process whole index arrays; the sampler's order
depends only on (seed, epoch, rank, world size), it splits each global batch across the ranks
of a distributed run by tokens (:func:`balance_ranks`), and it can skip the batches a resumed
run already trained on."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset, Sampler

HIST_COLUMNS = ("hist_item", "hist_action", "hist_age")
CATEGORY_COLUMNS = ("hist_category", "cand_category")  # read into the catalogue, not the batches


def _list_buffers(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column -> (values, offsets [R+1] int64) without copying the values."""
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    offsets = arr.offsets.to_numpy().astype(np.int64)  # absolute into arr.values, even if sliced
    values = arr.values.to_numpy(zero_copy_only=False)
    return values, offsets


def _flat(col: pa.ChunkedArray) -> np.ndarray:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return arr.to_numpy(zero_copy_only=False)


class JaggedSplit:
    """One split as flat arrays: histories (values + row offsets), candidate, dense, label, the
    user and the impression day (0 for a per-example data set, which has no days), and the
    split's item catalogue: ``item_category[id]``, the category its rows show for the item id
    (int16, -1 for ids in none of them; as long as the largest id seen).

    ``attach_user_features`` adds per-row columns (a user embedding joined as of the row's day)
    that ``gather`` appends to the batch's "dense" tensor."""

    def __init__(self, table: pa.Table, n_dense: int):
        self.num_rows = table.num_rows
        hist = {name: _list_buffers(table.column(name)) for name in HIST_COLUMNS}
        self.row_offsets = hist["hist_item"][1]  # [R+1]
        lengths = np.diff(self.row_offsets)
        for name in HIST_COLUMNS[1:]:
            if not np.array_equal(np.diff(hist[name][1]), lengths):
                raise ValueError(f"{name} is not aligned with hist_item (different list lengths)")
            if hist[name][1][0] != self.row_offsets[0]:  # same offsets base keeps one index vector
                raise ValueError(f"{name} and hist_item lists start at different offsets")
        self.item = hist["hist_item"][0].astype(np.int32, copy=False)
        self.action = hist["hist_action"][0].astype(np.int8, copy=False)
        self.age = hist["hist_age"][0].astype(np.float32, copy=False)
        self.cand = _flat(table.column("cand_item")).astype(np.int32, copy=False)
        self.dense = np.stack(
            [_flat(table.column(f"dense_{i}")).astype(np.float32, copy=False) for i in range(n_dense)], axis=1
        ) if n_dense else np.zeros((self.num_rows, 0), np.float32)  # [R, n_dense]
        self.label = _flat(table.column("label")).astype(np.float32)
        self.user = _flat(table.column("user_id")).astype(np.int64, copy=False)
        self.day = (_flat(table.column("impression_day")).astype(np.int32, copy=False)
                    if "impression_day" in table.column_names else np.zeros(self.num_rows, np.int32))
        self.user_features = None
        self.item_category = _catalogue(self.item[self.row_offsets[0]:self.row_offsets[-1]], self.cand,
                                        table.column("hist_category"), table.column("cand_category"))

    # the whole state
    ARRAYS = ("row_offsets", "item", "action", "age", "cand", "dense", "label", "user", "day", "item_category")

    def attach_user_features(self, table: np.ndarray, rows: np.ndarray) -> None:
        """Per-row features from a table: row r gets table[rows[r]] and a known flag 1, or zeros
        and flag 0 where rows[r] < 0. table: [E, dim] float32; rows: [R] int."""
        if len(rows) != self.num_rows:
            raise ValueError(f"{len(rows)} feature rows for a split of {self.num_rows}")
        padded = np.concatenate([np.asarray(table, np.float32), np.zeros((1, table.shape[1]), np.float32)])
        known = np.ones((len(padded), 1), np.float32)
        known[-1] = 0.0
        self.user_features = (np.concatenate([padded, known], axis=1),  # [E + 1, dim + 1]
                              np.where(rows < 0, len(table), rows).astype(np.int64))

    def arrays(self) -> dict[str, np.ndarray]:
        """The split's flat arrays by name (see ARRAYS): what ``from_arrays`` rebuilds it from."""
        return {name: getattr(self, name) for name in self.ARRAYS}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "JaggedSplit":
        """A split over arrays saved from ``arrays()`` (e.g. memory-mapped .npy files)."""
        self = cls.__new__(cls)
        for name in cls.ARRAYS:
            setattr(self, name, arrays[name])
        self.num_rows = len(self.cand)
        self.user_features = None
        n_items = int(self.row_offsets[-1]) if len(self.row_offsets) else -1
        if (len(self.row_offsets) != self.num_rows + 1 or self.dense.ndim != 2
                or len(self.dense) != self.num_rows or len(self.label) != self.num_rows
                or len(self.user) != self.num_rows or len(self.day) != self.num_rows
                or min(len(self.item), len(self.action), len(self.age)) < n_items):
            raise ValueError("inconsistent split arrays (row counts or history lengths differ)")
        return self

    def lengths(self, max_seq_len: int) -> np.ndarray:
        """History items of every row after truncation to max_seq_len: [R] int64."""
        return np.minimum(np.diff(self.row_offsets), max_seq_len)

    def owner_counts(self, batches, max_seq_len: int, owners: int) -> np.ndarray:
        """Distinct item ids of each batch of rows (`batches`: index arrays; the histories cut to
        max_seq_len, and the candidates) held by each of `owners` table shards (shard id % owners):
        [len(batches), owners] int64."""
        seen = np.full(len(self.item_category), -1, np.int64)  # id (the catalogue's) -> a position
        out, done = np.zeros((len(batches), owners), np.int64), 0
        for b, idx in enumerate(batches):
            got = np.concatenate([self.item[self._history(idx, max_seq_len)[1]], self.cand[idx]])
            at = np.arange(done, done + len(got))
            seen[got] = at  # of an id's repeats one position stays: the id counted once
            out[b] = np.bincount(got[seen[got] == at] % owners, minlength=owners)
            done += len(got)
        return out

    def _history(self, idx: np.ndarray, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [B + 1], src [T]) of rows `idx`' histories cut to their most recent max_seq_len:
        the jagged offsets, and where each item lies in the flat arrays."""
        end = self.row_offsets[idx + 1]
        keep = np.minimum(end - self.row_offsets[idx], max_seq_len)  # [B]
        offsets = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(keep, out=offsets[1:])
        # row t of the batch reads values[end_b - keep_b + (t - offsets_b)]
        return offsets, np.arange(offsets[-1], dtype=np.int64) + np.repeat(end - keep - offsets[:-1], keep)

    def gather(self, idx: np.ndarray, max_seq_len: int) -> dict:
        """The batch of rows `idx` [B]: jagged histories cut to their most recent max_seq_len."""
        offsets, src = self._history(idx, max_seq_len)
        dense = self.dense[idx]
        if self.user_features is not None:
            table, rows = self.user_features
            dense = np.concatenate([dense, table[rows[idx]]], axis=1)
        return {
            "hist_item": torch.from_numpy(self.item[src]),  # [T] int32
            "hist_action": torch.from_numpy(self.action[src]),  # [T] int8
            "hist_age": torch.from_numpy(self.age[src]),  # [T] float32
            "offsets": torch.from_numpy(offsets),  # [B+1] int64
            "cand_item": torch.from_numpy(self.cand[idx]),  # [B] int32
            "dense": torch.from_numpy(dense),  # [B, models.feature_width] float32
            "label": torch.from_numpy(self.label[idx]),  # [B] float32
            "n_tokens": int(offsets[-1]),
            "max_seq_len": int(max_seq_len),
        }


def _catalogue(item: np.ndarray, cand: np.ndarray, hist_category: pa.ChunkedArray,
               cand_category: pa.ChunkedArray) -> np.ndarray:
    """int16 [max id + 1]: the category shown with each item id, -1 for ids never shown."""
    values, offsets = _list_buffers(hist_category)
    cats = np.concatenate([values[offsets[0]:offsets[-1]], _flat(cand_category)]).astype(np.int16)
    ids = np.concatenate([item, cand])
    table = np.full(int(ids.max(initial=-1)) + 1, -1, np.int16)
    table[ids] = cats
    if not np.array_equal(table[ids], cats):
        raise ValueError("an item id shows two categories in this split")
    return table


class BatchDataset(Dataset):
    """Item i is a whole batch: ``dataset[index_array]`` -> the gathered batch dict."""

    def __init__(self, split: JaggedSplit, max_seq_len: int):
        self.split = split
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return self.split.num_rows

    def __getitem__(self, idx: np.ndarray) -> dict:
        return self.split.gather(idx, self.max_seq_len)


def balance_ranks(lengths: np.ndarray, world_size: int) -> np.ndarray:
    """The rank of every row of G global batches: lengths [G, n] int -> ranks [G, n] int64.

    Greedy longest-first: the rows of each global batch, longest first, each go to the rank
    with the fewest tokens so far among the ranks with room, a rank holding at most
    ceil(n / world_size) rows. Every rank of a full global batch (n = world_size x batch_size)
    gets exactly batch_size rows. While every rank has room a row goes to the lightest rank, so
    the spread of the ranks' tokens never exceeds the row just placed, and the last rows placed
    are the shortest: on the `paper` data the ranks end within a token of each other
    (experiments/results/ddp-token-balance-paper.md). Deterministic (stable sorts, lowest rank
    first on ties), vectorised over the G batches: n steps of [G, world_size] work."""
    lengths = np.asarray(lengths, dtype=np.int64)
    G, n = lengths.shape
    room = -(-n // world_size)
    order = np.argsort(-lengths, axis=1, kind="stable")  # [G, n] longest first
    placed = np.take_along_axis(lengths, order, axis=1)
    load = np.zeros((G, world_size), np.int64)
    count = np.zeros((G, world_size), np.int64)
    ranks_sorted = np.empty((G, n), np.int64)
    g = np.arange(G)
    full = np.iinfo(np.int64).max
    for i in range(n):
        r = np.where(count < room, load, full).argmin(axis=1)  # [G] first minimum: lowest rank
        ranks_sorted[:, i] = r
        load[g, r] += placed[:, i]
        count[g, r] += 1
    ranks = np.empty_like(ranks_sorted)
    np.put_along_axis(ranks, order, ranks_sorted, axis=1)
    return ranks


class EpochBatchSampler(Sampler):
    """Yields this rank's index arrays of one epoch; a function of (seed, epoch, rank, world size).

    The epoch's row order (a permutation by (seed, epoch) when shuffling, file order for
    evaluation) is cut into global batches of ``world_size x batch_size`` consecutive rows; with
    one process a global batch is the batch. With several, each global batch is split across
    the ranks by :func:`balance_ranks` on ``lengths`` (the rows' history items after truncation),
    so that every rank's batch carries nearly the same number of tokens; rank ``rank`` yields
    its part. Every row is in exactly one rank's batch once per epoch; ``drop_last`` drops the
    last, partial global batch, else it is split the same way, each rank getting at most
    ceil(rows / world_size) of its rows (possibly none: an empty batch).

    Within a batch, indices are sorted (when shuffling or sharding): the same examples, gathered
    with better memory locality. ``skip_next(n)`` makes the next epoch started skip its first n
    batches (a resumed run continues where it stopped)."""

    def __init__(self, num_rows: int, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int = 0,
                 lengths: np.ndarray | None = None, rank: int = 0, world_size: int = 1):
        if world_size > 1 and (lengths is None or len(lengths) != num_rows):
            raise ValueError("a sharded sampler needs the length of every row")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.num_rows, self.batch_size = num_rows, batch_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.lengths, self.rank, self.world_size = lengths, rank, world_size
        self.epoch = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, n: int) -> None:
        self._skip = n

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        n, gb = self.num_rows, self.global_batch_size
        return n // gb if self.drop_last else -(-n // gb)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of an epoch (global batches are its consecutive slices)."""
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return np.arange(self.num_rows)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's index arrays of an epoch, in order (each sorted when shuffled or sharded)."""
        order, n, gb = self.order(epoch), len(self), self.global_batch_size
        if self.world_size == 1:
            out = [order[b * gb: (b + 1) * gb] for b in range(n)]
            return [np.sort(idx) for idx in out] if self.shuffle else out
        full = min(n, self.num_rows // gb)
        rows = order[: full * gb].reshape(full, gb)
        mine = rows[balance_ranks(self.lengths[rows], self.world_size) == self.rank].reshape(full, self.batch_size)
        out = list(np.sort(mine, axis=1))
        if n > full:  # the last, partial global batch (evaluation)
            rest = order[full * gb:]
            ranks = balance_ranks(self.lengths[rest][None, :], self.world_size)[0]
            out.append(np.sort(rest[ranks == self.rank]))
        return out

    def batch_sums(self, values: np.ndarray, epoch: int) -> np.ndarray:
        """sum(values[idx]) for every batch idx this rank gets in an epoch: e.g. its token counts."""
        return np.array([values[idx].sum() for idx in self.batches(epoch)], dtype=values.dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        batches = self.batches(self.epoch)
        skip, self._skip = self._skip, 0
        yield from batches[skip:]
