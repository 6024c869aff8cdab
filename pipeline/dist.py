"""The few torch.distributed calls the pipeline makes itself, each a no-op in one process.

Lightning's DDP strategy starts the processes and the process group; these helpers read it.
:func:`launch_rank_zero` tells global rank 0 from the environment before any trainer exists
(docs/training.md#several-processes-ddp)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def launch_rank_zero() -> bool:
    """True in the process that will be global rank 0 (or that runs alone), from the environment."""
    if "RANK" in os.environ:  # torchrun and similar launchers
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("NODE_RANK", 0)) == 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0


def world_size() -> int:
    """Processes in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def all_reduce(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`values` reduced over every process, in place (`op`: sum, max or min); unchanged alone."""
    if world_size() > 1:
        dist.all_reduce(values, op=_OPS[op])
    return values


def all_gather(values: torch.Tensor) -> torch.Tensor:
    """[world size, *values.shape]: every process's `values` (same shape on every process)."""
    if world_size() == 1:
        return values[None]
    out = [torch.empty_like(values) for _ in range(world_size())]
    dist.all_gather(out, values.contiguous())
    return torch.stack(out)


@contextmanager
def gloo_worker(rank: int, world: int, rendezvous: str) -> Iterator[None]:
    """The process group of one process started by ``torch.multiprocessing`` (Gloo, rendezvous
    through the file `rendezvous`). On success the process ends inside the block, without
    interpreter finalization (a Gloo thread could abort it then: docs/training.md)."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
