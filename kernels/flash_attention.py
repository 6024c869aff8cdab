"""Jagged flash attention: softmax self-attention within each sequence of a jagged batch.

The public function :func:`jagged_flash_attention` (its docstring is the spec) over one
autograd.Function and the custom ops ``jagged::flash_attention_fwd``/``_bwd``; kernels in
``kernels._flash_attention_triton``, the torch path in ``kernels._attention_reference`` and
``kernels._attention_cpu``. Double backward: torch backend only (Triton raises; docs/kernels.md)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from kernels._attention_cpu import flash_attention_torch_bwd, flash_attention_torch_fwd
from kernels._attention_reference import flash_attention_reference_bwd
from kernels._jagged_common import apply, autocast_cast, lazy, pick_backend, register_autocast
from kernels._jagged_common import register_no_double_backward, run
from kernels._validation import check_float, check_head_dim, check_max_seq_len, check_offsets, check_offsets_device
from kernels._validation import FLOAT_DTYPES, check_same, debug_checks_enabled
from kernels.s2 import S2Shards, s2_attention_reference

Tensor = torch.Tensor


# ---- the op: custom ops for tracing, one autograd.Function (kernels._jagged_common.run) ------

_FWD = {"torch": flash_attention_torch_fwd, "triton": lazy("kernels._flash_attention_triton", "flash_attention_fwd")}
_BWD = {"torch": flash_attention_torch_bwd, "triton": lazy("kernels._flash_attention_triton", "flash_attention_bwd")}


@torch.library.custom_op("jagged::flash_attention_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, causal: bool, scale: float,
            window: int, backend: str) -> tuple[Tensor, Tensor]:
    return _FWD[backend](q, k, v, offsets, max_seq_len, causal, scale, window)


@_fwd_op.register_fake
def _(q, k, v, offsets, max_seq_len, causal, scale, window, backend):
    T, H, D = q.shape
    return q.new_empty((T, H, D)), q.new_empty((H, T), dtype=torch.float32)


@torch.library.custom_op("jagged::flash_attention_bwd", mutates_args=())
def _bwd_op(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
            offsets: Tensor, max_seq_len: int, causal: bool, scale: float, window: int,
            backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _BWD[backend](dout, dlse, q, k, v, out, lse, offsets, max_seq_len, causal, scale, window)


_bwd_op.register_fake(lambda dout, dlse, q, k, v, *_: tuple(t.new_empty(t.shape) for t in (q, k, v)))
register_no_double_backward(_bwd_op, "jagged_flash_attention")
# Under autocast the op runs in the autocast dtype, like torch's own attention.
register_autocast("flash_attention_fwd", "lowp")


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, offsets, max_seq_len, causal, scale, window, backend):
        return run(_fwd_op, _FWD, q, k, v, offsets, max_seq_len, causal, scale, window, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, offsets, max_seq_len, causal, scale, window, backend = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, offsets)
        ctx.args = (max_seq_len, causal, scale, window, backend)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 9
        q, k, v, out, lse, offsets = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        max_seq_len, causal, scale, window, backend = ctx.args
        if not torch.is_grad_enabled():
            dq, dk, dv = run(_bwd_op, _BWD, dout, dlse, q, k, v, out, lse, offsets, *ctx.args)
        elif backend == "torch":  # create_graph=True: the reference's backward, differentiable
            dq, dk, dv = flash_attention_reference_bwd(dout, dlse, q, k, v, offsets, max_seq_len, causal, scale,
                                                       window)
        else:  # recorded through the custom op: differentiating its result raises a clear error
            dq, dk, dv = _bwd_op(dout, dlse, q, k, v, out, lse, offsets, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


# ---- public function ----------------------------------------------------------------------

def _inputs_ok(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int) -> bool:
    """True only when every check of _check_inputs passes: a fast accept (a few microseconds)
    for the common case; anything else goes through the full checks and their messages."""
    try:
        D = q.shape[2]
        return (q.dim() == 3 and q.dtype in FLOAT_DTYPES and k.dtype == q.dtype
                and v.dtype == q.dtype and k.shape == q.shape and v.shape == q.shape
                and q.shape[1] >= 1 and 16 <= D <= 256 and D % 8 == 0
                and type(max_seq_len) is int and max_seq_len >= 0
                and offsets.dim() == 1 and offsets.dtype in (torch.int64, torch.int32)
                and offsets.shape[0] >= 1 and offsets.is_cuda and not debug_checks_enabled()
                and q.device == k.device == v.device == offsets.device)
    except (AttributeError, IndexError, TypeError):
        return False


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(t, name, 3)
    check_same({"q": q, "k": k, "v": v})
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape [T, H, D] = {tuple(q.shape)}, "
                             f"got {tuple(t.shape)}")
    if q.shape[1] < 1:
        raise ValueError(f"q must have at least one head (H >= 1), got shape {tuple(q.shape)}")
    check_head_dim(q.shape[2], "head dim D = q.shape[2]")
    check_offsets(offsets, "offsets", total=q.shape[0])
    check_offsets_device(offsets, q, "offsets")
    check_max_seq_len(max_seq_len)


def jagged_flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    max_seq_len: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    shards: S2Shards | None = None,
    window: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention within each sequence of a jagged batch (FlashAttention-2 on the GPU).

    Args:
        q, k, v: ``[T, H, D]`` float32, bfloat16 or float16 (float64 on the torch backend), same
            dtype and device; T = total rows, H >= 1 heads, D a multiple of 8 in [16, 256].
            The last dim must be contiguous (it is made so otherwise); other strides are free,
            so slices of a fused qkv projection need no copy.
        offsets: ``[B+1]`` int64 or int32; sequence b is rows ``offsets[b]:offsets[b+1]``.
        max_seq_len: host int; only the first ``max_seq_len`` rows of each sequence take part,
            the outputs and gradients of the other rows are zero.
        causal: query i attends to keys j <= i (positions within its sequence).
        scale: score scale, default ``1 / sqrt(D)``.
        return_lse: also return ``lse [H, T]`` fp32, the natural-log log-sum-exp of each query
            row's scaled scores (-inf for rows that do not take part); it is differentiable.
        backend: ``"torch"`` (reference), ``"triton"`` or ``"auto"`` (Triton on CUDA). Second
            derivatives (differentiating the gradients of ``create_graph=True``) need ``"torch"``:
            on Triton they raise a RuntimeError.
        shards: an ``S2Shards`` layout (kernels/s2.py): each head sees only its strided key
            blocks plus the local window. None (default): every key. Without ``return_lse``;
            the torch backend runs the masked reference (differentiable twice), Triton its own
            kernels (kernels/_s2_attention_triton.py; no double backward; under torch.compile
            the custom ops ``jagged::s2_attention_fwd`` / ``_bwd``, no graph break).
        window: query i attends only to keys j with ``|i - j| <= window`` (and ``j <= i`` if
            causal): a sliding window, whose kernels visit only the key blocks it reaches.
            None (default): every key. Not with ``shards``.

    Returns:
        ``out [T, H, D]`` in the inputs' dtype, with
        ``out[t] = sum_j softmax_j(scale * q[t] . k[j]) v[j]`` over the keys j of t's sequence;
        ``(out, lse)`` when ``return_lse``."""
    if q.dtype != torch.float64:
        # under autocast the registered rule casts inside the op; casting here too keeps the
        # checks below (same dtype for q, k, v) meaningful for mixed inputs under autocast
        q, k, v = autocast_cast("lowp", q, k, v)
    if not _inputs_ok(q, k, v, offsets, max_seq_len):
        _check_inputs(q, k, v, offsets, max_seq_len)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None and (type(window) is not int or window < 0):
        raise ValueError(f"window must be an int >= 0 (or None: every key), got {window!r}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    resolved = pick_backend(backend, q)
    if shards is not None:
        if window is not None:
            raise ValueError("jagged_flash_attention: window and shards are two sparsity patterns; pass one")
        return _s2(q, k, v, offsets, max_seq_len, causal, scale, return_lse, resolved, shards)
    out, lse = apply(_FlashAttention, q, k, v, offsets, max_seq_len, causal, scale,
                     -1 if window is None else window, resolved)
    return (out, lse) if return_lse else out


def _s2(q, k, v, offsets, max_seq_len, causal, scale, return_lse, resolved, shards) -> Tensor:
    if not isinstance(shards, S2Shards):
        raise TypeError(f"shards must be a kernels.S2Shards, got {type(shards).__name__}")
    heads = shards.offsets_for(q.shape[1])  # head_offsets of the wrong length raise here
    if return_lse:
        raise NotImplementedError("jagged_flash_attention: return_lse is not available with shards")
    if resolved == "torch":
        return s2_attention_reference(q, k, v, offsets, max_seq_len, shards, causal, scale)
    return apply(_S2Attention, q, k, v, offsets, max_seq_len, shards.block, shards.local_blocks, shards.stride,
                 list(heads), causal, scale, resolved)[0]


# ---- S2 on Triton: the same route, the layout passed as ints (a custom op takes no S2Shards) ----


def _s2_triton(name: str) -> Callable:
    """The S2 launcher `name` of kernels._s2_attention_triton, given the layout as its ints."""
    launcher = lazy("kernels._s2_attention_triton", name)

    def call(*args):
        *tensors, max_seq_len, block, local_blocks, stride, heads, causal, scale = args
        return launcher(*tensors, max_seq_len, S2Shards(block, local_blocks, stride, tuple(heads)), causal, scale)

    return call


_S2_FWD, _S2_BWD = {"triton": _s2_triton("s2_attention_fwd")}, {"triton": _s2_triton("s2_attention_bwd")}


@torch.library.custom_op("jagged::s2_attention_fwd", mutates_args=())
def _s2_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, block: int, local_blocks: int,
    stride: int, heads: list[int], causal: bool, scale: float, backend: str,
) -> tuple[Tensor, Tensor]:
    return _S2_FWD[backend](q, k, v, offsets, max_seq_len, block, local_blocks, stride, heads, causal, scale)


