"""Helpers shared by every public op, and the one route each op's work takes.

Every op is an ``autograd.Function`` whose forward and backward call :func:`run`: eager, the
backend's implementation directly; while torch.compile or functorch traces, the op's custom ops
(``jagged::<op>_fwd``, ``..._bwd``). The public function calls :func:`apply`. No Triton here."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
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


def traced() -> bool:
    """torch.compile or a functorch transform is tracing: ops go through their custom ops (one
    opaque node each, with a fake implementation), not straight to their implementations."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def lazy(module: str, name: str) -> Callable:
    """`module.name`, imported at its first call (the Triton modules import triton, which a
    CPU machine may lack); looked up at every call, so a patched launcher is the one called."""

    def call(*args):
        found = sys.modules.get(module) or importlib.import_module(module)
        return getattr(found, name)(*args)

    return call


def run(op, impls: dict[str, Callable], *args):
    """The one place an op's forward or backward is computed: `args` end with the backend.
    Traced, the custom op `op` (its autocast rule casts); eager, ``impls[backend]`` itself,
    without the dispatcher's tens of microseconds; the torch backend's under autocast with
    autocast off inside (the public function has cast the inputs, as the op's rule would)."""
    if traced():
        return op(*args)
    backend, inputs = args[-1], args[:-1]
    if backend == "torch" and autocast_on(inputs[0]):  # torch ops inside; a Triton kernel is not autocast's
        with torch.autocast(inputs[0].device.type, enabled=False):
            return impls[backend](*inputs)
    return impls[backend](*inputs)


def apply(fn: type[torch.autograd.Function], *args):
    """``fn.apply(*args)`` where autograd would record it, else its forward alone (no graph
    node to build: the inference and no-grad calls)."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        if not traced():  # autograd's own entry point: Function.apply first binds the arguments to
            # forward's signature, for defaults these forwards lack (docs/tuning.md, "One route per op")
            return super(torch.autograd.Function, fn).apply(*args)
        # Dynamo refuses one tensor given twice (k is v): the second becomes a view of it
        args = tuple(a.view_as(a) if isinstance(a, torch.Tensor) and any(a is b for b in args[:i]) else a
                     for i, a in enumerate(args))
        return fn.apply(*args)
    return fn.forward(*args)


def autocast_on(t: torch.Tensor) -> bool:
    """Autocast is on for `t`'s device (CPU or CUDA)."""
    return t.device.type in _AUTOCAST_KEYS and torch.is_autocast_enabled(t.device.type)


def autocast_cast(policy: str, *ts: object) -> tuple:
    """The inputs as autocast `policy` ("lowp" or "promote") casts them under autocast on the
    first tensor's device; outside autocast, unchanged. Non-tensors (None) pass through."""
    if not autocast_on(ts[0]):
        return ts
    dev = ts[0].device.type
    floats = [t for t in ts if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == dev]
    if policy == "lowp":  # every float input but float64 in the autocast dtype, like torch.bmm
        target = torch.get_autocast_dtype(dev)
        floats = [t for t in floats if t.dtype != torch.float64]
    else:  # "promote": the widest floating dtype among them, like mixed-dtype add/mul
        target = floats[0].dtype if floats else None
        for t in floats[1:]:
            target = torch.promote_types(target, t.dtype)
    return tuple(t.to(target) if any(t is f for f in floats) else t for t in ts)


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
    def kernel(*args, **kwargs):
        cast = autocast_cast(policy, *args)
        with torch.autocast(device_type, enabled=False):
            return op(*cast, **kwargs)

    return kernel


def register_autocast(name: str, policy: str) -> None:
    """Autocast rule for `jagged::<name>` on CPU and CUDA: policy "lowp" or "promote"."""
    op = getattr(torch.ops.jagged, name).default
    for device_type, key in _AUTOCAST_KEYS.items():
        _AUTOCAST_LIB.impl(name, _autocast_kernel(op, device_type, policy), key)
