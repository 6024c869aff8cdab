"""How evenly the distributed sampler spreads tokens over the ranks, on a real data set.

    python -m experiments balance --data data/paper --batch-size 512 --max-seq-len 1024 \
        --world-sizes 2 4 8 --out experiments/results/ddp/cpu/token-balance-paper.md

Every global batch of one epoch split by :func:`pipeline.batches.balance_ranks` against W
consecutive slices of rows; per batch the most tokens of a rank over the mean (docs/experiments.md)."""

from __future__ import annotations

import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from experiments import parser
from data_gen.schema import load_meta
from pipeline.batches import EpochBatchSampler, balance_ranks
from pipeline.split_cache import load_split
from pipeline.runenv import git_commit


def rank_tokens(lengths: np.ndarray, batch_size: int, world: int, seed: int, epoch: int) -> dict[str, np.ndarray]:
    """Tokens per rank of every global batch of an epoch: {"balanced": [G, W], "by rows": [G, W]}."""
    sampler = EpochBatchSampler(len(lengths), batch_size, shuffle=True, drop_last=True, seed=seed,
                                lengths=lengths, world_size=world)
    G = len(sampler)
    rows = sampler.order(epoch)[: G * world * batch_size].reshape(G, world * batch_size)
    tokens = lengths[rows]  # [G, W * B]
    ranks = balance_ranks(tokens, world)
    flat = (np.arange(G)[:, None] * world + ranks).ravel()
    balanced = np.bincount(flat, weights=tokens.ravel(), minlength=G * world).reshape(G, world)
    return {"balanced": balanced, "by rows": tokens.reshape(G, world, batch_size).sum(axis=2).astype(float)}


def summary(loads: np.ndarray) -> dict[str, float]:
    """Statistics over global batches of max/mean tokens per rank (loads [G, W])."""
    ratio = loads.max(axis=1) / np.maximum(loads.mean(axis=1), 1.0)
    return {"mean": float(ratio.mean()), "p99": float(np.percentile(ratio, 99)), "worst": float(ratio.max()),
            "spread": float((loads.max(axis=1) - loads.min(axis=1)).max()),
            "efficiency": float((loads.mean(axis=1) / np.maximum(loads.max(axis=1), 1.0)).mean())}


def report(data_dir: str, batch_size: int, max_seq_len: int, worlds: list[int], seed: int, command: str) -> str:
    meta = load_meta(data_dir)
    lengths = load_split(data_dir, "train", int(meta["config"]["n_dense"]), cache=True).lengths(max_seq_len)
    lines = ["| world size | global batches | split | max/mean mean | p99 | worst | largest spread (tokens) "
             "| mean/max (efficiency bound) | split time per epoch |", "|" + " --- |" * 9]
    for world in worlds:
        t0 = time.perf_counter()
        loads = rank_tokens(lengths, batch_size, world, seed, epoch=0)
        seconds = time.perf_counter() - t0
        for name, per_rank in loads.items():
            if len(per_rank) == 0:
                lines.append(f"| {world} | 0 | {name} | fewer rows than one global batch |" + " - |" * 5)
                continue
            s = summary(per_rank)
            took = f"{seconds:.2f} s" if name == "balanced" else "-"
            lines.append(f"| {world} | {len(per_rank)} | {name} | {s['mean']:.5f} | {s['p99']:.5f} | {s['worst']:.5f} "
                         f"| {s['spread']:.0f} | {s['efficiency']:.4f} | {took} |")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        "# Token balance of the distributed sampler (CPU)", "",
        f"Data `{data_dir}` (digest {str(meta['digest'])[:16]}), training split ({len(lengths):,} rows, mean "
        f"{lengths.mean():.1f} items after truncation to max_seq_len {max_seq_len}), batch {batch_size} per rank, "
        f"epoch 0, seed {seed}; commit {git_commit()}, {stamp}.", "",
        "Per global batch: the most tokens any rank gets / the mean over ranks. `balanced` is the sampler "
        "(greedy longest-first into the rank with the fewest tokens among those with room); `by rows` cuts "
        "the same global batch into consecutive slices of batch_size rows. The split time is the sampler's "
        "work for a whole epoch (done once per epoch).", "",
        *lines, "",
        "    " + command, ""])


def main(argv: list[str] | None = None) -> None:
    p = parser("balance", __doc__)
    p.add_argument("--data", required=True, help="data directory (meta.json + splits)")
    p.add_argument("--batch-size", type=int, default=512, help="rows per rank and step")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the table here (markdown) as well as to stdout")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    command = shlex.join(["python", "-m", "experiments", "balance", *argv])
    text = report(args.data, args.batch_size, args.max_seq_len, args.world_sizes, args.seed, command)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)