@torch.library.custom_op("jagged::s2_attention_bwd", mutates_args=())
def _s2_bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor, offsets: Tensor, max_seq_len: int,
    block: int, local_blocks: int, stride: int, heads: list[int], causal: bool, scale: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return _S2_BWD[backend](dout, q, k, v, out, lse2, offsets, max_seq_len, block, local_blocks, stride, heads,
                           causal, scale)


_s2_fwd_op.register_fake(lambda q, *_: (q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)))
_s2_bwd_op.register_fake(lambda dout, q, k, v, *_: tuple(t.new_empty(t.shape) for t in (q, k, v)))
register_no_double_backward(_s2_bwd_op, "jagged_flash_attention (shards)")
register_autocast("s2_attention_fwd", "lowp")


class _S2Attention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, offsets, max_seq_len, block, local_blocks, stride, heads, causal, scale, backend):
        return run(_s2_fwd_op, _S2_FWD, q, k, v, offsets, max_seq_len, block, local_blocks, stride, heads, causal,
                   scale, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, offsets, *args = inputs
        out, lse2 = output
        ctx.mark_non_differentiable(lse2)  # internal: the public function returns out only
        ctx.save_for_backward(q, k, v, out, lse2, offsets)
        ctx.args = args  # max_seq_len, block, local_blocks, stride, heads, causal, scale, backend
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse2):
        if dout is None:
            return (None,) * 12
        q, k, v, out, lse2, offsets = ctx.saved_tensors
        args = (dout, q, k, v, out, lse2, offsets, *ctx.args)
        if torch.is_grad_enabled():  # recorded through the custom op: differentiating it raises a clear error
            dq, dk, dv = _s2_bwd_op(*args)
        else:
            dq, dk, dv = run(_s2_bwd_op, _S2_BWD, *args)
        return (dq, dk, dv) + (None,) * 9
