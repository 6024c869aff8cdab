"""jagged_dense_elementwise_add / _mul: combine a jagged tensor with a padded dense one.

One autograd.Function for both over the custom ops ``jagged::jagged_dense_elementwise_add``,
``..._mul`` and ``..._backward``; Triton kernels in ``kernels._elementwise_triton``. A recorded
backward (double backward) is the reference's, on either backend."""

from __future__ import annotations

import torch

from kernels._jagged_common import apply, autocast_cast, autocast_on, compute_dtype, lazy, pick_backend, run
from kernels._jagged_common import register_autocast
from kernels._segments import row_index, scatter_rows
from kernels._validation import check_jagged_and_dense, check_max_seq_len, check_size

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
    grad: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor | None, dense: torch.Tensor | None, max_seq_len: int
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


# ---- 2. the ops: custom ops for tracing, one autograd.Function each (_jagged_common.run) ---

_fwd_triton = lazy("kernels._elementwise_triton", "jagged_dense_elementwise_fwd_triton")
_ADD = {"torch": lambda v, o, d: jagged_dense_elementwise_reference(v, o, d, False),
        "triton": lambda v, o, d: _fwd_triton(v, o, d, False)}
_MUL = {"torch": lambda v, o, d: jagged_dense_elementwise_reference(v, o, d, True),
        "triton": lambda v, o, d: _fwd_triton(v, o, d, True)}
_BWD = {"torch": jagged_dense_elementwise_backward_reference,
        "triton": lazy("kernels._elementwise_triton", "jagged_dense_elementwise_bwd_triton")}


@torch.library.custom_op("jagged::jagged_dense_elementwise_add", mutates_args=())
def _add_op(values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, backend: str) -> torch.Tensor:
    return _ADD[backend](values, offsets, dense)


@torch.library.custom_op("jagged::jagged_dense_elementwise_mul", mutates_args=())
def _mul_op(values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, backend: str) -> torch.Tensor:
    return _MUL[backend](values, offsets, dense)


@torch.library.custom_op("jagged::jagged_dense_elementwise_backward", mutates_args=())
def _bwd_op(grad: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor | None, dense: torch.Tensor | None,
            max_seq_len: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _BWD[backend](grad, offsets, values, dense, max_seq_len)


def _fake_forward(values, offsets, dense, backend):
    return torch.empty_like(values, memory_format=torch.contiguous_format)


_add_op.register_fake(_fake_forward)
_mul_op.register_fake(_fake_forward)
register_autocast("jagged_dense_elementwise_add", "promote")
register_autocast("jagged_dense_elementwise_mul", "promote")


@_bwd_op.register_fake
def _(grad, offsets, values, dense, max_seq_len, backend):
    B, D = offsets.shape[0] - 1, grad.shape[1]
    return torch.empty_like(grad, memory_format=torch.contiguous_format), grad.new_empty((B, max_seq_len, D))


class _Elementwise(torch.autograd.Function):
    """add (is_mul False) or mul: the forward custom op of its own, one backward op for both."""

    @staticmethod
    def forward(values, offsets, dense, is_mul, backend):
        return run(_mul_op, _MUL, values, offsets, dense, backend) if is_mul else \
            run(_add_op, _ADD, values, offsets, dense, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        values, offsets, dense, is_mul, backend = inputs
        if is_mul:
            ctx.save_for_backward(offsets, values, dense)
        else:  # add's backward needs neither operand
            ctx.save_for_backward(offsets)
        ctx.max_seq_len, ctx.backend = dense.shape[1], backend

    @staticmethod
    def backward(ctx, grad):
        offsets, *operands = ctx.saved_tensors
        values, dense = operands if operands else (None, None)
        if torch.is_grad_enabled():  # create_graph=True: the reference's backward, differentiable
            grad_values, grad_dense = jagged_dense_elementwise_backward_reference(grad, offsets, values, dense,
                                                                                  ctx.max_seq_len)
        else:
            grad_values, grad_dense = run(_bwd_op, _BWD, grad, offsets, values, dense, ctx.max_seq_len,
                                          ctx.backend)
        return grad_values, None, grad_dense, None, None


# ---- 3. public functions --------------------------------------------------------------------


def _checked(values, offsets, dense, max_seq_len, backend):
    check_jagged_and_dense(values, offsets, dense, same_dtype=not autocast_on(values), width_dim=2, width="D")
    if max_seq_len is not None:
        check_size(dense, "dense", 1, check_max_seq_len(max_seq_len), "max_seq_len")
    return pick_backend(backend, values)


def jagged_dense_elementwise_add(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int | None = None, *,
    backend: str = "auto",
) -> torch.Tensor:
    """Add a padded dense tensor to a jagged one: ``out[offsets[b] + n] = values[offsets[b] + n]
    + dense[b, n]`` for ``n < min(len_b, N)``.

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
        Backward: ``grad_values = grad`` (kept rows), ``grad_dense = jagged_to_padded(grad, N)``."""
    be = _checked(values, offsets, dense, max_seq_len, backend)
    return apply(_Elementwise, *autocast_cast("promote", values, offsets, dense), False, be)


def jagged_dense_elementwise_mul(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int | None = None, *,
    backend: str = "auto",
) -> torch.Tensor:
    """Multiply a jagged tensor by a padded dense one: ``out[offsets[b] + n] = values[offsets[b] + n]
    * dense[b, n]`` for ``n < min(len_b, N)``; arguments, truncation, dtypes and autocast as
    :func:`jagged_dense_elementwise_add`. Backward: ``grad_values = grad * dense[b, n]``,
    ``grad_dense[b, n] = grad * values``."""
    be = _checked(values, offsets, dense, max_seq_len, backend)
    return apply(_Elementwise, *autocast_cast("promote", values, offsets, dense), True, be)
