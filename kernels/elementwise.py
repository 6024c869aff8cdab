"""jagged_dense_elementwise_add / _mul: combine a jagged tensor with a padded dense one.

Layers (DESIGN.md): torch references (forward and backward), Triton kernels in
``kernels._elementwise_triton``, custom ops ``jagged::jagged_dense_elementwise_add``,
``jagged::jagged_dense_elementwise_mul`` and ``jagged::jagged_dense_elementwise_backward``
(fake, autograd and a "promote" autocast rule registered; the backward op's own derivative is
made of the forward ops, for double backward), public functions.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels._jagged_common import compute_dtype, eager_triton, needs_grad, pick_backend, register_autocast
from kernels._segments import row_index, scatter_rows
from kernels._validation import (
    check_float,
    check_max_seq_len,
    check_offsets,
    check_offsets_device,
    check_same,
    check_size,
)

# ---- 1. references ------------------------------------------------------------------------


def jagged_dense_elementwise_reference(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, is_mul: bool
) -> torch.Tensor:
    cdt = compute_dtype(values.dtype)
    idx = row_index(offsets, dense.shape[1], values.shape[0])
    x, d = values.to(cdt)[idx.rows], dense.to(cdt)[idx.seq, idx.pos]  # [R, D]
    out = scatter_rows(x * d if is_mul else x + d, idx.rows, values.shape[0])
    return out.to(values.dtype)  # [T, D]


def jagged_dense_elementwise_backward_reference(
    grad: torch.Tensor,
    offsets: torch.Tensor,
    values: torch.Tensor | None,
    dense: torch.Tensor | None,
    max_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_values [T, D], grad_dense [B, N, D]); values and dense are given for mul only."""
    cdt = compute_dtype(grad.dtype)
    B, D = offsets.numel() - 1, grad.shape[1]
    idx = row_index(offsets, max_seq_len, grad.shape[0])
    g = grad.to(cdt)[idx.rows]  # [R, D]
    if values is None:
        gv = gd = g
    else:
        gv, gd = g * dense.to(cdt)[idx.seq, idx.pos], g * values.to(cdt)[idx.rows]
    grad_values = scatter_rows(gv, idx.rows, grad.shape[0])
    grad_dense = g.new_zeros((B, max_seq_len, D)).index_put((idx.seq, idx.pos), gd)
    return grad_values.to(grad.dtype), grad_dense.to(grad.dtype)


# ---- 2./3. custom ops (the Triton launchers live in kernels._elementwise_triton) -------------


def _forward(values, offsets, dense, backend, is_mul):
    if backend == "triton":
        from kernels._elementwise_triton import jagged_dense_elementwise_fwd_triton

        return jagged_dense_elementwise_fwd_triton(values, offsets, dense, is_mul)
    return jagged_dense_elementwise_reference(values, offsets, dense, is_mul)


@torch.library.custom_op("jagged::jagged_dense_elementwise_add", mutates_args=())
def _add_op(values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, backend: str) -> torch.Tensor:
    return _forward(values, offsets, dense, backend, is_mul=False)


@torch.library.custom_op("jagged::jagged_dense_elementwise_mul", mutates_args=())
def _mul_op(values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, backend: str) -> torch.Tensor:
    return _forward(values, offsets, dense, backend, is_mul=True)


