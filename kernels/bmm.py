"""jagged_dense_bmm and jagged_jagged_bmm: per-sequence matrix products.

Layers (DESIGN.md): torch references, Triton kernels in ``kernels._bmm_triton``, custom ops
``jagged::jagged_dense_bmm`` / ``jagged::jagged_jagged_bmm`` (fake, autograd and autocast
registered; each backward is made of the two forward ops), public functions.
"""

from __future__ import annotations

import torch

from kernels._jagged_common import (
    autocast_lowp,
    compute_dtype,
    eager_triton,
    needs_grad,
    pick_backend,
    register_autocast,
)
from kernels._segments import by_seq, gather_groups, keep_in_graph, length_groups, scatter_groups
from kernels._validation import (
    check_float,
    check_max_seq_len,
    check_offsets,
    check_offsets_device,
    check_same,
    check_size,
)

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


# ---- 2./3. custom ops (the Triton launchers live in kernels._bmm_triton) ---------------------


@torch.library.custom_op("jagged::jagged_dense_bmm", mutates_args=())
def _jagged_dense_bmm_op(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int, backend: str
) -> torch.Tensor:
    if backend == "triton":
        from kernels._bmm_triton import jagged_dense_bmm_triton

        return jagged_dense_bmm_triton(values, offsets, dense, max_seq_len)
    return jagged_dense_bmm_reference(values, offsets, dense, max_seq_len)


@_jagged_dense_bmm_op.register_fake
def _(values, offsets, dense, max_seq_len, backend):
    return values.new_empty((values.shape[0], dense.shape[2]))


@torch.library.custom_op("jagged::jagged_jagged_bmm", mutates_args=())
def _jagged_jagged_bmm_op(
    a: torch.Tensor, c: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, backend: str
) -> torch.Tensor:
    if backend == "triton":
        from kernels._bmm_triton import jagged_jagged_bmm_triton

        return jagged_jagged_bmm_triton(a, c, offsets, max_seq_len)
    return jagged_jagged_bmm_reference(a, c, offsets, max_seq_len)


@_jagged_jagged_bmm_op.register_fake
def _(a, c, offsets, max_seq_len, backend):
    return a.new_empty((offsets.shape[0] - 1, a.shape[1], c.shape[1]))


# ---- 4. autograd ----------------------------------------------------------------------------


def _jd_setup(ctx, inputs, output):
    values, offsets, dense, max_seq_len, backend = inputs
    ctx.save_for_backward(values, offsets, dense)
    ctx.max_seq_len, ctx.backend = max_seq_len, backend


def _jj_setup(ctx, inputs, output):
    a, c, offsets, max_seq_len, backend = inputs
    ctx.save_for_backward(a, c, offsets)
    ctx.max_seq_len, ctx.backend = max_seq_len, backend


def _products(backend: str, launchers: bool):
    """(jagged_dense_bmm, jagged_jagged_bmm) for a backward, each (x, y, offsets-or-dense...)
    as the custom ops take them minus the backend: the differentiable custom ops, or the bare
    Triton launchers where the backward is not itself recorded (the eager path)."""
    if launchers:
        from kernels._bmm_triton import jagged_dense_bmm_triton, jagged_jagged_bmm_triton

        return jagged_dense_bmm_triton, jagged_jagged_bmm_triton
    return (lambda *a: torch.ops.jagged.jagged_dense_bmm(*a, backend),
            lambda *a: torch.ops.jagged.jagged_jagged_bmm(*a, backend))


def _jd_grads(ctx, grad, products):  # grad [T, M] -> (grad_values, grad_dense)
    values, offsets, dense = ctx.saved_tensors
    dense_bmm, jagged_bmm = products
    grad_values = grad_dense = None
    if ctx.needs_input_grad[0]:  # dx_b = dy_b @ W_b^T
        grad_values = dense_bmm(grad, offsets, dense.transpose(1, 2), ctx.max_seq_len)
    if ctx.needs_input_grad[2]:  # dW_b = x_b^T @ dy_b
        grad_dense = jagged_bmm(values, grad, offsets, ctx.max_seq_len)
    return grad_values, grad_dense


def _jj_grads(ctx, grad, products):  # grad [B, K, M] -> (grad_a, grad_c)
    a, c, offsets = ctx.saved_tensors
    dense_bmm, _ = products
    grad_a = grad_c = None
    if ctx.needs_input_grad[0]:  # da_b = c_b @ dC_b^T
        grad_a = dense_bmm(c, offsets, grad.transpose(1, 2), ctx.max_seq_len)
    if ctx.needs_input_grad[1]:  # dc_b = a_b @ dC_b
        grad_c = dense_bmm(a, offsets, grad, ctx.max_seq_len)
    return grad_a, grad_c


