"""The attention providers, ours and every peer, each in its own input layout.

Self-attention (``ATTENTION_PROVIDERS``): jagged (ours, [T, H, D] + offsets); dense_torch and
sdpa_padded_mask, padded [B, H, N, D] with a key mask (the paper's dense attention and dense flash
attention); varlen_attn (FlashAttention-2 varlen); njt_sdpa (nested jagged tensors); flex_packed
(compiled FlexAttention, a document mask over the packed tokens); cudnn_varlen (cuDNN's SDPA on
packed tokens, `nvidia-cudnn-frontend`, when importable). Target attention
(``DENSE_ATTENTION_PROVIDERS``): the same peers with Tq dense queries per sequence."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from experiments.bench.base import OURS, Prepared, Provider, RunConfig, op_kwargs, cuda_only, varlen_fn, varlen_skip
from experiments.bench.layouts import Jagged, from_padded, key_mask, to_padded


def leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().requires_grad_() for t in ts]


def _ours(dense_q: bool):
    """jagged_flash_attention on q [T, H, D], or jagged_dense_attention on q [B, Tq, H, D]."""

    def prepare(j: Jagged, cfg: RunConfig) -> Prepared:
        import kernels

        op = kernels.jagged_dense_attention if dense_q else kernels.jagged_flash_attention
        q, k, v = leaves(j.qd if dense_q else j.q, j.k, j.v)
        # int32 offsets, as varlen_attn's cu_seqlens: the kernels read them natively (no copy)
        offsets, N = j.offsets.to(torch.int32), j.shape.N
        kw = op_kwargs(op, 5, backend=cfg.ours_backend)
        return Prepared(lambda: op(q, k, v, offsets, N, **kw), [q, k, v], [q, k, v, offsets], lambda o: o)

    return prepare


def padded_bhnd(j: Jagged, x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> padded [B, H, N, D] (contiguous), zeros past each length."""
    return to_padded(x, j.pos, j.shape.B, j.shape.N).transpose(1, 2).contiguous()


def dense_torch_attention(q, k, v, mask):  # q [B,H,Nq,D], k/v [B,H,N,D], mask [B,1,1,N]
    s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # [B, H, Nq, N]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def sdpa_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _padded(attend, dense_q: bool):
    """A padded peer: attend(q, k, v, mask) with k, v [B, H, N, D] and a key mask, q padded as
    well ([B, H, N, D]) or the dense queries ([B, H, Tq, D])."""

    def prepare(j: Jagged, cfg: RunConfig) -> Prepared:
        with torch.no_grad():
            q, k, v = (padded_bhnd(j, t) for t in (j.q, j.k, j.v))
        q, k, v = leaves(j.qd.transpose(1, 2).contiguous() if dense_q else q, k, v)
        mask = key_mask(j.lengths, j.shape.N, j.q.device)  # [B, 1, 1, N]
        to_ref = (lambda o: o.transpose(1, 2)) if dense_q else (lambda o: from_padded(o.transpose(1, 2), j.pos))
        return Prepared(lambda: attend(q, k, v, mask), [q, k, v], [q, k, v, mask], to_ref)

    return prepare


def _packed(get_call, dense_q: bool):
    """A peer on packed [T, H, D] tokens, get_call() -> call(q, k, v, cu_q, cu_k, max_q, max_k):
    varlen_attn's signature; target attention: the B x Tq dense queries as B sequences of Tq."""

    def prepare(j: Jagged, cfg: RunConfig) -> Prepared:
        call, (B, Tq, H, D), L = get_call(), (j.shape.B, j.shape.Tq, j.shape.H, j.shape.D), j.max_len
        q, k, v = leaves(j.qd.reshape(B * Tq, H, D) if dense_q else j.q, j.k, j.v)
        cu_k = j.offsets.to(torch.int32)
        cu_q = (torch.arange(B + 1, dtype=torch.int32) * Tq).to(j.q.device) if dense_q else cu_k
        fwd = lambda: call(q, k, v, cu_q, cu_k, Tq if dense_q else L, L)  # noqa: E731
        held = [q, k, v, cu_k] + ([cu_q] if dense_q else [])
        return Prepared(fwd, [q, k, v], held, (lambda o: o.view(B, Tq, H, D)) if dense_q else (lambda o: o))

    return prepare


