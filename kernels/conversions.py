"""jagged_to_padded and padded_to_jagged: the two conversions between the layouts.

Each is one autograd.Function (its backward the other conversion) over the custom op
``jagged::<name>``; Triton kernels in ``kernels._conversions_triton``."""

from __future__ import annotations

import torch

from kernels._jagged_common import apply, lazy, pick_backend, run, traced
from kernels._segments import row_index, scatter_rows
from kernels._validation import check_float, check_max_seq_len, check_offsets, check_offsets_device, check_size

# ---- 1. references ------------------------------------------------------------------------


def jagged_to_padded_reference(
    values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, padding_value: float = 0.0
) -> torch.Tensor:
    idx = row_index(offsets, max_seq_len, values.shape[0])
    out = values.new_full((offsets.numel() - 1, max_seq_len, values.shape[1]), padding_value)
    return out.index_put((idx.seq, idx.pos), values[idx.rows])  # [B, N, D]


def padded_to_jagged_reference(
    padded: torch.Tensor, offsets: torch.Tensor, total: int | None = None
) -> torch.Tensor:
    total = int(offsets[-1]) if total is None else total
    idx = row_index(offsets, padded.shape[1], total)
    return scatter_rows(padded[idx.seq, idx.pos], idx.rows, total)  # [T, D]


# ---- 2. the ops: custom ops for tracing, one autograd.Function each (_jagged_common.run) ---

_TO_PADDED = {"torch": jagged_to_padded_reference,
              "triton": lazy("kernels._conversions_triton", "jagged_to_padded_triton")}
_TO_JAGGED = {"torch": padded_to_jagged_reference,
              "triton": lazy("kernels._conversions_triton", "padded_to_jagged_triton")}


@torch.library.custom_op("jagged::jagged_to_padded", mutates_args=())
def _to_padded_op(
    values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, padding_value: float, backend: str
) -> torch.Tensor:
    return _TO_PADDED[backend](values, offsets, max_seq_len, padding_value)


@torch.library.custom_op("jagged::padded_to_jagged", mutates_args=())
def _to_jagged_op(padded: torch.Tensor, offsets: torch.Tensor, total: int | None, backend: str) -> torch.Tensor:
    return _TO_JAGGED[backend](padded, offsets, int(offsets[-1]) if total is None else total)


_to_padded_op.register_fake(lambda values, offsets, max_seq_len, *_:
                            values.new_empty((offsets.shape[0] - 1, max_seq_len, values.shape[1])))


@_to_jagged_op.register_fake
def _(padded, offsets, total, backend):
    if total is None:  # T lives in offsets[-1]: data-dependent under torch.compile
        total = torch.library.get_ctx().new_dynamic_size()
    return padded.new_empty((total, padded.shape[2]))


class _ToPadded(torch.autograd.Function):
    @staticmethod
    def forward(values, offsets, max_seq_len, padding_value, backend):
        return run(_to_padded_op, _TO_PADDED, values, offsets, max_seq_len, padding_value, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        values, offsets, _, _, backend = inputs
        ctx.save_for_backward(offsets)
        ctx.total, ctx.backend = values.shape[0], backend

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return apply(_ToJagged, grad, offsets, ctx.total, ctx.backend), None, None, None, None


class _ToJagged(torch.autograd.Function):
    @staticmethod
    def forward(padded, offsets, total, backend):
        return run(_to_jagged_op, _TO_JAGGED, padded, offsets, total, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        padded, offsets, _, backend = inputs
        ctx.save_for_backward(offsets)
        ctx.max_seq_len, ctx.backend = padded.shape[1], backend

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return apply(_ToPadded, grad, offsets, ctx.max_seq_len, 0.0, ctx.backend), None, None, None


# ---- 3. public functions --------------------------------------------------------------------


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, padding_value: float = 0.0, *, backend: str = "auto"
) -> torch.Tensor:
    """Scatter a jagged tensor into a padded one.

    Args:
        values: ``[T, D]`` float32/bfloat16/float16 (float64 on the torch backend); rows of
            sequence b are ``values[offsets[b]:offsets[b+1]]``. Any strides.
        offsets: ``[B+1]`` int64 or int32, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == T``.
        max_seq_len: N, a host int >= 0: the padded length.
        padding_value: the value of padded positions ``n >= len_b`` (e.g. ``-inf`` for masks).
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA, torch on CPU).

    Returns:
        ``[B, N, D]`` in ``values.dtype``: ``out[b, n] = values[offsets[b] + n]`` for
        ``n < min(len_b, N)``, ``padding_value`` elsewhere. Rows of a sequence past N are
        dropped (the first N rows are kept) and get zero gradient. Exact in every dtype.
        Backward: ``grad_values = padded_to_jagged(grad)``. Autocast leaves the dtype alone."""
    check_float(values, "values", ndim=2)
    check_offsets(offsets, total=values.shape[0])
    check_offsets_device(offsets, values)
    max_seq_len = check_max_seq_len(max_seq_len)
    return apply(_ToPadded, values, offsets, max_seq_len, float(padding_value), pick_backend(backend, values))


def padded_to_jagged(
    padded: torch.Tensor, offsets: torch.Tensor, *, total: int | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Gather the real rows of a padded tensor into a jagged one.

    Args:
        padded: ``[B, N, D]`` float32/bfloat16/float16 (float64 on the torch backend), any strides.
        offsets: ``[B+1]`` int64 or int32 (as in ``jagged_to_padded``); ``len_b`` may exceed N.
        total: T = ``offsets[-1]`` if the caller knows it; ``None`` reads it from ``offsets``
            (a device sync on CUDA, and a data-dependent size under ``torch.compile``).
        backend: ``"torch"``, ``"triton"`` or ``"auto"``.

    Returns:
        ``[T, D]`` in ``padded.dtype``: ``out[offsets[b] + n] = padded[b, n]`` for
        ``n < min(len_b, N)``; rows with ``n >= N`` are zero. Exact in every dtype.
        Backward: ``grad_padded = jagged_to_padded(grad, offsets, N)`` (zero at padding)."""
    check_float(padded, "padded", ndim=3)
    check_offsets(offsets, total=total)
    check_offsets_device(offsets, padded)
    check_size(padded, "padded", 0, offsets.shape[0] - 1, "B = len(offsets) - 1")
    if total is not None:
        total = check_max_seq_len(total, "total")
    if total is None and not traced():  # traced, T stays a data-dependent size (the op's fake)
        total = int(offsets[-1])
    return apply(_ToJagged, padded, offsets, total, pick_backend(backend, padded))


def offsets_from_lengths(lengths, device=None, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Offsets [B+1] (0, then the running sum) of sequences with these lengths (a list or a
    tensor [B]), as `dtype` on `device` (default: the lengths' device, or the CPU)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    return offsets.to(device=device if device is not None else lengths.device, dtype=dtype)

