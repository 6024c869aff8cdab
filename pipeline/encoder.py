"""The user encoder's run on the ranker's rails: its LightningModule, its data module, fit and export.

``fit(args)`` trains :class:`models.user_encoder.UserEncoder` with a ``pl.Trainer`` in an MLflow
run (experiment ``user-embeddings``) and writes the encoder file and its cost (``<out>.json``);
``export(args)`` encodes each user's newest history as of each day (``trainer.predict``) into the
file :mod:`pipeline.user_features` reads. The command line is :mod:`pipeline.user_embeddings`."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import mlflow
import numpy as np
import polars as pl
import pytorch_lightning as lightning
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from data_gen.schema import is_timeline, read_split, sha256_file, split_days
from models.user_encoder import EncoderConfig, UserEncoder
from pipeline.batches import BatchDataset, EpochBatchSampler
from pipeline.data import RankerData
from pipeline.errors import ConfigError, check_writable
from pipeline.metrics import AUC
from pipeline.signals import StopOnSignal
from pipeline.split_cache import SPLITS
from pipeline.runenv import device_name, git_commit
from pipeline.resume import read_torch_file
from pipeline.tracking import (MLflowRun, RunLogger, check_tracking, end_run, environment_tags, first_line,
                               tracking_uri, use_experiment)
from pipeline.user_features import write_embeddings

EXPERIMENT = "user-embeddings"
_ENCODER_KEYS = ("config", "state_dict", "data_digest", "cutoff_day", "run_id", "vocab_size", "n_actions")
# the batches are one vectorised gather each, made in the training process (as the ranker's on the CPU)
warnings.filterwarnings("ignore", message=r".*does not have many workers.*")


class _Rows(BatchDataset):
    """Whole batches of the rows `rows` of a split: item idx -> the batch of rows[idx]."""

    def __init__(self, split, max_seq_len: int, rows: np.ndarray):
        super().__init__(split, max_seq_len)
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: np.ndarray) -> dict:
        return super().__getitem__(self.rows[idx])


def _loader(split, rows: np.ndarray, batch_size: int, max_seq_len: int, shuffle: bool, seed: int = 0) -> DataLoader:
    sampler = EpochBatchSampler(len(rows), batch_size, shuffle=shuffle, drop_last=False, seed=seed)
    return DataLoader(_Rows(split, max_seq_len, rows), sampler=sampler, batch_size=None,
                      pin_memory=torch.cuda.is_available())


class EncoderData(RankerData):
    """The ranker's data module (same validation, cache and evaluation batches) over a timeline data
    set, training on the impressions of the days before ``cutoff_day`` (default: the first validation day)."""

    def __init__(self, data_dir: str, cutoff_day: int | None = None, **kwargs):
        super().__init__(data_dir, num_workers=0, **kwargs)
        if not is_timeline(self.meta):
            raise ConfigError(f"{data_dir!r} is per-example data: user embeddings need a timeline data set "
                              "(python -m data_gen generate --preset timeline ...)")
        self.days = int(self.meta["config"]["days"])
        first_val, self.val_day = split_days(self.days)["val"]  # validation is this day whatever the cut-off
        self.cutoff_day = first_val if cutoff_day is None else cutoff_day
        if not 2 <= self.cutoff_day <= first_val:  # training reads the training split: the days before first_val
            raise ConfigError(f"--cutoff-day must be in [2, {first_val}] (train on the days before it; the days "
                              f"from {first_val} on are validation and test), got {self.cutoff_day}")

    def split(self, name: str):
        return self._splits[name]

    def train_rows(self) -> np.ndarray:
        return np.flatnonzero(self.split("train").day < self.cutoff_day)

    def train_dataloader(self) -> DataLoader:
        return _loader(self.split("train"), self.train_rows(), self.batch_size, self.max_seq_len, True, self.seed)


class EncoderModule(lightning.LightningModule):
    """The encoder, its loss (BCE of the click logit from u and the candidate), AdamW and val/auc.
    Prints a progress line and logs ``train/loss`` (the mean since the last line) every `log_every` steps."""

    def __init__(self, encoder: UserEncoder, lr: float = 1e-3, steps: int = 0, log_every: int = 100):
        super().__init__()
        self.encoder, self.lr, self.steps, self.log_every = encoder, lr, steps, log_every
        self.val_auc = AUC()
        self.seen = self.tokens = self._since = 0
        self.train_s = 0.0

    def on_train_start(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device)
        self._t0 = time.perf_counter()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self.encoder(batch), batch["label"])
        self._loss_sum += loss.detach()  # read (a sync) only on progress lines
        self.seen, self.tokens = self.seen + len(batch["label"]), self.tokens + batch["n_tokens"]
        self._since += 1
        step = self.global_step + 1
        if step % self.log_every == 0 or step == self.steps:
            mean, self._since = float(self._loss_sum) / self._since, 0
            self._loss_sum.zero_()
            print(f"  step {step}/{self.steps}  loss {mean:.4f}  "
                  f"{self.seen / (time.perf_counter() - self._t0):,.0f} examples/s", flush=True)
            self.logger.log_metrics({"train/loss": mean}, step=step)
        return loss

    def on_train_end(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.train_s = time.perf_counter() - self._t0

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.val_auc.update(self.encoder(batch), batch["label"])

    def on_validation_epoch_end(self) -> None:
        self.log("val/auc", self.val_auc.compute(), logger=False)  # fit logs it with the training cost
        self.val_auc.reset()

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.encoder.encode(batch["hist_item"], batch["hist_action"], batch["hist_age"], batch["offsets"],
                                   batch["max_seq_len"]).float().cpu()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01,
                                 fused=self.device.type in ("cuda", "cpu") or None)


def _trainer(device: str, callbacks=(), **kwargs) -> lightning.Trainer:
    """One device, bf16 autocast on a GPU and fp32 on the CPU, no checkpoints (the encoder file is written by fit)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return lightning.Trainer(accelerator="gpu" if cuda else "cpu", devices=1,
                             precision="bf16-mixed" if cuda else "32-true",
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[*callbacks, StopOnSignal()], **kwargs)


def _device(trainer: lightning.Trainer) -> str:
    device = trainer.strategy.root_device
    return device_name(device) if device.type == "cuda" else "CPU: " + device_name(device)


def _config(args) -> EncoderConfig:
    cfg = EncoderConfig(dim=args.dim, embed_dim=args.embed_dim, num_heads=args.num_heads, num_layers=args.num_layers,
                        max_seq_len=args.max_seq_len)
    head_dim = cfg.embed_dim // cfg.num_heads
    if cfg.embed_dim % cfg.num_heads or head_dim % 8 or not 16 <= head_dim <= 256:
        raise ConfigError(f"--embed-dim / --num-heads ({cfg.embed_dim} / {cfg.num_heads}) must be a whole head "
                          "width, a multiple of 8 in [16, 256] (the attention kernels' head widths)")
    return cfg


def fit(args) -> dict:
    """``python -m pipeline.user_embeddings fit``: train, validate once, write the encoder and its cost."""
    data = EncoderData(args.data, args.cutoff_day, batch_size=args.batch_size, max_seq_len=args.max_seq_len,
                       seed=args.seed)
    cfg = _config(args)
    out = Path(args.out or Path(args.data) / "user_embeddings" / f"encoder-L{cfg.max_seq_len}-d{cfg.dim}.pt")
    check_tracking(tracking_uri())
    check_writable("--out", str(out.parent))
    data.load_splits("fit")
    rows, cutoff = data.train_rows(), data.cutoff_day
    if rows.size == 0:
        raise ConfigError(f"no training impressions before day {cutoff}")
    steps = args.epochs * -(-rows.size // args.batch_size)
    steps = min(steps, args.max_steps) if args.max_steps else steps
    torch.manual_seed(args.seed)
    spec = data.spec
    module = EncoderModule(UserEncoder(cfg, vocab_size=spec["vocab_size"], n_actions=spec["n_actions"]), lr=args.lr,
                           steps=steps, log_every=args.log_every)
    run = MLflowRun(experiment_name=EXPERIMENT, run_name=f"encoder-L{cfg.max_seq_len}-d{cfg.dim}", system_metrics=False)
    run_id = run.start({**environment_tags(), "data_digest": spec["digest"],
                        "data_dir": str(Path(args.data).resolve())})
    trainer = _trainer(args.device, max_epochs=args.epochs, max_steps=args.max_steps or -1, callbacks=[run],
                       logger=RunLogger(experiment_name=EXPERIMENT, tracking_uri=tracking_uri(), run_id=run_id),
                       log_every_n_steps=1)  # the module logs train/loss itself, every --log-every steps
    device = trainer.strategy.root_device
    mlflow.log_params({**asdict(cfg), "cutoff_day": cutoff, "batch_size": args.batch_size, "lr": args.lr,
                       "epochs": args.epochs, "steps": steps, "seed": args.seed, "device": device.type,
                       "val_day": data.val_day})
    print(f"encoder: {len(rows):,} impressions of days 1..{cutoff - 1}, {steps} steps of {args.batch_size} "
          f"on {device.type}, histories up to {cfg.max_seq_len} items; MLflow run {run_id}", flush=True)
    with warnings.catch_warnings():  # validation comes once, after training (below)
        warnings.filterwarnings("ignore", message=r".*defined a `validation_step` but have no `val_dataloader`.*")
        trainer.fit(module, train_dataloaders=data.train_dataloader())
    trainer.validate(module, dataloaders=data.val_dataloader(), verbose=False)
    val_auc = float(trainer.callback_metrics["val/auc"])
    train_s, days_trained, val_day = module.train_s, cutoff - 1, data.val_day
    results = {"val/auc": val_auc, "train/examples_per_s": module.seen / train_s,
               "train/tokens_per_s": module.tokens / train_s, "train/seconds": train_s,
               # one day of data: the impressions of an average training day, at the measured rate
               "train/seconds_per_day": train_s / module.seen * len(rows) / days_trained,
               "train/peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0}
    mlflow.log_metrics(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": asdict(cfg), "state_dict": module.encoder.state_dict(), "data_digest": spec["digest"],
                "cutoff_day": cutoff, "run_id": run_id, "vocab_size": spec["vocab_size"],
                "n_actions": spec["n_actions"]}, out)
    mlflow.set_tag("encoder_path", str(out.resolve()))
    record = {"run_id": run_id, "device": _device(trainer), "commit": git_commit(), "data_digest": spec["digest"],
              "cutoff_day": cutoff, "days_trained": days_trained, "val_day": val_day, "impressions": int(len(rows)),
              "steps": trainer.global_step, "config": asdict(cfg), "batch_size": args.batch_size, "results": results}
    Path(f"{out}.json").write_text(json.dumps(record, indent=1) + "\n")  # the encoder's cost, for reports
    end_run("FINISHED")
    print(f"encoder: val AUC {val_auc:.4f} (day {val_day} impressions: click from u and the candidate), "
          f"{results['train/examples_per_s']:,.0f} examples/s, {results['train/seconds_per_day']:.1f} s per day of "
          f"data; wrote {out}")
    return {**results, "path": str(out), "run_id": run_id}


def _load_encoder(path: str, data_digest: str) -> tuple[UserEncoder, dict]:
    where = f"--encoder {path}"
    if not Path(path).is_file():
        raise ConfigError(f"no encoder at {path!r}: train one with `python -m pipeline.user_embeddings fit`")
    what = "an encoder written by `pipeline.user_embeddings fit`"
    ckpt = read_torch_file(path, where, "encoder file", what)
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in _ENCODER_KEYS):
        raise ConfigError(f"{where}: not {what} (it lacks one of {', '.join(_ENCODER_KEYS)})")
    try:
        encoder = UserEncoder(EncoderConfig(**ckpt["config"]), vocab_size=ckpt["vocab_size"], n_actions=ckpt["n_actions"])
        encoder.load_state_dict(ckpt["state_dict"])
    except (TypeError, ValueError, RuntimeError) as err:  # settings or weights of another encoder
        raise ConfigError(f"{where}: not {what} ({type(err).__name__}: {first_line(err)})") from None
    if ckpt["data_digest"] != data_digest:
        raise ConfigError(f"the encoder {path!r} was trained on another data set (digest {str(ckpt['data_digest'])[:12]}, "
                          f"this one {data_digest[:12]})")
    return encoder.eval(), ckpt


def snapshots(frame: pl.DataFrame, days: int, as_of: int | None) -> pl.DataFrame:
    """The impressions whose histories are encoded, with the as-of day each serves.

    frame: one row per impression (split, row, user_id, day, time). as_of None: per user and day
    with impressions, the last one, serving as of the next day (days + 1 never: no impression
    reads it); as_of d: per user, the last impression before day d, serving as of d."""
    if as_of is None:
        picked = frame.filter(pl.col("day") < days).sort("time").group_by(["user_id", "day"]).last()
        picked = picked.with_columns((pl.col("day") + 1).alias("as_of_day"))
    else:
        picked = frame.filter(pl.col("day") < as_of).sort("time").group_by("user_id").last()
        picked = picked.with_columns(pl.lit(as_of, dtype=pl.Int32).alias("as_of_day"))
    return picked.sort(["split", "row"])


def _as_of_day(text: str, days: int) -> int:
    try:
        day = int(text)
    except ValueError:
        raise ConfigError(f"--as-of must be 'all' or a day number, got {text!r}") from None
    if not 2 <= day <= days:
        raise ConfigError(f"--as-of must be in [2, {days}] (an embedding as of day d reads the days before d), "
                          f"got {day}")
    return day


def export(args) -> dict:
    """``python -m pipeline.user_embeddings export``: the embeddings as of each day (or one day)."""
    data = EncoderData(args.data, batch_size=args.batch_size)
    as_of = None if args.as_of == "all" else _as_of_day(args.as_of, data.days)
    encoder, ckpt = _load_encoder(args.encoder, data.spec["digest"])
    check_tracking(tracking_uri())
    data.load_splits("fit")  # all three
    parts = []
    for i, s in enumerate(SPLITS):
        times = read_split(args.data, s, columns=["impression_time"]).column("impression_time").to_numpy()
        parts.append(pl.DataFrame({"split": np.full(len(times), i, np.int8), "row": np.arange(len(times)),
                                   "user_id": data.split(s).user, "day": data.split(s).day, "time": times}))
    picked = snapshots(pl.concat(parts), data.days, as_of)
    if picked.height == 0:
        raise ConfigError(f"no impressions before day {as_of}: nothing to export")
    length, module, trainer = encoder.cfg.max_seq_len, EncoderModule(encoder), _trainer(args.device, logger=False)
    t0, table = time.perf_counter(), []
    for i, s in enumerate(SPLITS):
        rows = picked.filter(pl.col("split") == i)["row"].to_numpy()
        if len(rows):
            table += trainer.predict(module, _loader(data.split(s), rows, args.batch_size, length, shuffle=False))
    encode_s = time.perf_counter() - t0
    n_days = picked["as_of_day"].n_unique()
    results = {"export/rows": picked.height, "export/seconds": encode_s,
               "export/seconds_per_as_of_day": encode_s / max(n_days, 1),
               "export/histories_per_s": picked.height / encode_s}
    info = {"data_digest": data.spec["digest"], "as_of": args.as_of, "encoder_sha256": sha256_file(args.encoder),
            "encoder_run_id": ckpt["run_id"], "encoder_cutoff_day": ckpt["cutoff_day"],
            "encoder_max_seq_len": length, "device": _device(trainer), "commit": git_commit(), "cost": results}
    manifest = write_embeddings(args.out, picked["user_id"].to_numpy(), picked["as_of_day"].to_numpy(),
                                picked["time"].to_numpy(), torch.cat(table).numpy(), info)
    mlflow.set_tracking_uri(tracking_uri())
    use_experiment(EXPERIMENT)
    with mlflow.start_run(run_id=ckpt["run_id"]):
        mlflow.log_metrics(results)
        mlflow.log_dict(manifest, f"export/{Path(args.out).name}.json")
    print(f"export: {picked.height:,} embeddings of {picked['user_id'].n_unique():,} users over {n_days} as-of days "
          f"in {encode_s:.1f} s ({results['export/seconds_per_as_of_day']:.2f} s per as-of day); wrote {args.out} "
          f"(sha256 {manifest['sha256'][:12]})")
    return {**results, "manifest": manifest}