@torch.library.custom_op("jagged::jagged_dense_elementwise_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    offsets: torch.Tensor,
    values: Optional[torch.Tensor],
    dense: Optional[torch.Tensor],
    max_seq_len: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        from kernels._elementwise_triton import jagged_dense_elementwise_bwd_triton

        return jagged_dense_elementwise_bwd_triton(grad, offsets, values, dense, max_seq_len)
    return jagged_dense_elementwise_backward_reference(grad, offsets, values, dense, max_seq_len)


def _fake_forward(values, offsets, dense, backend):
    return torch.empty_like(values, memory_format=torch.contiguous_format)


_add_op.register_fake(_fake_forward)
_mul_op.register_fake(_fake_forward)


@_backward_op.register_fake
def _(grad, offsets, values, dense, max_seq_len, backend):
    B, D = offsets.shape[0] - 1, grad.shape[1]
    return torch.empty_like(grad, memory_format=torch.contiguous_format), grad.new_empty((B, max_seq_len, D))


# ---- 4. autograd ----------------------------------------------------------------------------


def _add_setup(ctx, inputs, output):
    _, offsets, dense, backend = inputs
    ctx.save_for_backward(offsets)
    ctx.max_seq_len, ctx.backend = dense.shape[1], backend


def _mul_setup(ctx, inputs, output):
    values, offsets, dense, backend = inputs
    ctx.save_for_backward(offsets, values, dense)
    ctx.max_seq_len, ctx.backend = dense.shape[1], backend


def _backward(ctx, grad):
    offsets, *operands = ctx.saved_tensors
    values, dense = operands if operands else (None, None)
    grad_values, grad_dense = torch.ops.jagged.jagged_dense_elementwise_backward(
        grad, offsets, values, dense, ctx.max_seq_len, ctx.backend
    )
    return grad_values, None, grad_dense, None


_add_op.register_autograd(_backward, setup_context=_add_setup)
_mul_op.register_autograd(_backward, setup_context=_mul_setup)


# The backward op is differentiable too (double backward), in the forward ops of the same
# backend: add's backward is (g on the kept rows, g placed in [B, N, D]), so an upstream
# (uv, ud) gives d/dg = add(uv, ud); mul's is (g * dense[b, n], g * values placed), so
# d/dg = mul(uv, dense) + mul(values, ud), d/dvalues = mul(g, ud) and
# d/ddense = jagged_to_padded(uv * g).


def _backward_op_setup(ctx, inputs, output):
    grad, offsets, values, dense, max_seq_len, backend = inputs
    ctx.save_for_backward(grad, offsets, values, dense)
    ctx.max_seq_len, ctx.backend = max_seq_len, backend


def _double_backward(ctx, uv, ud):
    g, offsets, values, dense = ctx.saved_tensors
    ops, be = torch.ops.jagged, ctx.backend
    if values is None:
        return ops.jagged_dense_elementwise_add(uv, offsets, ud, be), None, None, None, None, None
    grad_g = grad_values = grad_dense = None
    if ctx.needs_input_grad[0]:
        grad_g = (ops.jagged_dense_elementwise_mul(uv, offsets, dense, be)
                  + ops.jagged_dense_elementwise_mul(values, offsets, ud, be))
    if ctx.needs_input_grad[2]:
        grad_values = ops.jagged_dense_elementwise_mul(g, offsets, ud, be)
    if ctx.needs_input_grad[3]:
        grad_dense = ops.jagged_to_padded(uv * g, offsets, ctx.max_seq_len, 0.0, be)
    return grad_g, None, grad_values, grad_dense, None, None


_backward_op.register_autograd(_double_backward, setup_context=_backward_op_setup)
register_autocast("jagged_dense_elementwise_add", "promote")
register_autocast("jagged_dense_elementwise_mul", "promote")


# ---- 5. public functions --------------------------------------------------------------------

_SPEC = """

    Args:
        values: ``[T, D]`` float32/bfloat16/float16 (float64 on the torch backend), any strides.
        offsets: ``[B+1]`` int64 or int32, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``.
        dense: ``[B, N, D]``, same dtype and device as ``values``, any strides. N is the
            max_seq_len of the op: position n of sequence b pairs with ``dense[b, n]``.
        max_seq_len: optional; when given it must equal ``dense.shape[1]``.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA, torch on CPU).

    Returns:
        ``[T, D]`` in ``values.dtype``, computed in fp32 and rounded once. Jagged rows with
        ``n >= N`` (sequences longer than N) are zero in the output and get zero gradient
        (FBGEMM's truncation); ``dense`` rows ``n >= len_b`` are unused and get zero gradient.
        Under autocast both inputs are promoted to the wider of their dtypes (as torch does
        for mixed-dtype ``add``/``mul``); outside autocast the dtypes must match.
"""


def _direct(backend: str, values: torch.Tensor, dense: torch.Tensor) -> bool:
    """Eager Triton call with nothing for autograd to record and no autocast promotion to do:
    the launcher itself, without the custom op's dispatch (tens of microseconds of host time)."""
    return eager_triton(backend) and values.dtype == dense.dtype and not needs_grad(values, dense)


def _checked(values, offsets, dense, max_seq_len, backend):
    check_float(values, "values", ndim=2)
    check_float(dense, "dense", ndim=3)
    on_autocast = values.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(values.device.type)
    check_same({"values": values, "dense": dense}, dtype=not on_autocast)
    check_offsets(offsets, total=values.shape[0])
    check_offsets_device(offsets, values)
    check_size(dense, "dense", 0, offsets.shape[0] - 1, "B = len(offsets) - 1")
    check_size(dense, "dense", 2, values.shape[1], "D = values.shape[1]")
    if max_seq_len is not None:
        check_size(dense, "dense", 1, check_max_seq_len(max_seq_len), "max_seq_len")
    return pick_backend(backend, values)


def jagged_dense_elementwise_add(
    values: torch.Tensor,
    offsets: torch.Tensor,
    dense: torch.Tensor,
    max_seq_len: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    be = _checked(values, offsets, dense, max_seq_len, backend)
    if _direct(be, values, dense):
        return _forward(values, offsets, dense, be, is_mul=False)
    return torch.ops.jagged.jagged_dense_elementwise_add(values, offsets, dense, be)


def jagged_dense_elementwise_mul(
    values: torch.Tensor,
    offsets: torch.Tensor,
    dense: torch.Tensor,
    max_seq_len: int | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    be = _checked(values, offsets, dense, max_seq_len, backend)
    if _direct(be, values, dense):
        return _forward(values, offsets, dense, be, is_mul=True)
    return torch.ops.jagged.jagged_dense_elementwise_mul(values, offsets, dense, be)


jagged_dense_elementwise_add.__doc__ = (
    "Add a padded dense tensor to a jagged one: ``out[offsets[b] + n] = values[offsets[b] + n]"
    " + dense[b, n]`` for ``n < min(len_b, N)``." + _SPEC
    + "        Backward: ``grad_values = grad`` (kept rows), ``grad_dense = jagged_to_padded(grad, N)``.\n"
)
jagged_dense_elementwise_mul.__doc__ = (
    "Multiply a jagged tensor by a padded dense one: ``out[offsets[b] + n] = values[offsets[b] + n]"
    " * dense[b, n]`` for ``n < min(len_b, N)``." + _SPEC
    + "        Backward: ``grad_values = grad * dense[b, n]``, ``grad_dense[b, n] = grad * values``.\n"
)
