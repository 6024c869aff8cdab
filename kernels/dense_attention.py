"""Jagged-dense attention: dense queries (e.g. candidate items) over each user's jagged sequence.

The public function :func:`jagged_dense_attention` (its docstring is the spec) over one
autograd.Function and the custom ops ``jagged::dense_attention_fwd``/``_bwd``; kernels in
``kernels._dense_attention_triton``. Double backward: torch backend only (as flash attention)."""

from __future__ import annotations

import math

import torch

from kernels._attention_cpu import dense_attention_torch_bwd, dense_attention_torch_fwd
from kernels._attention_reference import dense_attention_reference_bwd
from kernels._jagged_common import apply, autocast_cast, lazy, pick_backend, register_autocast
from kernels._jagged_common import register_no_double_backward, run
from kernels._validation import check_float, check_head_dim, check_max_seq_len, check_offsets, check_offsets_device
from kernels._validation import FLOAT_DTYPES, check_same, debug_checks_enabled

Tensor = torch.Tensor


# ---- the op: custom ops for tracing, one autograd.Function (kernels._jagged_common.run) ------

_FWD = {"torch": dense_attention_torch_fwd, "triton": lazy("kernels._dense_attention_triton", "dense_attention_fwd")}
_BWD = {"torch": lambda *args: dense_attention_torch_bwd(*args[:-1]),  # it gives dbias whenever there is a bias
        "triton": lazy("kernels._dense_attention_triton", "dense_attention_bwd")}


@torch.library.custom_op("jagged::dense_attention_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, bias: Tensor | None, scale: float,
            backend: str) -> tuple[Tensor, Tensor]:
    return _FWD[backend](q, k, v, offsets, max_seq_len, bias, scale)


@_fwd_op.register_fake
def _(q, k, v, offsets, max_seq_len, bias, scale, backend):
    B, Tq, H, D = q.shape
    return q.new_empty((B, Tq, H, D)), q.new_empty((H, B, Tq), dtype=torch.float32)