def _cudnn_call():
    import cudnn  # return_lse: its differentiable path
    return lambda q, k, v, cu_q, cu_k, max_q, max_k: cudnn.sdpa_torch(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k, return_lse=True)[0]


def _njt(j: Jagged, cfg: RunConfig) -> Prepared:
    q, k, v = leaves(j.q, j.k, j.v)
    offsets, L = j.offsets, j.max_len

    def fwd():  # nested_tensor_from_jagged is a view: building it inside keeps autograd to q, k, v
        nq, nk, nv = (
            torch.nested.nested_tensor_from_jagged(t, offsets, max_seqlen=L).transpose(1, 2) for t in (q, k, v)
        )  # [B, H, j, D]
        return F.scaled_dot_product_attention(nq, nk, nv).transpose(1, 2).values()  # [T, H, D]

    return Prepared(fwd, [q, k, v], [q, k, v, offsets], lambda o: o)


# A capture that fails keeps its memory pool for the rest of the process (pytorch/pytorch#190348,
# torch 2.11), and every later row's capture would run out of memory: so no capture is tried.
NO_GRAPH_HOST_SYNC = "not captured: SDPA on nested tensors reads the lengths on the host"

_FLEX = {}


def _flex_fn():
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # one compile per shape (and per grad mode): lift the recompile cap so that dynamo
        # never falls back to eager FlexAttention, which materialises [T, T] scores
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _flex_skip(j: Jagged, cfg: RunConfig) -> str | None:
    reason = cuda_only(j, cfg)
    if reason:
        return reason
    if j.T > cfg.flex_max_tokens:
        return f"skipped (memory/time: T={j.T} > {cfg.flex_max_tokens}, cost grows as T^2)"
    if cfg.flex_spent_s > cfg.flex_budget_s:
        return f"skipped (time: FlexAttention used its {cfg.flex_budget_s:.0f} s budget)"
    return None


def _flex(j: Jagged, cfg: RunConfig) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.repeat_interleave(torch.arange(j.shape.B, dtype=torch.int32), j.lengths).to(j.q.device)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    kw = {"device": j.q.device}
    if "_compile" in inspect.signature(create_block_mask).parameters:
        kw["_compile"] = True  # builds the mask block by block instead of a dense [T, T] grid
    block_mask = create_block_mask(same_doc, None, None, j.T, j.T, **kw)
    with torch.no_grad():
        q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (j.q, j.k, j.v))  # [1, H, T, D]
    q, k, v = leaves(q, k, v)
    flex = _flex_fn()
    held = [q, k, v, doc] + [t for t in block_mask.as_tuple() if isinstance(t, torch.Tensor)]
    return Prepared(lambda: flex(q, k, v, block_mask=block_mask), [q, k, v], held, lambda o: o[0].transpose(0, 1))


def cudnn_skip(j: Jagged, cfg: RunConfig) -> str | None:
    try:
        import cudnn  # noqa: F401  nvidia-cudnn-frontend, a wheel of its own (experiments/gpu/README.md)
    except ImportError:
        return "unavailable (nvidia-cudnn-frontend is not installed)"
    return cuda_only(j, cfg) or (None if j.q.dtype in (torch.float16, torch.bfloat16) else "fp16 and bf16 only")


ATTENTION_PROVIDERS = [
    Provider(OURS, _ours(dense_q=False)),
    Provider("cudnn_varlen", _packed(_cudnn_call, dense_q=False), cudnn_skip),
    Provider("dense_torch", _padded(dense_torch_attention, dense_q=False)),
    Provider("sdpa_padded_mask", _padded(sdpa_attention, dense_q=False)),
    Provider("varlen_attn", _packed(varlen_fn, dense_q=False), varlen_skip),
    Provider("njt_sdpa", _njt, no_graph=NO_GRAPH_HOST_SYNC),
    Provider("flex_packed", _flex, _flex_skip),
]


DENSE_ATTENTION_PROVIDERS = [
    Provider(OURS, _ours(dense_q=True)),
    Provider("sdpa_padded_mask", _padded(sdpa_attention, dense_q=True)),
    Provider("varlen_attn", _packed(varlen_fn, dense_q=True), varlen_skip),
    Provider("cudnn_varlen", _packed(_cudnn_call, dense_q=True), cudnn_skip),
    Provider("dense_torch", _padded(dense_torch_attention, dense_q=True)),
]
