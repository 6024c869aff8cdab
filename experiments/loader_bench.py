"""Loader throughput: iterate the training loader as a fit would and count batches/s.

    python -m experiments loader-bench --data data/small [--batch-size 512] [--workers 2] [--max-seq-len 256]
"""

from __future__ import annotations

import os
import time

from experiments import parser
from pipeline.errors import command


def bench(data_dir: str, batch_size: int, workers: int, max_seq_len: int, batches: int) -> dict:
    """Iterate the training loader like a fit would (pinned memory on CUDA machines)."""
    from pipeline.data import RankerData  # Lightning: imported once the arguments are read

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


@command
def main(argv: list[str] | None = None) -> int:
    p = parser("loader-bench", __doc__)
    p.add_argument("--data", required=True, help="data directory (meta.json + splits)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=200, help="timed batches after the first")
    args = p.parse_args(argv)
    res = bench(args.data, args.batch_size, args.workers, args.max_seq_len, args.batches)
    print(f"loader bench: data={args.data} batch_size={args.batch_size} workers={args.workers} "
          f"max_seq_len={args.max_seq_len}\n  {res['batches_per_s']:.1f} batches/s  {res['examples_per_s']:.0f} "
          f"examples/s  {res['tokens_per_s']:.0f} tokens/s")
    return 0
