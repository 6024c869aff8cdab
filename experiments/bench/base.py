"""What every provider hands the runner, and the run's settings."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from experiments.bench.layouts import Jagged

OURS = "jagged"


@dataclass
class RunConfig:
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    modes: tuple[str, ...] = ("fwd", "fwd_bwd")
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    ours_backend: str = "triton"
    providers: frozenset[str] | None = None  # None: every provider
    max_shapes: int | None = None
    seed: int = 0
    flex_max_tokens: int = 300_000  # FlexAttention over packed tokens costs ~T^2 (memory and time)
    flex_budget_s: float = 120.0  # wall time FlexAttention (compiles included) may use per run
    deadline: float | None = None  # time.monotonic() after which remaining shapes are skipped
    graph_ms: bool = False  # also time every row as a CUDA-graph replay (the kernels alone): gpu_ms
    flex_spent_s: float = field(default=0.0)

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


@dataclass
class Prepared:
    """A provider's inputs in its own layout, and how to run it and read its output.

    fwd: runs the forward and returns the output (in the provider's layout).
    leaves: tensors whose gradients the backward computes (reset before each timed run).
    held: every tensor of the provider's input layout (counted in its peak memory).
    to_ref: maps an output to the layout of the reference ([T, H, D] for self-attention)."""

    fwd: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    held: list[torch.Tensor]
    to_ref: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Provider:
    name: str
    prepare: Callable[[Jagged, RunConfig], Prepared]
    skip: Callable[[Jagged, RunConfig], str | None] = lambda j, cfg: None
    backward: bool = True
    no_graph: str | None = None  # why its calls are never captured in a CUDA graph (--graph-ms)


def ceilings_of(row: dict, default: dict | None) -> dict:
    """The ceilings (copy bandwidth, matmul rate) measured in the row's own run, which rows merged
    from several result files carry (``report.merge_rows``), else `default`."""
    return row.get("ceilings") or default or {}


def op_kwargs(fn: Callable, n_positional: int, **kwargs) -> dict:
    """The keywords of `kwargs` that `fn` accepts and that its first positionals do not bind (so the
    harness follows the public signatures); computed once, outside the timed region."""
    params = inspect.signature(fn).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = set(positional[:n_positional])
    return {k: v for k, v in kwargs.items() if (accepts_any or k in params) and k not in taken}


def cuda_only(j: Jagged, cfg: RunConfig) -> str | None:
    return None if cfg.device.type == "cuda" else "unavailable (CUDA only)"


def varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_skip(j: Jagged, cfg: RunConfig) -> str | None:
    if varlen_fn() is None:
        return f"unavailable (torch {torch.__version__} has no varlen_attn)"
    return cuda_only(j, cfg)
