"""Target-attention providers: Tq dense queries per sequence over its jagged keys and values.

jagged: ``kernels.jagged_dense_attention`` (q [B, Tq, H, D], k/v [T, H, D] + offsets);
sdpa_padded_mask and dense_torch: keys padded to [B, H, N, D] with a mask; varlen_attn: the
queries as B sequences of Tq.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from experiments.bench.base import OURS, Prepared, Provider, RunConfig, op_kwargs, varlen_fn, varlen_skip
from experiments.bench.layouts import Jagged
from experiments.bench.providers import leaves, padded_inputs, dense_torch_attention


def _ours(j: Jagged, cfg: RunConfig) -> Prepared:
    from kernels import jagged_dense_attention

    q, k, v = leaves(j.qd, j.k, j.v)
    offsets, N = j.offsets.to(torch.int32), j.shape.N  # as varlen's cu_seqlens; read natively

    kw = op_kwargs(jagged_dense_attention, 5, backend=cfg.ours_backend)

    def fwd():
        return jagged_dense_attention(q, k, v, offsets, N, **kw)

    return Prepared(fwd, [q, k, v], [q, k, v, offsets], lambda o: o)


def _padded_q(j: Jagged):
    (_, k, v), mask = padded_inputs(j)
    (q,) = leaves(j.qd.transpose(1, 2).contiguous())  # [B, H, Tq, D]
    return q, k, v, mask


def _sdpa(j: Jagged, cfg: RunConfig) -> Prepared:
    q, k, v, mask = _padded_q(j)
    fwd = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    return Prepared(fwd, [q, k, v], [q, k, v, mask], lambda o: o.transpose(1, 2))


def _dense_torch(j: Jagged, cfg: RunConfig) -> Prepared:
    q, k, v, mask = _padded_q(j)
    fwd = lambda: dense_torch_attention(q, k, v, mask)  # noqa: E731
    return Prepared(fwd, [q, k, v], [q, k, v, mask], lambda o: o.transpose(1, 2))


def _varlen(j: Jagged, cfg: RunConfig) -> Prepared:
    varlen_attn = varlen_fn()
    B, Tq = j.shape.B, j.shape.Tq
    q, k, v = leaves(j.qd.reshape(B * Tq, j.shape.H, j.shape.D), j.k, j.v)
    cu_q = (torch.arange(B + 1, dtype=torch.int32) * Tq).to(j.q.device)
    cu_k = j.offsets.to(torch.int32)
    L = j.max_len
    fwd = lambda: varlen_attn(q, k, v, cu_q, cu_k, Tq, L)  # noqa: E731
    return Prepared(fwd, [q, k, v], [q, k, v, cu_q, cu_k], lambda o: o.view(B, Tq, j.shape.H, j.shape.D))


DENSE_ATTENTION_PROVIDERS = [
    Provider(OURS, _ours),
    Provider("sdpa_padded_mask", _sdpa),
    Provider("varlen_attn", _varlen, varlen_skip),
    Provider("dense_torch", _dense_torch),
]