@torch.library.custom_op("jagged::dense_attention_bwd", mutates_args=())
def _bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, offsets: Tensor, max_seq_len: int,
            bias: Tensor | None, scale: float, need_dbias: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and dbias (an empty [0] tensor when there is no bias gradient to give)."""
    dq, dk, dv, dbias = _BWD[backend](dout, q, k, v, out, lse, offsets, max_seq_len, bias, scale, need_dbias)
    return dq, dk, dv, (dbias if need_dbias else q.new_empty(0))


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, offsets, max_seq_len, bias, scale, need_dbias, backend):
    dbias = bias.new_empty(bias.shape) if bias is not None and need_dbias else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


register_no_double_backward(_bwd_op, "jagged_dense_attention")
register_autocast("dense_attention_fwd", "lowp")


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, offsets, max_seq_len, bias, scale, backend):
        return run(_fwd_op, _FWD, q, k, v, offsets, max_seq_len, bias, scale, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, offsets, max_seq_len, bias, scale, backend = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)  # internal: the public function returns out only
        ctx.save_for_backward(q, k, v, out, lse, offsets, bias)
        ctx.args = (max_seq_len, scale, backend)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * 8
        q, k, v, out, lse, offsets, bias = ctx.saved_tensors
        max_seq_len, scale, backend = ctx.args
        need_dbias = bias is not None and ctx.needs_input_grad[5]
        args = (dout, q, k, v, out, lse, offsets, max_seq_len, bias, scale, need_dbias, backend)
        if not torch.is_grad_enabled():
            dq, dk, dv, dbias = run(_bwd_op, _BWD, *args)
        elif backend == "torch":  # create_graph=True: the reference's backward, differentiable
            dq, dk, dv, dbias = dense_attention_reference_bwd(dout, q, k, v, offsets, max_seq_len, bias, scale)
        else:  # recorded through the custom op: differentiating its result raises a clear error
            dq, dk, dv, dbias = _bwd_op(*args)
        return dq, dk, dv, None, None, (dbias if need_dbias else None), None, None


# ---- public function ----------------------------------------------------------------------

def _inputs_ok(q, k, v, offsets, max_seq_len, bias) -> bool:
    """True only when every check of _check_inputs passes: a fast accept for the common case;
    anything else goes through the full checks and their messages."""
    try:
        B, Tq, H, D = q.shape
        return (q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
                and k.dim() == 3 and v.dim() == 3 and k.shape[1] == H and k.shape[2] == D
                and v.shape == k.shape and H >= 1 and 16 <= D <= 256 and D % 8 == 0
                and type(max_seq_len) is int and max_seq_len >= 0
                and offsets.dim() == 1 and offsets.dtype in (torch.int64, torch.int32)
                and offsets.shape[0] == B + 1 and offsets.is_cuda and not debug_checks_enabled()
                and q.device == k.device == v.device == offsets.device
                and (bias is None or (bias.dtype in FLOAT_DTYPES and bias.device == q.device
                                      and bias.shape == (B, H, Tq, max_seq_len))))
    except (AttributeError, IndexError, TypeError, ValueError):
        return False


def _check_inputs(q, k, v, offsets, max_seq_len, bias) -> None:
    check_float(q, "q", 4)
    check_float(k, "k", 3)
    check_float(v, "v", 3)
    check_same({"q": q, "k": k, "v": v})
    B, Tq, H, D = q.shape
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape[1:]) != (H, D):
            raise ValueError(f"{name} must be [T, H, D] with q's H = {H} and D = {D}, "
                             f"got shape {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"v must have k's number of rows T = {k.shape[0]}, got {v.shape[0]}")
    if H < 1:
        raise ValueError(f"q must have at least one head (H >= 1), got shape {tuple(q.shape)}")
    check_head_dim(D, "head dim D = q.shape[3]")
    check_offsets(offsets, "offsets", total=k.shape[0])
    check_offsets_device(offsets, k, "offsets")
    if offsets.shape[0] - 1 != B:
        raise ValueError(f"q.shape[0] (B = {B}) must equal len(offsets) - 1 = "
                         f"{offsets.shape[0] - 1}")
    max_seq_len = check_max_seq_len(max_seq_len)
    if bias is not None:
        check_float(bias, "bias", 4)
        check_same({"q": q, "bias": bias}, dtype=False)
        expected = (B, H, Tq, max_seq_len)
        if tuple(bias.shape) != expected:
            raise ValueError(f"bias must be [B, H, Tq, max_seq_len] = {expected} (expand a "
                             f"broadcastable bias first), got {tuple(bias.shape)}")


def jagged_dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    max_seq_len: int,
    *,
    bias: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Dense queries attending over the jagged sequence of their batch element (target attention).

    Args:
        q: ``[B, Tq, H, D]`` queries, e.g. Tq candidate items per user (Tq >= 1).
        k, v: ``[T, H, D]`` jagged keys and values, same dtype and device as q; float32,
            bfloat16 or float16 (float64 on the torch backend); D a multiple of 8 in [16, 256].
            Last dims are made contiguous if they are not; other strides are free.
        offsets: ``[B+1]`` int64 or int32; user b's keys are rows ``offsets[b]:offsets[b+1]``.
        max_seq_len: host int N; only the first N keys of each sequence are attended to (the
            others get zero gradients).
        bias: optional ``[B, H, Tq, N]`` additive score bias, any float dtype and any strides (an
            ``expand``-ed bias is read in place); it receives a gradient. Columns past a
            sequence's length are ignored (their gradient is zero); -inf masks a key.
        scale: score scale, default ``1 / sqrt(D)``.
        backend: ``"torch"`` (reference), ``"triton"`` or ``"auto"`` (Triton on CUDA). Second
            derivatives need ``"torch"``: on Triton they raise a RuntimeError.

    Returns:
        ``out [B, Tq, H, D]`` in q's dtype,
        ``out[b, i] = sum_j softmax_j(scale * q[b, i] . k[j] + bias[b, :, i, j]) v[j]`` over user
        b's keys j; a query with no key (empty sequence, or all keys masked) gives zeros."""
    q, k, v = autocast_cast("lowp", q, k, v)
    if not _inputs_ok(q, k, v, offsets, max_seq_len, bias):
        _check_inputs(q, k, v, offsets, max_seq_len, bias)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    resolved = pick_backend(backend, q)
    if bias is not None:  # as the op's autocast rule casts it
        (bias,) = autocast_cast("lowp", bias)
    return apply(_DenseAttention, q, k, v, offsets, max_seq_len, bias, scale, resolved)[0]
