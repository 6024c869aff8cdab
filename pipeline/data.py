"""LightningDataModule over the generated Parquet splits.

Every attention layout reads the same jagged batches (see :mod:`pipeline.batches`): histories cut to
their most recent ``max_seq_len`` items, as values + offsets. The data directory is checked
when the module is built (before any training): meta.json, the three splits, their schema.

Decoded splits are cached (``cache=True``, the default): see :mod:`pipeline.split_cache`."""

from __future__ import annotations

import logging
from itertools import islice
from pathlib import Path
from typing import Optional

import numpy as np

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from data_gen.config import generate_hint
from data_gen.schema import DataValidationError, is_timeline, validate_dataset
from models.config import UserEmbeddingConfig
from pipeline.batches import BatchDataset, EpochBatchSampler, JaggedSplit
from pipeline.errors import ConfigError
from pipeline.split_cache import SPLITS, load_split
from pipeline.user_features import JoinStats, UserEmbeddings, join_as_of, read_embeddings

log = logging.getLogger(__name__)


class RankerData(pl.LightningDataModule):
    """Jagged batches of the train/val/test splits of a data set (data.* options).

    Args:
        data_dir: a directory written by python -m data_gen generate (meta.json + splits), in
            either mode: the timeline mode's extra columns (impression day and time) are
            validated with the rest but not loaded.
        batch_size: training examples per step and process (the last partial training batch
            is dropped). In a distributed run every step trains a global batch of world size x
            batch_size rows, split across the ranks by tokens.
        eval_batch_size: examples per validation/test batch and process (default: batch_size);
            evaluation is split the same way, without padding: every example counted once.
        max_seq_len: histories keep their most recent max_seq_len items (> 0).
        num_workers: loader worker processes (0: load in the training process).
        seed: the training order is a function of (seed, epoch) only; each rank's share of it
            a function of (seed, epoch, rank, world size).
        cache: reuse the decoded arrays of earlier processes (memory-mapped .npy files under
            <data_dir>/.cache/), and write them after a full read.
        user_embedding: set from model.ranker.user_embedding (not by hand): every example is
            joined to its user's newest embedding as of its day - lag (pipeline/user_features.py);
            the counts of examples without one are in ``user_embedding_stats``.
        vocab_size: rows of the item table (default: the data's vocabulary); more rows than the
            data's ids make a larger table than the data needs (rows never looked up)."""

    def __init__(
        self,
        data_dir: str = "data/small",
        batch_size: int = 512,
        eval_batch_size: int | None = None,
        max_seq_len: int = 256,
        num_workers: int = 2,
        seed: int = 0,
        cache: bool = True,
        user_embedding: Optional[UserEmbeddingConfig] = None,
        vocab_size: Optional[int] = None,
    ):
        super().__init__()
        if max_seq_len <= 0:
            raise ConfigError(f"data.max_seq_len must be > 0, got {max_seq_len}")
        if batch_size <= 0 or (eval_batch_size is not None and eval_batch_size <= 0):
            raise ConfigError(f"data.batch_size/eval_batch_size must be > 0, got {batch_size}/{eval_batch_size}")
        if num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {num_workers}")
        self.data_dir = str(data_dir)
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.max_seq_len, self.num_workers, self.seed = max_seq_len, num_workers, seed
        self.cache = cache
        self.meta = _check_data_dir(self.data_dir)
        cfg = self.meta["config"]
        self.spec = {
            "vocab_size": int(cfg["vocab_size"] if vocab_size is None else vocab_size),
            "n_actions": int(cfg["n_actions"]),
            "n_dense": int(cfg["n_dense"]),
            "n_categories": int(cfg["n_categories"]),
            "train_ctr": float(self.meta["splits"]["train"]["ctr"]),
            "digest": str(self.meta.get("digest", "")),
        }
        if self.spec["vocab_size"] < int(cfg["vocab_size"]):
            raise ConfigError(f"data.vocab_size {vocab_size:,} is smaller than the vocabulary of {self.data_dir!r} "
                              f"({int(cfg['vocab_size']):,} items): every id of the data needs a row")
        self._splits: dict[str, JaggedSplit] = {}
        if isinstance(user_embedding, dict):
            user_embedding = UserEmbeddingConfig(**user_embedding)
        if user_embedding is not None and not is_timeline(self.meta):
            raise ConfigError(f"model.ranker.user_embedding needs a timeline data set (days and returning users); "
                              f"{self.data_dir!r} is per-example data (generate one with --preset timeline)")
        self.user_embedding = user_embedding
        self._embeddings: UserEmbeddings | None = None
        self.user_embedding_stats: dict[str, JoinStats] = {}

    @property
    def user_embedding_manifest(self) -> dict:
        return self._embeddings.manifest if self._embeddings is not None else {}

    def load_splits(self, stage: str) -> None:
        """Load and fully validate every split that `stage` reads (fit: all three, as it tests
        too), so that bad data stops the command before a run is recorded: a ConfigError."""
        try:
            self.setup(None if stage == "fit" else stage)
        except DataValidationError as err:
            raise ConfigError(_invalid(self.data_dir, err)) from None

    def setup(self, stage: str | None = None) -> None:
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage, SPLITS)
        for split in wanted:
            if split not in self._splits:
                data = load_split(self.data_dir, split, self.spec["n_dense"], cache=self.cache)
                if self.user_embedding is not None:
                    self._join_user_embeddings(split, data)
                self._splits[split] = data

    def item_categories(self) -> np.ndarray:
        """The catalogue the ranker's category embedding reads: the category every split's rows
        show for each item id, n_categories for ids in no row. int64 [vocab_size]."""
        self.setup()
        table = np.full(self.spec["vocab_size"], -1, np.int16)
        for split, data in self._splits.items():
            cat = data.item_category
            head = table[:cat.size]  # a view: written below
            if ((head >= 0) & (cat >= 0) & (head != cat)).any():
                raise ConfigError(_invalid(self.data_dir, ValueError(
                    f"the {split} split shows another category for an item id than an earlier split")))
            np.copyto(head, cat, where=cat >= 0)
        return np.where(table < 0, self.spec["n_categories"], table).astype(np.int64)

    def _join_user_embeddings(self, split: str, data: JaggedSplit) -> None:
        cfg = self.user_embedding
        if self._embeddings is None:  # read and checked once, before the first split is joined
            self._embeddings = read_embeddings(cfg.path, data_digest=self.spec["digest"], dim=cfg.dim)
        rows, stats = join_as_of(data.user, data.day, self._embeddings, cfg.lag_days)
        data.attach_user_features(self._embeddings.table, rows)
        self.user_embedding_stats[split] = stats
        log.info("user embeddings, %s split: %d of %d examples (%.1f%%) have none as of their day - %d "
                 "and use the unknown vector", split, stats.missing, stats.rows, 100 * stats.missing_share,
                 cfg.lag_days)

    def _sampler(self, split: str, batch_size: int, train: bool) -> EpochBatchSampler:
        data = self._splits[split]
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        lengths = data.lengths(self.max_seq_len) if world > 1 else None
        return EpochBatchSampler(data.num_rows, batch_size, shuffle=train, drop_last=train, seed=self.seed,
                                 lengths=lengths, rank=rank, world_size=world)

    def train_token_counts(self, epochs) -> np.ndarray:
        """History items (after truncation to max_seq_len) of every training batch of this
        process in `epochs` (an iterable of epoch numbers), in training order: exact, from the
        sampler's order."""
        self.setup("fit")
        values = self._splits["train"].lengths(self.max_seq_len)
        sampler = self._sampler("train", self.batch_size, train=True)
        return np.concatenate([sampler.batch_sums(values, e) for e in epochs] or [values[:0]])

    def train_owner_counts(self, epochs, owners: int, steps: int | None = None) -> np.ndarray:
        """Distinct item ids (the histories as truncated, and the candidates) of each of `owners`
        table shards in every training batch of this process in `epochs`, in training order, the
        first `steps` batches only (None: all): [batches, owners], exact, from the sampler's order."""
        self.setup("fit")
        batches = self._sampler("train", self.batch_size, train=True).batches  # epochs past `steps` never drawn
        return self._splits["train"].owner_counts(list(islice((i for e in epochs for i in batches(e)), steps)),
                                                  self.max_seq_len, owners)

    def _loader(self, split: str, batch_size: int, train: bool) -> DataLoader:
        data = self._splits[split]
        sampler = self._sampler(split, batch_size, train)
        if len(sampler) == 0:
            ranks = f" x {sampler.world_size} processes" if sampler.world_size > 1 else ""
            raise ConfigError(f"the {split} split has {data.num_rows} rows: fewer than one batch of "
                              f"{batch_size}{ranks}")
        return DataLoader(
            BatchDataset(data, self.max_seq_len),
            sampler=sampler,
            batch_size=None,  # the sampler yields whole batches
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            prefetch_factor=4 if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        loader = self._loader("train", self.batch_size, train=True)
        self._resume_position(loader.sampler)
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, train=False)

    def _resume_position(self, sampler: EpochBatchSampler) -> None:
        # A run resumed from a mid-epoch checkpoint continues with the batches it had not seen:
        # the trainer restored its loop progress before asking for the loader.
        trainer = self.trainer
        if trainer is None or not trainer.ckpt_path:
            return
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # batches trained
        n = _batches_per_epoch(len(sampler), trainer.limit_train_batches)
        sampler.set_epoch(trainer.current_epoch + done // n)  # a checkpoint at an epoch's end
        sampler.skip_next(done % n)


def _batches_per_epoch(available: int, limit: int | float | None) -> int:
    """Training batches per epoch under Lightning's limit_train_batches (count or fraction)."""
    if limit is None:
        return max(available, 1)
    if isinstance(limit, float) and limit <= 1.0:
        return max(int(available * limit), 1)
    return max(min(available, int(limit)), 1)


def _check_data_dir(data_dir: str) -> dict:
    """Cheap pre-flight check (meta.json, every shard's footer: schema and row count); the
    full check (checksums, values) runs in ``read_split`` when a split is loaded."""
    path = Path(data_dir)
    if not (path / "meta.json").is_file():
        raise ConfigError(f"no data set at {data_dir!r} (no meta.json): generate it with {generate_hint(data_dir)}")
    try:
        return validate_dataset(path, check_digest=False, deep=False)
    except (DataValidationError, OSError) as err:
        raise ConfigError(_invalid(data_dir, err)) from err


def _invalid(data_dir: str, err: Exception) -> str:
    return (f"invalid data set at {data_dir!r}: {err}. Check it with `python -m data_gen validate {data_dir}`"
            f" or delete it and generate it again ({generate_hint(data_dir)})")
