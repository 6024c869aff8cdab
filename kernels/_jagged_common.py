"""Helpers shared by the jagged feature-interaction ops (conversions, softmax, bmm, elementwise).

Nothing here imports Triton, so the CPU path works on machines without it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch

from kernels._dispatch import resolve_backend

_poison_outputs = os.environ.get("JAGGED_POISON_OUTPUTS", "0") not in ("", "0", "false", "False")


def set_poison_outputs(enabled: bool) -> None:
    """Tests only: Triton launchers fill their outputs with NaN before the kernel writes them."""
    global _poison_outputs
    _poison_outputs = bool(enabled)


def new_output(shape: tuple[int, ...], like: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialised output for a kernel that writes every element (NaN-poisoned under tests);
    on `like`'s device, in `dtype` (default: `like`'s)."""
    if _poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype or like.dtype, device=like.device)
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device; make it the tensors' device (a no-op context
    # when it already is, the usual case: entering torch.cuda.device costs a few microseconds).
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_GUARD


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """References compute in fp32 (fp64 stays fp64, for gradcheck) and cast back."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pick_backend(backend: str, t: torch.Tensor) -> str:
    """resolve_backend plus the dtype rule: the Triton kernels take fp32, bf16 and fp16 only."""
    resolved = resolve_backend(backend, t.device)
    if resolved == "triton" and t.dtype == torch.float64:
        if backend == "auto":
            return "torch"
        raise TypeError("backend='triton' supports float32, bfloat16 and float16; use 'torch' for float64")
    return resolved


def eager_triton(resolved: str) -> bool:
    """True where a public op may call its Triton launchers through a plain autograd.Function
    (tens of microseconds less host time per call than the custom op's dispatch): the Triton
    backend, in eager mode. torch.compile and functorch transforms go through the custom ops."""
    return (resolved == "triton" and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active())


def needs_grad(*ts: torch.Tensor | None) -> bool:
    """Whether autograd would record an op on these inputs (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def autocast_lowp(*ts: torch.Tensor | None) -> tuple:
    """Under autocast on the first tensor's device (CPU or CUDA), every float input but float64
    in the autocast dtype: what the "lowp" autocast rule does to a custom op's inputs, for the
    paths that call the launchers directly. None entries pass through."""
    dev = ts[0].device.type
    if dev not in _AUTOCAST_KEYS or not torch.is_autocast_enabled(dev):
        return ts
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in ts)


def register_no_double_backward(bwd_op, public_name: str) -> None:
    """Autograd for a backward custom op whose own derivative is not written (the attention
    kernels' backwards): differentiating through its result raises a clear error at the second
    backward, instead of the gradient silently leaving the graph. Its last input is the backend."""

    def setup_context(ctx, inputs, output):
        ctx.backend = inputs[-1]

    def backward(ctx, *grads):
        raise RuntimeError(
            f"{public_name}: double backward (a gradient of its gradient, e.g. through "
            f"torch.autograd.grad(..., create_graph=True)) is not supported with "
            f"backend={ctx.backend!r}; use backend='torch', whose backward is differentiable"
        )

    bwd_op.register_autograd(backward, setup_context=setup_context)


# ---- autocast -----------------------------------------------------------------------------
# torch.library.register_autocast fixes the cast dtype at registration; these kernels read it
# from the active autocast region, like torch's own matmul ("lower_precision_fp") and
# cat/stack ("promote") policies.

_AUTOCAST_LIB = torch.library.Library("jagged", "FRAGMENT")
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _autocast_kernel(op: Callable, device_type: str, policy: str) -> Callable:
    def eligible(a: object) -> bool:
        return isinstance(a, torch.Tensor) and a.is_floating_point() and a.device.type == device_type

    def kernel(*args, **kwargs):
        floats = [a for a in args if eligible(a)]
        if policy == "lowp":
            target = torch.get_autocast_dtype(device_type)
            floats = [a for a in floats if a.dtype != torch.float64]
        else:  # "promote": every floating input to the widest floating dtype among them
            target = floats[0].dtype if floats else None
            for a in floats[1:]:
                target = torch.promote_types(target, a.dtype)
        cast = [a.to(target) if any(a is f for f in floats) else a for a in args]
        with torch.autocast(device_type, enabled=False):
            return op(*cast, **kwargs)

    return kernel


def register_autocast(name: str, policy: str) -> None:
    """Autocast rule for `jagged::<name>` on CPU and CUDA: policy "lowp" or "promote"."""
    if policy not in ("lowp", "promote"):
        raise ValueError(f"unknown autocast policy {policy!r}")
    op = getattr(torch.ops.jagged, name).default
    for device_type, key in _AUTOCAST_KEYS.items():
        _AUTOCAST_LIB.impl(name, _autocast_kernel(op, device_type, policy), key)
