"""Embedding gradients across processes: bytes sent, peak memory and step time of the three
``model.embedding_grad`` modes (dense, sparse, densify) on Gloo, CPU processes.

    python -m experiments ddp-bench --worlds 2 4 --out experiments/results    # a few minutes

Writes OUT/ddp/cpu/ddp-bench.{md,json} and two plots. What a step is, the points and what is
measured (and the crossover it predicts): docs/experiments.md, "DDP measurements".
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments import parser
from data_gen.config import resolve_config
from data_gen.lengths import build_length_model
from data_gen.world import zipf_probs
from pipeline.dist import gloo_worker
from pipeline.gradsync import EMBEDDING_GRADS, GradSync
from pipeline.optim import build_optimizer

PRESETS = {"tiny": (20_000, 32, 64, 32), "small": (100_000, 32, 256, 64), "paper": (1_000_000, 128, 512, 1024)}
FRACTIONS = (0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0)
SWEEP_TABLE = PRESETS["small"][:2]


def points(fractions=FRACTIONS) -> list[dict]:
    """Every measured configuration: the presets' points, then the sweep over fractions."""
    out = [{"kind": "preset", "name": name, "vocab": v, "dim": d, "batch": b, "max_seq_len": L}
           for name, (v, d, b, L) in PRESETS.items()]
    out += [{"kind": "sweep", "name": f"f={f:g}", "vocab": SWEEP_TABLE[0], "dim": SWEEP_TABLE[1], "fraction": f}
            for f in fractions]
    return out


class Lookups:
    """The ids one process looks up at each step of one point (deterministic per rank, step)."""

    def __init__(self, point: dict, rank: int):
        self.point, self.rank = point, rank
        if point["kind"] == "preset":
            self.lengths = build_length_model(resolve_config(point["name"]))
            cdf = np.cumsum(zipf_probs(point["vocab"], 1.0))
            self.cdf = cdf / cdf[-1]
            self.perm = np.random.default_rng(0).permutation(point["vocab"])  # popular ids scattered

    def __call__(self, step: int) -> torch.Tensor:
        p, rng = self.point, np.random.default_rng([self.rank, step, 17])
        if p["kind"] == "sweep":
            return torch.from_numpy(rng.choice(p["vocab"], int(p["fraction"] * p["vocab"]), replace=False))
        lengths = np.minimum(self.lengths.sample(rng, p["batch"]), p["max_seq_len"])
        n = int(lengths.sum()) + p["batch"]  # the history items and one candidate per example
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(n)), p["vocab"] - 1)
        return torch.from_numpy(self.perm[ranks])


def _proc_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _wchar() -> int:
    return int(re.search(r"wchar: (\d+)", Path("/proc/self/io").read_text()).group(1))


def measure(point: dict, mode: str, rank: int, steps: int, warmup: int) -> dict:
    """One process's medians over `steps` timed steps (after `warmup`) of one point and mode."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(point["vocab"], point["dim"], sparse=mode != "dense")
    head = torch.nn.Parameter(torch.randn(point["dim"]) / point["dim"] ** 0.5)
    params = [table.weight, head]
    opt = build_optimizer("sgd", params, table.weight, lr=0.01, weight_decay=0.0, betas=(0.9, 0.98), fused=None)
    sync = GradSync(mode, table.weight, params, manual_table=True)
    lookups = Lookups(point, rank)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory starts again here
    base = _proc_kib("VmRSS")
    rows = []
    for step in range(warmup + steps):
        ids = lookups(step)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        (table(ids) @ head).square().mean().backward()
        t1, w0, predicted = time.perf_counter(), _wchar(), sync.sent_bytes
        sync(all_grads=True)
        t2, w1 = time.perf_counter(), _wchar()
        opt.step()
        t3 = time.perf_counter()
        rows.append((t3 - t0, t2 - t1, w1 - w0, sync.sent_bytes - predicted, ids.unique().numel()))
    r = np.array(rows[warmup:], dtype=np.float64)
    return {"step_ms": 1e3 * np.median(r[:, 0]), "sync_ms": 1e3 * np.median(r[:, 1]),
            "sent_measured": float(np.median(r[:, 2])), "sent_predicted": float(np.median(r[:, 3])),
            "touched": float(r[:, 4].mean() / point["vocab"]), "peak_mb": (_proc_kib("VmHWM") - base) / 1024}


def _worker(rank: int, world: int, store: str, todo: list[dict], steps: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_worker(rank, world, store):
        for point in todo:
            for mode in EMBEDDING_GRADS:
                mine = measure(point, mode, rank, steps, warmup)
                every = [None] * world
                dist.all_gather_object(every, mine)
                if rank == 0:
                    with open(out, "a") as f:
                        f.write(json.dumps({**point, "mode": mode, "world": world, **combine(every)}) + "\n")


def combine(ranks: list[dict]) -> dict:
    """One row from every process's: the slowest step, the mean bytes, the largest memory."""
    return {"step_ms": max(r["step_ms"] for r in ranks), "sync_ms": max(r["sync_ms"] for r in ranks),
            "sent_measured": float(np.mean([r["sent_measured"] for r in ranks])),
            "sent_predicted": float(np.mean([r["sent_predicted"] for r in ranks])),
            "touched": float(np.mean([r["touched"] for r in ranks])), "peak_mb": max(r["peak_mb"] for r in ranks)}


def run(worlds: list[int], steps: int, warmup: int, todo: list[dict]) -> list[dict]:
    """Measure every point for each world size (one set of processes per world size)."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.jsonl"
        for world in worlds:
            t0 = time.perf_counter()
            store = str(Path(tmp) / f"rendezvous-{world}")
            mp.start_processes(_worker, args=(world, store, todo, steps, warmup, str(rows)), nprocs=world,
                               start_method="spawn")
            print(f"world size {world}: {time.perf_counter() - t0:.0f} s", flush=True)
        return [json.loads(line) for line in rows.read_text().splitlines()]


def main(argv: list[str] | None = None) -> None:
    p = parser("ddp-bench", __doc__)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="numbers of processes")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point and mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--presets", nargs="*", default=list(PRESETS), help="which preset points (none: only the sweep)")
    p.add_argument("--fractions", type=float, nargs="*", default=list(FRACTIONS), help="the sweep's fractions")
    p.add_argument("--out", default="runs", help="results root of OUT/ddp/cpu/")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    from experiments.ddp_report import write_report  # matplotlib only where the report is written

    todo = [pt for pt in points(args.fractions) if pt["kind"] == "sweep" or pt["name"] in args.presets]
    out = Path(args.out) / "ddp" / "cpu"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = run(args.worlds, args.steps, args.warmup, todo)
    command = shlex.join(["python", "-m", "experiments", "ddp-bench", *argv])
    print(write_report(rows, out, command, time.perf_counter() - t0))

