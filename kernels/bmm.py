"""jagged_dense_bmm and jagged_jagged_bmm: per-sequence matrix products.

Each is one autograd.Function (its backward made of the two products) over the custom op
``jagged::<name>``; Triton kernels in ``kernels._bmm_triton``."""

from __future__ import annotations

import torch

from kernels._jagged_common import apply, autocast_cast, autocast_on, compute_dtype, lazy, pick_backend, run
from kernels._jagged_common import register_autocast
from kernels._segments import by_seq, gather_groups, keep_in_graph, length_groups, scatter_groups
from kernels._validation import check_float, check_max_seq_len, check_offsets, check_offsets_device, check_same
from kernels._validation import check_jagged_and_dense, check_size

# ---- 1. references ------------------------------------------------------------------------


def jagged_dense_bmm_reference(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    # one batched product per length bucket (kernels._segments): no loop over sequences
    cdt = compute_dtype(values.dtype)
    x, w = values.to(cdt), dense.to(cdt)
    groups = length_groups(offsets, max_seq_len)
    parts = [torch.bmm(xp, w.index_select(0, g.seqs))  # [G, L, M]
             for g, xp in zip(groups, gather_groups(x, groups))]
    out = scatter_groups(parts, groups, values.shape[0], x.new_empty((0, dense.shape[2])))
    if not groups:
        out = out + keep_in_graph(values, dense)
    return out.to(values.dtype)  # [T, M]


def jagged_jagged_bmm_reference(
    a: torch.Tensor, c: torch.Tensor, offsets: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    cdt = compute_dtype(a.dtype)
    x, y = a.to(cdt), c.to(cdt)
    groups = length_groups(offsets, max_seq_len)
    # padding rows are zeros in both operands: they add nothing
    parts = [xp.transpose(1, 2) @ yp for xp, yp in zip(gather_groups(x, groups), gather_groups(y, groups))]
    out = by_seq(parts, groups, (offsets.numel() - 1, a.shape[1], c.shape[1]), x)  # [B, K, M]
    if not groups:
        out = out + keep_in_graph(a, c)
    return out.to(a.dtype)


# ---- 2. the ops: custom ops for tracing, one autograd.Function each (_jagged_common.run) ---

_JD = {"torch": jagged_dense_bmm_reference, "triton": lazy("kernels._bmm_triton", "jagged_dense_bmm_triton")}
_JJ = {"torch": jagged_jagged_bmm_reference, "triton": lazy("kernels._bmm_triton", "jagged_jagged_bmm_triton")}


@torch.library.custom_op("jagged::jagged_dense_bmm", mutates_args=())
def _jd_op(values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int, backend: str
           ) -> torch.Tensor:
    return _JD[backend](values, offsets, dense, max_seq_len)


@torch.library.custom_op("jagged::jagged_jagged_bmm", mutates_args=())
def _jj_op(a: torch.Tensor, c: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, backend: str) -> torch.Tensor:
    return _JJ[backend](a, c, offsets, max_seq_len)


_jd_op.register_fake(lambda values, offsets, dense, *_: values.new_empty((values.shape[0], dense.shape[2])))
_jj_op.register_fake(lambda a, c, offsets, *_: a.new_empty((offsets.shape[0] - 1, a.shape[1], c.shape[1])))
register_autocast("jagged_dense_bmm", "lowp")
register_autocast("jagged_jagged_bmm", "lowp")


class _JaggedDense(torch.autograd.Function):
    @staticmethod
    def forward(values, offsets, dense, max_seq_len, backend):
        return run(_jd_op, _JD, values, offsets, dense, max_seq_len, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        values, offsets, dense, max_seq_len, backend = inputs
        ctx.save_for_backward(values, offsets, dense)
        ctx.max_seq_len, ctx.backend = max_seq_len, backend

    @staticmethod
    def backward(ctx, grad):  # grad [T, M]
        values, offsets, dense = ctx.saved_tensors
        grad_values = grad_dense = None
        if ctx.needs_input_grad[0]:  # dx_b = dy_b @ W_b^T
            grad_values = apply(_JaggedDense, grad, offsets, dense.transpose(1, 2), ctx.max_seq_len, ctx.backend)
        if ctx.needs_input_grad[2]:  # dW_b = x_b^T @ dy_b
            grad_dense = apply(_JaggedJagged, values, grad, offsets, ctx.max_seq_len, ctx.backend)
        return grad_values, None, grad_dense, None, None


class _JaggedJagged(torch.autograd.Function):
    @staticmethod
    def forward(a, c, offsets, max_seq_len, backend):
        return run(_jj_op, _JJ, a, c, offsets, max_seq_len, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, c, offsets, max_seq_len, backend = inputs
        ctx.save_for_backward(a, c, offsets)
        ctx.max_seq_len, ctx.backend = max_seq_len, backend

    @staticmethod
    def backward(ctx, grad):  # grad [B, K, M]
        a, c, offsets = ctx.saved_tensors
        grad_a = grad_c = None
        if ctx.needs_input_grad[0]:  # da_b = c_b @ dC_b^T
            grad_a = apply(_JaggedDense, c, offsets, grad.transpose(1, 2), ctx.max_seq_len, ctx.backend)
        if ctx.needs_input_grad[1]:  # dc_b = a_b @ dC_b
            grad_c = apply(_JaggedDense, a, offsets, grad, ctx.max_seq_len, ctx.backend)
        return grad_a, grad_c, None, None, None


# ---- 3. public functions --------------------------------------------------------------------


def jagged_dense_bmm(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int, *, backend: str = "auto"
) -> torch.Tensor:
    """Multiply each sequence's rows by its own dense matrix.

    Args:
        values: ``[T, K]`` float32/bfloat16/float16 (float64 on the torch backend), any strides.
        offsets: ``[B+1]`` int64 or int32, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``.
        dense: ``[B, K, M]``, same dtype and device as ``values``, any strides.
        max_seq_len: N, a host int >= 0; only the first ``min(len_b, N)`` rows of sequence b
            are multiplied.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA, torch on CPU).

    Returns:
        ``[T, M]`` in ``values.dtype``: ``out[offsets[b] + n] = values[offsets[b] + n] @ dense[b]``
        for ``n < min(len_b, N)``, zero rows (and zero gradients) past N. fp32 accumulation.
        Backward: ``grad_values = jagged_dense_bmm(grad, dense^T)``,
        ``grad_dense = jagged_jagged_bmm(values, grad)``.
        Under autocast (CPU or CUDA) the float inputs are cast to the autocast dtype, like
        ``torch.bmm``, and the result has that dtype."""
    check_jagged_and_dense(values, offsets, dense, same_dtype=not autocast_on(values), width_dim=1, width="K")
    max_seq_len = check_max_seq_len(max_seq_len)
    values, dense = autocast_cast("lowp", values, dense)
    return apply(_JaggedDense, values, offsets, dense, max_seq_len, pick_backend(backend, values))


def jagged_jagged_bmm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, *, backend: str = "auto"
) -> torch.Tensor:
    """Sum over each sequence of the outer products of its rows of ``a`` and ``b``.

    Args:
        a: ``[T, K]`` float32/bfloat16/float16 (float64 on the torch backend), any strides.
        b: ``[T, M]``, same dtype and device as ``a``, same offsets.
        offsets: ``[B+1]`` int64 or int32, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``.
        max_seq_len: N, a host int >= 0; only the first ``min(len_b, N)`` rows of each
            sequence take part.
        backend: ``"torch"``, ``"triton"`` or ``"auto"``.

    Returns:
        ``[B, K, M]`` in ``a.dtype``: ``out[i] = a_i^T @ b_i`` over the kept rows of sequence i
        (zero for an empty sequence), fp32 accumulation. Rows past N get zero gradients.
        Backward: ``grad_a = jagged_dense_bmm(b, grad^T)``, ``grad_b = jagged_dense_bmm(a, grad)``.
        Under autocast the float inputs are cast to the autocast dtype, like ``torch.bmm``."""
    check_float(a, "a", ndim=2)
    check_float(b, "b", ndim=2)
    check_same({"a": a, "b": b}, dtype=not autocast_on(a))
    check_size(b, "b", 0, a.shape[0], "T = a.shape[0]")
    check_offsets(offsets, total=a.shape[0])
    check_offsets_device(offsets, a)
    max_seq_len = check_max_seq_len(max_seq_len)
    a, b = autocast_cast("lowp", a, b)
    return apply(_JaggedJagged, a, b, offsets, max_seq_len, pick_backend(backend, a))
