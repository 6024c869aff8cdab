"""jagged_softmax: softmax over the rows of each sequence, independently per column.

Layers (DESIGN.md): torch reference (forward and backward), Triton kernels in
``kernels._softmax_triton``, custom ops ``jagged::jagged_softmax`` and
``jagged::jagged_softmax_backward`` (fake and autograd registered: the backward is itself
differentiable, for double backward on either backend), public function.
"""

from __future__ import annotations

import torch

from kernels._jagged_common import compute_dtype, eager_triton, needs_grad, pick_backend
from kernels._segments import row_index, scatter_rows, segment_amax, segment_sum
from kernels._validation import check_float, check_max_seq_len, check_offsets, check_offsets_device

# ---- 1. references ------------------------------------------------------------------------


def jagged_softmax_reference(values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    # vectorised over the rows that take part (kernels._segments): segment max and sum
    cdt = compute_dtype(values.dtype)
    T, B = values.shape[0], offsets.numel() - 1
    idx = row_index(offsets, max_seq_len, T)
    x = values.to(cdt)[idx.rows]  # [R, H]
    # the shift cancels in the ratio: detached, it adds nothing to the graph
    m = segment_amax(x.detach(), idx, B)[idx.seq]
    e = torch.exp(x - m)
    y = e / segment_sum(e, idx, B)[idx.seq]
    return scatter_rows(y, idx.rows, T).to(values.dtype)  # [T, H]


def jagged_softmax_backward_reference(
    grad: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    cdt = compute_dtype(out.dtype)
    T = out.shape[0]
    idx = row_index(offsets, max_seq_len, T)
    y, g = out.to(cdt)[idx.rows], grad.to(cdt)[idx.rows]
    grad_values = y * (g - segment_sum(g * y, idx, offsets.numel() - 1)[idx.seq])
    return scatter_rows(grad_values, idx.rows, T).to(out.dtype)  # [T, H]


# ---- 2./3. custom ops (the Triton launchers live in kernels._softmax_triton) -----------------


@torch.library.custom_op("jagged::jagged_softmax", mutates_args=())
def _jagged_softmax_op(values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, backend: str) -> torch.Tensor:
    if backend == "triton":
        from kernels._softmax_triton import jagged_softmax_fwd_triton

        return jagged_softmax_fwd_triton(values, offsets, max_seq_len)
    return jagged_softmax_reference(values, offsets, max_seq_len)


@_jagged_softmax_op.register_fake
def _(values, offsets, max_seq_len, backend):
    return torch.empty_like(values, memory_format=torch.contiguous_format)


@torch.library.custom_op("jagged::jagged_softmax_backward", mutates_args=())
def _jagged_softmax_backward_op(
    grad: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, backend: str
) -> torch.Tensor:
    if backend == "triton":
        from kernels._softmax_triton import jagged_softmax_bwd_triton

        return jagged_softmax_bwd_triton(grad, out, offsets, max_seq_len)
    return jagged_softmax_backward_reference(grad, out, offsets, max_seq_len)


@_jagged_softmax_backward_op.register_fake
def _(grad, out, offsets, max_seq_len, backend):
    return torch.empty_like(out, memory_format=torch.contiguous_format)


# ---- 4. autograd ----------------------------------------------------------------------------


def _setup(ctx, inputs, output):
    _, offsets, max_seq_len, backend = inputs
    ctx.save_for_backward(output, offsets)
    ctx.max_seq_len, ctx.backend = max_seq_len, backend


def _backward(ctx, grad):
    out, offsets = ctx.saved_tensors
    grad_values = torch.ops.jagged.jagged_softmax_backward(grad, out, offsets, ctx.max_seq_len, ctx.backend)
    return grad_values, None, None, None


_jagged_softmax_op.register_autograd(_backward, setup_context=_setup)


# The backward is differentiable too (double backward, on either backend): for
# grad_x = y * (g - s), s = sum_rows(g * y) per sequence and column, an upstream u gives
# d/dg = y * (u - sum_rows(u * y)) (the same backward op) and
# d/dy = u * (g - s) - g * sum_rows(u * y), here in plain torch over the rows that take part.


def _backward_setup(ctx, inputs, output):
    grad, out, offsets, max_seq_len, backend = inputs
    ctx.save_for_backward(grad, out, offsets)
    ctx.max_seq_len, ctx.backend = max_seq_len, backend


def _double_backward(ctx, u):
    g, y, offsets = ctx.saved_tensors
    grad_g = grad_y = None
    if ctx.needs_input_grad[0]:
        grad_g = torch.ops.jagged.jagged_softmax_backward(u, y, offsets, ctx.max_seq_len, ctx.backend)
    if ctx.needs_input_grad[1]:
        cdt, T, B = compute_dtype(y.dtype), y.shape[0], offsets.numel() - 1
        idx = row_index(offsets, ctx.max_seq_len, T)
        uu, gg, yy = (t.to(cdt)[idx.rows] for t in (u, g, y))  # [R, H]
        s, t = (segment_sum(a * yy, idx, B)[idx.seq] for a in (gg, uu))
        grad_y = scatter_rows(uu * (gg - s) - gg * t, idx.rows, T).to(y.dtype)
    return grad_g, grad_y, None, None, None


_jagged_softmax_backward_op.register_autograd(_double_backward, setup_context=_backward_setup)


# ---- 5. public function ---------------------------------------------------------------------


def jagged_softmax(
    values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, *, backend: str = "auto"
) -> torch.Tensor:
    """Softmax over the rows of each sequence, independently for every column.

    Args:
        values: ``[T, H]`` float32/bfloat16/float16 (float64 on the torch backend), any
            strides; e.g. H attention heads' scores of each item of a user's history.
        offsets: ``[B+1]`` int64 or int32, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``.
        max_seq_len: N, a host int >= 0; only the first ``min(len_b, N)`` rows of sequence b
            take part.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA, torch on CPU).

    Returns:
        ``[T, H]`` in ``values.dtype``: for the rows ``r`` of sequence b with ``r < min(len_b, N)``,
        ``out[r, h] = exp(x[r, h]) / sum_{r'} exp(x[r', h])`` (max-shifted, computed in fp32);
        rows past N are zero and get zero gradient. Length-0 sequences give no rows.
        Backward: ``grad_x = y * (g - sum_rows(g * y))`` per column, in fp32.
        Under autocast the dtype is kept (the math is fp32 inside either way).
    """
    check_float(values, "values", ndim=2)
    check_offsets(offsets, total=values.shape[0])
    check_offsets_device(offsets, values)
    max_seq_len = check_max_seq_len(max_seq_len)
    be = pick_backend(backend, values)
    if eager_triton(be) and not needs_grad(values):
        from kernels._softmax_triton import jagged_softmax_fwd_triton  # nothing to record: no dispatch

        return jagged_softmax_fwd_triton(values, offsets, max_seq_len)
    return torch.ops.jagged.jagged_softmax(values, offsets, max_seq_len, be)