def _jd_backward(ctx, grad):
    grad_values, grad_dense = _jd_grads(ctx, grad, _products(ctx.backend, launchers=False))
    return grad_values, None, grad_dense, None, None


def _jj_backward(ctx, grad):
    grad_a, grad_c = _jj_grads(ctx, grad, _products(ctx.backend, launchers=False))
    return grad_a, grad_c, None, None, None


_jagged_dense_bmm_op.register_autograd(_jd_backward, setup_context=_jd_setup)
_jagged_jagged_bmm_op.register_autograd(_jj_backward, setup_context=_jj_setup)
register_autocast("jagged_dense_bmm", "lowp")
register_autocast("jagged_jagged_bmm", "lowp")


# ---- eager Triton path ----------------------------------------------------------------------
# The same forward and backward as the custom ops, through a plain autograd.Function that calls
# the launchers: no custom-op dispatch per call (forward, and the two products of each backward).
# A backward that must itself be differentiable (create_graph=True) goes through the custom ops.


class _JaggedDenseBmmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, dense, max_seq_len):
        from kernels._bmm_triton import jagged_dense_bmm_triton

        ctx.save_for_backward(values, offsets, dense)
        ctx.max_seq_len = max_seq_len
        return jagged_dense_bmm_triton(values, offsets, dense, max_seq_len)

    @staticmethod
    def backward(ctx, grad):
        products = _products("triton", launchers=not torch.is_grad_enabled())
        grad_values, grad_dense = _jd_grads(ctx, grad, products)
        return grad_values, None, grad_dense, None


class _JaggedJaggedBmmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, c, offsets, max_seq_len):
        from kernels._bmm_triton import jagged_jagged_bmm_triton

        ctx.save_for_backward(a, c, offsets)
        ctx.max_seq_len = max_seq_len
        return jagged_jagged_bmm_triton(a, c, offsets, max_seq_len)

    @staticmethod
    def backward(ctx, grad):
        grad_a, grad_c = _jj_grads(ctx, grad, _products("triton", launchers=not torch.is_grad_enabled()))
        return grad_a, grad_c, None, None


# ---- 5. public functions --------------------------------------------------------------------


def jagged_dense_bmm(
    values: torch.Tensor,
    offsets: torch.Tensor,
    dense: torch.Tensor,
    max_seq_len: int,
    *,
    backend: str = "auto",
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
        ``torch.bmm``, and the result has that dtype.
    """
    check_float(values, "values", ndim=2)
    check_float(dense, "dense", ndim=3)
    check_same({"values": values, "dense": dense}, dtype=not _autocast_on(values))
    check_offsets(offsets, total=values.shape[0])
    check_offsets_device(offsets, values)
    check_size(dense, "dense", 0, offsets.shape[0] - 1, "B = len(offsets) - 1")
    check_size(dense, "dense", 1, values.shape[1], "K = values.shape[1]")
    max_seq_len = check_max_seq_len(max_seq_len)
    be = pick_backend(backend, values)
    if eager_triton(be):
        values, dense = autocast_lowp(values, dense)
        if needs_grad(values, dense):
            return _JaggedDenseBmmFn.apply(values, offsets, dense, max_seq_len)
        from kernels._bmm_triton import jagged_dense_bmm_triton

        return jagged_dense_bmm_triton(values, offsets, dense, max_seq_len)
    return torch.ops.jagged.jagged_dense_bmm(values, offsets, dense, max_seq_len, be)


def jagged_jagged_bmm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    *,
    backend: str = "auto",
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
        Under autocast the float inputs are cast to the autocast dtype, like ``torch.bmm``.
    """
    check_float(a, "a", ndim=2)
    check_float(b, "b", ndim=2)
    check_same({"a": a, "b": b}, dtype=not _autocast_on(a))
    check_size(b, "b", 0, a.shape[0], "T = a.shape[0]")
    check_offsets(offsets, total=a.shape[0])
    check_offsets_device(offsets, a)
    max_seq_len = check_max_seq_len(max_seq_len)
    be = pick_backend(backend, a)
    if eager_triton(be):
        a, b = autocast_lowp(a, b)
        if needs_grad(a, b):
            return _JaggedJaggedBmmFn.apply(a, b, offsets, max_seq_len)
        from kernels._bmm_triton import jagged_jagged_bmm_triton

        return jagged_jagged_bmm_triton(a, b, offsets, max_seq_len)
    return torch.ops.jagged.jagged_jagged_bmm(a, b, offsets, max_seq_len, be)


def _autocast_on(t: torch.Tensor) -> bool:
    # Inside an autocast region mixed float dtypes are fine: the autocast kernel casts them.
    return t.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(t.device.type)
