"""LightningDataModule over the generated Parquet splits, and a loader benchmark.

    python -m pipeline.data bench --data data/small [--batch-size 512] [--workers 2] [--max-seq-len 256]

Every backend reads the same jagged batches (see :mod:`pipeline.batches`): histories cut to
their most recent ``max_seq_len`` items, as values + offsets. The data directory is checked
when the module is built (before any training): meta.json, the three splits, their schema.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from data_gen.schema import DataValidationError, read_split, validate_dataset
from pipeline.batches import HIST_COLUMNS, BatchDataset, EpochBatchSampler, JaggedSplit
from pipeline.errors import ConfigError

SPLITS = ("train", "val", "test")


def _columns(n_dense: int) -> list[str]:
    return [*HIST_COLUMNS, "cand_item", *(f"dense_{i}" for i in range(n_dense)), "label"]


class RankerData(pl.LightningDataModule):
    """Jagged batches of the train/val/test splits of a data_gen data set.

    Args:
        data_dir: a directory written by ``python -m data_gen generate`` (meta.json + splits).
        batch_size: training examples per step (the last partial training batch is dropped).
        eval_batch_size: examples per validation/test batch (default: batch_size).
        max_seq_len: histories keep their most recent max_seq_len items (> 0).
        num_workers: loader worker processes (0: load in the training process).
        seed: the training order is a function of (seed, epoch) only.
    """

    def __init__(
        self,
        data_dir: str = "data/small",
        batch_size: int = 512,
        eval_batch_size: int | None = None,
        max_seq_len: int = 256,
        num_workers: int = 2,
        seed: int = 0,
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
        self.meta = _check_data_dir(self.data_dir)
        cfg = self.meta["config"]
        self.spec = {
            "vocab_size": int(cfg["vocab_size"]),
            "n_actions": int(cfg["n_actions"]),
            "n_dense": int(cfg["n_dense"]),
            "train_ctr": float(self.meta["splits"]["train"]["ctr"]),
            "digest": str(self.meta.get("digest", "")),
        }
        self._splits: dict[str, JaggedSplit] = {}

    def setup(self, stage: str | None = None) -> None:
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage, SPLITS)
        for split in wanted:
            if split not in self._splits:
                table = read_split(self.data_dir, split, columns=_columns(self.spec["n_dense"]))
                self._splits[split] = JaggedSplit(table, self.spec["n_dense"])

    def _loader(self, split: str, batch_size: int, train: bool) -> DataLoader:
        data = self._splits[split]
        sampler = EpochBatchSampler(data.num_rows, batch_size, shuffle=train, drop_last=train, seed=self.seed)
        if len(sampler) == 0:
            raise ConfigError(f"the {split} split has {data.num_rows} rows: fewer than one batch of {batch_size}")
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
    hint = f"generate it with `make data` or `python -m data_gen generate --preset small --out {data_dir}`"
    if not (path / "meta.json").is_file():
        raise ConfigError(f"no data set at {data_dir!r} (no meta.json): {hint}")
    try:
        return validate_dataset(path, check_digest=False, deep=False)
    except (DataValidationError, OSError) as err:
        raise ConfigError(
            f"invalid data set at {data_dir!r}: {err}. Check it with `python -m data_gen validate {data_dir}`"
            f" or delete it and {hint}"
        ) from err


def bench(data_dir: str, batch_size: int, workers: int, max_seq_len: int, batches: int) -> dict:
    """Iterate the training loader like a fit would (pinned memory on CUDA machines)."""
    dm = RankerData(data_dir, batch_size=batch_size, max_seq_len=max_seq_len, num_workers=workers)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    next(it)  # workers started, first batch in
    n = tokens = 0
    t0 = time.perf_counter()
    while n < batches:
        try:
            batch = next(it)
        except StopIteration:
            loader.sampler.set_epoch(loader.sampler.epoch + 1)
            it = iter(loader)
            continue
        n += 1
        tokens += batch["n_tokens"]
    dt = time.perf_counter() - t0
    return {"batches_per_s": n / dt, "examples_per_s": n * batch_size / dt, "tokens_per_s": tokens / dt}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.data", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="loader throughput on the training split (batches/s)")
    b.add_argument("--data", required=True, help="data directory (meta.json + splits)")
    b.add_argument("--batch-size", type=int, default=512)
    b.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    b.add_argument("--max-seq-len", type=int, default=256)
    b.add_argument("--batches", type=int, default=200, help="timed batches after the first")
    args = p.parse_args(argv)
    try:
        res = bench(args.data, args.batch_size, args.workers, args.max_seq_len, args.batches)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    print(
        f"loader bench: data={args.data} batch_size={args.batch_size} workers={args.workers} "
        f"max_seq_len={args.max_seq_len}\n"
        f"  {res['batches_per_s']:.1f} batches/s  {res['examples_per_s']:.0f} examples/s  "
        f"{res['tokens_per_s']:.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
