"""Plain-torch references for jagged self-attention and jagged-dense (target) attention.

The tests' oracles, the CPU path and a benchmark baseline: masked softmax attention on length
buckets (``kernels._segments``) in fp32 (fp64 for gradcheck; ``upcast=False``: the input dtype).
As the kernels: only a sequence's first max_seq_len rows take part (the rest get zeros); a query with
no key gives 0 and lse -inf, never NaN; lse is the natural-log log-sum-exp of the scaled (and biased)
scores, in fp32. More: docs/kernels.md#the-torch-path."""

from __future__ import annotations

import math

import torch

from kernels._jagged_common import compute_dtype
from kernels._segments import by_seq, gather_groups, keep_in_graph, length_groups, scatter_groups

_LN_INF = float("-inf")


def padded_attention(
    qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor,
    bias: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qp [B, M, H, D], kp, vp [B, N, H, D], mask broadcastable to [B, H, M, N].

    Returns (out [B, M, H, D], p [B, H, M, N], lse [B, H, M]); a row with no key gives out 0,
    p 0 and lse -inf."""
    s = torch.einsum("bmhd,bnhd->bhmn", qp, kp) * scale
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~mask, _LN_INF)
    # The shift never changes the result; detaching it keeps the graph simple and exact.
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    has_keys = denom > 0
    denom_safe = torch.where(has_keys, denom, torch.ones_like(denom))
    p = e / denom_safe
    lse = torch.where(has_keys, torch.log(denom_safe) + m, torch.full_like(m, _LN_INF))
    return torch.einsum("bhmn,bnhd->bmhd", p, vp), p, lse.squeeze(-1)


def padded_attention_bwd(
    qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, p: torch.Tensor, dop: torch.Tensor,
    dlse: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention backward written out: returns dq, dk, dv (padded layouts) and dS = dbias.

    dP = dO V^T, delta = rowsum(P * dP) (= rowsum(dO * O)) - dlse, dS = P * (dP - delta),
    dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO. Rows whose dO (and dlse) are zero, such as
    padding, contribute nothing."""
    dp = torch.einsum("bmhd,bnhd->bhmn", dop, vp)
    delta = (p * dp).sum(dim=-1)  # [B, H, M]
    if dlse is not None:
        delta = delta - dlse
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhmn,bnhd->bmhd", ds, kp) * scale
    dk = torch.einsum("bhmn,bmhd->bnhd", ds, qp) * scale
    dv = torch.einsum("bhmn,bmhd->bnhd", p, dop)
    return dq, dk, dv, ds


def attention_mask(valid: torch.Tensor, causal: bool, window: int = -1) -> torch.Tensor:
    """Key mask [G, 1, L, L] (or [G, 1, 1, L] without causality or window) from valid [G, L];
    window >= 0: query i sees keys j with |i - j| <= window (a padded query row sees every real
    key, so that no row is empty; its output is dropped)."""
    mask = valid[:, None, None, :]
    n = valid.shape[1]
    if causal:
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()[None, None]
    if window >= 0:
        pos = torch.arange(n, device=valid.device)
        near = (pos[:, None] - pos[None, :]).abs() <= window  # [L, L]
        mask = mask & (near[None, None] | ~valid[:, None, :, None])
    return mask


def _like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.new_empty((0, *t.shape[1:]), dtype=dtype)  # dtype, device, trailing shape


def _blocks(groups, *tensors) -> list[tuple]:
    """Per group, the padded [G, L, ...] block of each jagged tensor (None stays None)."""
    cols = [[None] * len(groups) if t is None else gather_groups(t, groups) for t in tensors]
    return list(zip(*cols))


def _flash_groups(q, offsets, max_seq_len, cdt, *tensors):
    """(groups, their blocks of `tensors` in cdt); no group when nothing takes part."""
    groups = length_groups(offsets, max_seq_len) if q.shape[0] and max_seq_len else []
    return groups, _blocks(groups, *(None if t is None else t.to(cdt) for t in tensors))


def flash_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int,
    causal: bool = False, scale: float | None = None, upcast: bool = True, window: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged self-attention. q, k, v [T, H, D] -> (out [T, H, D] in q's dtype, lse [H, T]);
    window >= 0: keys within that many places of the query only."""
    T, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = compute_dtype(q.dtype) if upcast else q.dtype
    with torch.autocast(q.device.type, enabled=False):
        groups, blocks = _flash_groups(q, offsets, int(max_seq_len), cdt, q, k, v)
        outs, lses = [], []
        for g, (qp, kp, vp) in zip(groups, blocks):  # [G, L, H, D]
            o, _, lse = padded_attention(qp, kp, vp, attention_mask(g.valid, causal, window), None, scale)
            outs.append(o)
            lses.append(lse.transpose(1, 2))  # [G, L, H]
        out = scatter_groups(outs, groups, T, _like(q, cdt))  # [T, H, D]
        lse = scatter_groups(lses, groups, T, _like(q[:, :, 0], cdt), fill=_LN_INF)  # [T, H]
        if not groups:
            out = out + keep_in_graph(q, k, v)
        return out.to(q.dtype), lse.to(compute_dtype(q.dtype)).t().contiguous()


def flash_attention_reference_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, causal: bool, scale: float, window: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attention_reference: dout [T, H, D], dlse [H, T] or None."""
    T = q.shape[0]
    cdt = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        dlse_t = None if dlse is None else dlse.t()  # [T, H]
        # padding rows of dout (and dlse) are zeros: they carry no gradient
        groups, blocks = _flash_groups(q, offsets, int(max_seq_len), cdt, q, k, v, dout, dlse_t)
        parts: tuple[list, list, list] = ([], [], [])
        for g, (qp, kp, vp, dop, dlse_p) in zip(groups, blocks):
            _, p, _ = padded_attention(qp, kp, vp, attention_mask(g.valid, causal, window), None, scale)
            dlse_p = None if dlse_p is None else dlse_p.transpose(1, 2)  # [G, H, L]
            for acc, grad in zip(parts, padded_attention_bwd(qp, kp, vp, p, dop, dlse_p, scale)):
                acc.append(grad)
        grads = [scatter_groups(acc, groups, T, _like(q, cdt)) for acc in parts]
        if not groups:
            zero = keep_in_graph(dout, dlse, q, k, v)
            grads = [g + zero for g in grads]
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def _dense_groups(q, k, v, offsets, max_seq_len, bias, cdt):
    """(groups, per group (q [G, Tq, H, D], k, v [G, L, H, D], bias [G, H, Tq, L] or None))."""
    B, T = q.shape[0], k.shape[0]
    groups = length_groups(offsets, max_seq_len) if T and max_seq_len and B else []
    qc, bc = q.to(cdt), None if bias is None else bias.to(cdt)
    blocks = [(qc.index_select(0, g.seqs), kp, vp,
               None if bc is None else bc[..., : g.rows.shape[1]].index_select(0, g.seqs))
              for g, (kp, vp) in zip(groups, _blocks(groups, k.to(cdt), v.to(cdt)))]
    return groups, blocks


def dense_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int,
    bias: torch.Tensor | None = None, scale: float | None = None, upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense queries over jagged keys. q [B, Tq, H, D], k, v [T, H, D], bias [B, H, Tq, N].

    Returns (out [B, Tq, H, D] in q's dtype, lse [H, B, Tq])."""
    B, Tq, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = compute_dtype(q.dtype) if upcast else q.dtype
    with torch.autocast(q.device.type, enabled=False):
        groups, blocks = _dense_groups(q, k, v, offsets, int(max_seq_len), bias, cdt)
        outs, lses = [], []
        for g, (qp, kp, vp, bp) in zip(groups, blocks):
            o, _, lse = padded_attention(qp, kp, vp, g.valid[:, None, None, :], bp, scale)
            outs.append(o)
            lses.append(lse)  # [G, H, Tq]
        out = by_seq(outs, groups, (B, Tq, H, D), _like(q, cdt))  # zeros for an empty sequence
        lse = by_seq(lses, groups, (B, H, Tq), _like(q, cdt), fill=_LN_INF)
        if not groups:
            out = out + keep_in_graph(q, k, v, bias)
        return out.to(q.dtype), lse.permute(1, 0, 2).to(compute_dtype(q.dtype)).contiguous()


def dense_attention_reference_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    offsets: torch.Tensor, max_seq_len: int, bias: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of dense_attention_reference: dq, dk, dv and dbias (None without bias)."""
    T = k.shape[0]
    cdt = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        groups, blocks = _dense_groups(q, k, v, offsets, int(max_seq_len), bias, cdt)
        doc = dout.to(cdt)
        # columns past a sequence's length (and past its group's L) keep a zero gradient
        dbias = None if bias is None else bias.new_zeros(bias.shape, dtype=cdt)
        parts: tuple[list, list, list] = ([], [], [])
        for g, (qp, kp, vp, bp) in zip(groups, blocks):
            _, p, _ = padded_attention(qp, kp, vp, g.valid[:, None, None, :], bp, scale)
            *grads, ds = padded_attention_bwd(qp, kp, vp, p, doc.index_select(0, g.seqs), None, scale)
            for acc, grad in zip(parts, grads):
                acc.append(grad)
            if dbias is not None:
                dbias[g.seqs, :, :, : g.rows.shape[1]] = ds
        dq = by_seq(parts[0], groups, tuple(q.shape), _like(q, cdt))
        dk, dv = (scatter_groups(d, groups, T, _like(k, cdt)) for d in parts[1:])
        if not groups:
            zero = keep_in_graph(dout, q, k, v, bias)
            dq, dk, dv = dq + zero, dk + zero, dv + zero
        dbias = None if dbias is None else dbias.to(bias.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias
