"""User embeddings learned offline from long histories, served a little stale to the ranker.

    python -m pipeline.user_embeddings fit --data data/timeline [--cutoff-day D] [--max-seq-len 4096]
    python -m pipeline.user_embeddings export --data data/timeline --encoder ENCODER.pt --out FILE [--as-of all|DAY]

The system of ALURE (Meta, 2024): a Transformer-like encoder reads each user's long activity
sequence on its own schedule (daily) and the real-time ranker takes the result as a feature,
with a short online history of its own. Here:

- **Encoder** (:class:`UserEncoder`): the ranker's embeddings and self-attention blocks over the
  jagged history (our flash attention kernels; histories up to --max-seq-len items), a mean
  over the items, and a projection to --dim: the user embedding u.
- **Objective**: the click label of the user's own impressions, from u and the candidate
  (logit = MLP([u, c, u * c]), c the candidate's item embedding projected to dim). It asks u
  to hold exactly what the ranker needs from a history (which candidates this user clicks),
  needs no labels beyond those the ranker trains on, and the candidate term keeps u in the
  geometry of the item embeddings. Trained on the impressions of days before --cutoff-day
  (default: the first validation day, so no validation or test label is ever read).
- **Export**: an embedding "as of day d" encodes the newest history the logs hold before day d
  starts: the history of the user's last impression before d (the logs carry a user's events
  as the histories of their impressions). ``--as-of all`` (the daily schedule) writes one row
  per user and day with impressions, as of the next day; ``--as-of d`` writes every user's as
  of day d. The file and its manifest are described in :mod:`pipeline.user_features`.

Both commands log to MLflow (experiment ``user-embeddings``; export continues the encoder's
run): settings, the encoder's validation AUC, training examples/s and seconds per day of data,
export time per as-of day. Errors are one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlflow
import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from torch import nn

from data_gen.schema import DataValidationError, is_timeline, load_meta, read_split, sha256_file, split_days
from pipeline.runenv import device_name, git_commit
from models.attention import Histories
from models.layers import EncoderBlock, HistoryEmbedding, mlp
from pipeline.split_cache import SPLITS, load_split
from pipeline.errors import ConfigError, command
from pipeline.tracking import environment_tags, tracking_uri
from pipeline.user_features import write_embeddings

EXPERIMENT = "user-embeddings"
log = logging.getLogger(__name__)


@dataclass
class EncoderConfig:
    dim: int = 64  # the user embedding's width
    embed_dim: int = 64
    num_heads: int = 2
    num_layers: int = 2
    ffn_mult: int = 2
    num_age_buckets: int = 32
    max_seq_len: int = 4096  # the encoder reads up to this many most recent items


class UserEncoder(nn.Module):
    """History -> user embedding [B, dim]; with a candidate, the click logit it was trained on."""

    def __init__(self, cfg: EncoderConfig, *, vocab_size: int, n_actions: int, kernel_backend: str = "auto"):
        super().__init__()
        self.cfg, self.kernel_backend = cfg, kernel_backend
        d = cfg.embed_dim
        self.embed = HistoryEmbedding(vocab_size, n_actions, d, cfg.num_age_buckets)
        self.blocks = nn.ModuleList(EncoderBlock(d, cfg.num_heads, cfg.ffn_mult) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, cfg.dim)
        self.cand = nn.Linear(d, cfg.dim)
        self.head = mlp(3 * cfg.dim, [2 * cfg.dim])

    def encode(self, hist_item, hist_action, hist_age, offsets, max_seq_len: int) -> torch.Tensor:
        hist = Histories(offsets, max_seq_len, "jagged", self.kernel_backend)
        x = self.embed(hist_item, hist_action, hist_age)  # [T, D]
        for block in self.blocks:
            x = block(x, hist)
        x = self.norm(x)
        total = hist.pool(x.new_ones(x.shape[0], 1), x).squeeze(1)  # [B, D]
        mean = total / hist.lengths.clamp(min=1).to(total.dtype)[:, None]
        return self.out(mean)

    def forward(self, batch: dict) -> torch.Tensor:
        u = self.encode(batch["hist_item"], batch["hist_action"], batch["hist_age"], batch["offsets"],
                        batch["max_seq_len"])
        c = self.cand(self.embed.item(batch["cand_item"]))
        return self.head(torch.cat([u, c, u * c], dim=-1)).squeeze(-1).float()


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    return torch.device(name)


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _timeline_meta(data: str) -> dict:
    try:
        meta = load_meta(data)
    except DataValidationError as err:
        raise ConfigError(str(err)) from None
    if not is_timeline(meta):
        raise ConfigError(f"{data!r} is per-example data: user embeddings need a timeline data set "
                          "(python -m data_gen generate --preset timeline ...)")
    return meta


def _batches(rows: np.ndarray, batch_size: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    order = rows if rng is None else rng.permutation(rows)
    return [np.sort(order[i:i + batch_size]) for i in range(0, len(order), batch_size)]


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit(args) -> dict:
    meta = _timeline_meta(args.data)
    days = int(meta["config"]["days"])
    cutoff = args.cutoff_day or split_days(days)["val"][0]
    if not 2 <= cutoff <= days:
        raise ConfigError(f"--cutoff-day must be in [2, {days}] (train on the days before it), got {cutoff}")
    device = _device(args.device)
    cfg = EncoderConfig(dim=args.dim, embed_dim=args.embed_dim, num_heads=args.num_heads, num_layers=args.num_layers,
                        max_seq_len=args.max_seq_len)
    head_dim = cfg.embed_dim // cfg.num_heads
    if cfg.embed_dim % cfg.num_heads or head_dim % 8 or not 16 <= head_dim <= 256:
        raise ConfigError(f"--embed-dim / --num-heads ({cfg.embed_dim} / {cfg.num_heads}) must be a whole head "
                          "width, a multiple of 8 in [16, 256] (the attention kernels' head widths)")
    n_dense = int(meta["config"]["n_dense"])
    splits = {s: load_split(args.data, s, n_dense) for s in SPLITS}
    train = splits["train"]
    rows = np.flatnonzero(train.day < cutoff)
    if rows.size == 0:
        raise ConfigError(f"no training impressions before day {cutoff}")
    torch.manual_seed(args.seed)
    model = UserEncoder(cfg, vocab_size=int(meta["config"]["vocab_size"]), n_actions=int(meta["config"]["n_actions"]))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                            fused=device.type in ("cuda", "cpu") or None)
    rng = np.random.default_rng(args.seed)
    plan = [b for _ in range(args.epochs) for b in _batches(rows, args.batch_size, rng)]
    if args.max_steps:
        plan = plan[:args.max_steps]
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_name=f"encoder-L{cfg.max_seq_len}-d{cfg.dim}", tags={
            **environment_tags(), "data_digest": meta["digest"], "data_dir": str(Path(args.data).resolve())}) as run:
        mlflow.log_params({**asdict(cfg), "cutoff_day": cutoff, "batch_size": args.batch_size, "lr": args.lr,
                           "epochs": args.epochs, "steps": len(plan), "seed": args.seed, "device": device.type})
        print(f"encoder: {len(rows):,} impressions of days 1..{cutoff - 1}, {len(plan)} steps of {args.batch_size} "
              f"on {device.type}, histories up to {cfg.max_seq_len} items; MLflow run {run.info.run_id}", flush=True)
        model.train()
        seen = tokens = since = 0
        loss_sum = torch.zeros((), device=device)
        t0 = time.perf_counter()
        for step, idx in enumerate(plan, 1):
            batch = _to(train.gather(idx, cfg.max_seq_len), device)
            with _autocast(device):
                loss = F.binary_cross_entropy_with_logits(model(batch), batch["label"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()  # read (a sync) only on progress lines
            seen, tokens, since = seen + len(idx), tokens + batch["n_tokens"], since + 1
            if step % args.log_every == 0 or step == len(plan):
                mean, since = float(loss_sum) / since, 0
                loss_sum.zero_()
                print(f"  step {step}/{len(plan)}  loss {mean:.4f}  "
                      f"{seen / (time.perf_counter() - t0):,.0f} examples/s", flush=True)
                mlflow.log_metric("train/loss", mean, step=step)
        _sync(device)
        train_s = time.perf_counter() - t0
        val_auc = evaluate(model, splits["val"], cfg.max_seq_len, args.batch_size, device)
        days_trained = cutoff - 1
        results = {"val/auc": val_auc, "train/examples_per_s": seen / train_s, "train/tokens_per_s": tokens / train_s,
                   "train/seconds": train_s,
                   # one day of data: the impressions of an average training day, at the measured rate
                   "train/seconds_per_day": train_s / seen * len(rows) / days_trained,
                   "train/peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0}
        mlflow.log_metrics(results)
        out = Path(args.out or Path(args.data) / "user_embeddings" / f"encoder-L{cfg.max_seq_len}-d{cfg.dim}.pt")
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"config": asdict(cfg), "state_dict": model.state_dict(), "data_digest": meta["digest"],
                    "cutoff_day": cutoff, "run_id": run.info.run_id,
                    "vocab_size": int(meta["config"]["vocab_size"]), "n_actions": int(meta["config"]["n_actions"])},
                   out)
        mlflow.set_tag("encoder_path", str(out.resolve()))
        record = {"run_id": run.info.run_id, "device": device_name(device) if device.type == "cuda" else "CPU: " + device_name(device), "commit": git_commit(),
                  "data_digest": meta["digest"], "cutoff_day": cutoff, "days_trained": days_trained,
                  "impressions": int(len(rows)), "steps": len(plan), "config": asdict(cfg),
                  "batch_size": args.batch_size, "results": results}
        Path(f"{out}.json").write_text(json.dumps(record, indent=1) + "\n")  # the encoder's cost, for reports
    print(f"encoder: val AUC {val_auc:.4f} (day {cutoff} impressions: click from u and the candidate), "
          f"{results['train/examples_per_s']:,.0f} examples/s, {results['train/seconds_per_day']:.1f} s per day of "
          f"data; wrote {out}")
    return {**results, "path": str(out), "run_id": run.info.run_id}


@torch.no_grad()
def evaluate(model: UserEncoder, split, max_seq_len: int, batch_size: int, device: torch.device) -> float:
    from pipeline.metrics import AUC

    model.eval()
    auc = AUC().to(device)
    for idx in _batches(np.arange(split.num_rows), batch_size, None):
        batch = _to(split.gather(idx, max_seq_len), device)
        with _autocast(device):
            auc.update(model(batch), batch["label"])
    model.train()
    return float(auc.compute())


def _load_encoder(path: str, meta: dict, device: torch.device) -> tuple[UserEncoder, dict]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        cfg = EncoderConfig(**ckpt["config"])
    except FileNotFoundError:
        raise ConfigError(f"no encoder at {path!r}: train one with `python -m pipeline.user_embeddings fit`") from None
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"unreadable encoder checkpoint {path!r}: {err}") from None
    if ckpt["data_digest"] != meta["digest"]:
        raise ConfigError(f"the encoder {path!r} was trained on another data set (digest {ckpt['data_digest'][:12]}, "
                          f"this one {meta['digest'][:12]})")
    model = UserEncoder(cfg, vocab_size=ckpt["vocab_size"], n_actions=ckpt["n_actions"])
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval(), ckpt


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


@torch.no_grad()
def export(args) -> dict:
    meta = _timeline_meta(args.data)
    days = int(meta["config"]["days"])
    as_of = None if args.as_of == "all" else _as_of_day(args.as_of, days)
    device = _device(args.device)
    model, ckpt = _load_encoder(args.encoder, meta, device)
    n_dense = int(meta["config"]["n_dense"])
    splits, parts = {}, []
    for i, s in enumerate(SPLITS):
        splits[s] = load_split(args.data, s, n_dense)
        times = read_split(args.data, s, columns=["impression_time"]).column("impression_time").to_numpy()
        parts.append(pl.DataFrame({"split": np.full(len(times), i, np.int8), "row": np.arange(len(times)),
                                   "user_id": splits[s].user, "day": splits[s].day, "time": times}))
    picked = snapshots(pl.concat(parts), days, as_of)
    if picked.height == 0:
        raise ConfigError(f"no impressions before day {as_of}: nothing to export")
    length = model.cfg.max_seq_len
    table = np.empty((picked.height, model.cfg.dim), np.float32)
    t0, done = time.perf_counter(), 0
    for i, s in enumerate(SPLITS):
        rows = picked.filter(pl.col("split") == i)["row"].to_numpy()
        for lo in range(0, len(rows), args.batch_size):
            batch = _to(splits[s].gather(rows[lo:lo + args.batch_size], length), device)
            with _autocast(device):
                u = model.encode(batch["hist_item"], batch["hist_action"], batch["hist_age"], batch["offsets"], length)
            table[done:done + len(u)] = u.float().cpu().numpy()
            done += len(u)
    _sync(device)
    encode_s = time.perf_counter() - t0
    n_days = picked["as_of_day"].n_unique()
    results = {"export/rows": picked.height, "export/seconds": encode_s,
               "export/seconds_per_as_of_day": encode_s / max(n_days, 1), "export/histories_per_s": picked.height / encode_s}
    info = {"data_digest": meta["digest"], "as_of": args.as_of, "encoder_sha256": sha256_file(args.encoder),
            "encoder_run_id": ckpt["run_id"], "encoder_cutoff_day": ckpt["cutoff_day"],
            "encoder_max_seq_len": length, "device": device_name(device) if device.type == "cuda" else "CPU: " + device_name(device), "commit": git_commit(), "cost": results}
    manifest = write_embeddings(args.out, picked["user_id"].to_numpy(), picked["as_of_day"].to_numpy(),
                                picked["time"].to_numpy(), table, info)
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_id=ckpt["run_id"]):
        mlflow.log_metrics(results)
        mlflow.log_dict(manifest, f"export/{Path(args.out).name}.json")
    print(f"export: {picked.height:,} embeddings of {picked['user_id'].n_unique():,} users over {n_days} as-of days "
          f"in {encode_s:.1f} s ({results['export/seconds_per_as_of_day']:.2f} s per as-of day); wrote {args.out} "
          f"(sha256 {manifest['sha256'][:12]})")
    return {**results, "manifest": manifest}


def _as_of_day(text: str, days: int) -> int:
    try:
        day = int(text)
    except ValueError:
        raise ConfigError(f"--as-of must be 'all' or a day number, got {text!r}") from None
    if not 2 <= day <= days:
        raise ConfigError(f"--as-of must be in [2, {days}] (an embedding as of day d reads the days before d), got {day}")
    return day


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m pipeline.user_embeddings",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", allow_abbrev=False, help="train the user encoder on the days before a cut-off")
    f.add_argument("--data", required=True, help="a timeline data set (python -m data_gen generate --preset timeline)")
    f.add_argument("--out", default=None, help="encoder checkpoint (default DATA/user_embeddings/encoder-L<len>-d<dim>.pt)")
    f.add_argument("--cutoff-day", type=int, default=None, help="train on impressions of the days before it "
                   "(default: the first validation day)")
    f.add_argument("--max-seq-len", type=_positive, default=4096, help="most recent history items the encoder reads")
    f.add_argument("--dim", type=_positive, default=64, help="user embedding width")
    f.add_argument("--embed-dim", type=_positive, default=64)
    f.add_argument("--num-heads", type=_positive, default=2)
    f.add_argument("--num-layers", type=int, default=2)
    f.add_argument("--batch-size", type=_positive, default=256)
    f.add_argument("--lr", type=float, default=1e-3)
    f.add_argument("--epochs", type=_positive, default=1)
    f.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: the epochs)")
    f.add_argument("--log-every", type=_positive, default=100, help="steps between progress lines")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    e = sub.add_parser("export", allow_abbrev=False, help="write the embeddings as of each day (Parquet + manifest)")
    e.add_argument("--data", required=True, help="the timeline data set the encoder was trained on")
    e.add_argument("--encoder", required=True, help="checkpoint written by fit")
    e.add_argument("--out", required=True, help="the Parquet file (its manifest goes to OUT.json)")
    e.add_argument("--as-of", default="all", help="'all' (daily: one row per user and day with impressions, as of "
                   "the next day) or a day d (every user's embedding as of day d)")
    e.add_argument("--batch-size", type=_positive, default=512)
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return p


@command
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "fit":
        fit(args)
    else:
        export(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
