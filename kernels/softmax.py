"""jagged_softmax: softmax over the rows of each sequence, independently per column.

One autograd.Function over the custom ops ``jagged::jagged_softmax`` and ``..._backward``; Triton
kernels in ``kernels._softmax_triton``. A recorded backward (double backward) is the reference's,
on either backend.
"""

from __future__ import annotations

import torch

from kernels._jagged_common import apply, compute_dtype, lazy, pick_backend, run
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


# ---- 2. the op: custom ops for tracing, one autograd.Function (kernels._jagged_common.run) ---

_FWD = {"torch": jagged_softmax_reference, "triton": lazy("kernels._softmax_triton", "jagged_softmax_fwd_triton")}
_BWD = {"torch": jagged_softmax_backward_reference,
        "triton": lazy("kernels._softmax_triton", "jagged_softmax_bwd_triton")}


@torch.library.custom_op("jagged::jagged_softmax", mutates_args=())
def _fwd_op(values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, backend: str) -> torch.Tensor:
    return _FWD[backend](values, offsets, max_seq_len)


@torch.library.custom_op("jagged::jagged_softmax_backward", mutates_args=())
def _bwd_op(grad: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, backend: str) -> torch.Tensor:
    return _BWD[backend](grad, out, offsets, max_seq_len)


_fwd_op.register_fake(lambda values, *_: torch.empty_like(values, memory_format=torch.contiguous_format))
_bwd_op.register_fake(lambda grad, out, *_: torch.empty_like(out, memory_format=torch.contiguous_format))


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(values, offsets, max_seq_len, backend):
        return run(_fwd_op, _FWD, values, offsets, max_seq_len, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, offsets, max_seq_len, backend = inputs
        ctx.save_for_backward(output, offsets)
        ctx.max_seq_len, ctx.backend = max_seq_len, backend

    @staticmethod
    def backward(ctx, grad):
        out, offsets = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's backward, differentiable
            return jagged_softmax_backward_reference(grad, out, offsets, ctx.max_seq_len), None, None, None
        return run(_bwd_op, _BWD, grad, out, offsets, ctx.max_seq_len, ctx.backend), None, None, None


# ---- 3. public function ---------------------------------------------------------------------


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
        Under autocast the dtype is kept (the math is fp32 inside either way)."""
    check_float(values, "values", ndim=2)
    check_offsets(offsets, total=values.shape[0])
    check_offsets_device(offsets, values)
    max_seq_len = check_max_seq_len(max_seq_len)
    return apply(_Softmax, values, offsets, max_seq_len, pick_backend(backend, values))
