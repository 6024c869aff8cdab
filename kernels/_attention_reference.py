"""Plain-torch references for jagged self-attention and jagged-dense (target) attention.

These are the oracles of the tests, the CPU path of the public functions and a baseline for the
benchmarks. They gather each sequence into a padded [B, N, H, D] block (N = max_seq_len), run
masked softmax attention there in fp32 (fp64 stays fp64, for gradcheck; `upcast=False` runs in
the input dtype: that is "PyTorch's own low-precision error" of the tolerance rule) and scatter
the rows back. Autograd through them gives every input gradient.

Semantics shared with the Triton kernels:
- sequence b owns rows offsets[b]:offsets[b+1]; only its first max_seq_len rows take part; the
  outputs (and gradients) of the rows past max_seq_len are zero;
- a query with no key to attend to (empty sequence, or a row whose every score is -inf through
  the bias) gives a zero output and log-sum-exp -inf, never NaN;
- lse is the natural-log log-sum-exp of the scaled (and biased) scores, in fp32 (fp64 for fp64).
"""

from __future__ import annotations

import math

import torch

_LN_INF = float("-inf")


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if upcast else dtype


def _padded_index(offsets: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [B, N] (index into values, 0 where invalid) and valid [B, N]."""
    off = offsets.to(torch.int64)
    lengths = (off[1:] - off[:-1]).clamp(max=max_seq_len)  # [B]
    pos = torch.arange(max_seq_len, device=off.device)
    valid = pos[None, :] < lengths[:, None]  # [B, N]
    rows = (off[:-1, None] + pos[None, :]).masked_fill(~valid, 0)  # [B, N]
    return rows, valid


def _padded_attention(
    qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor,
    bias: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qp [B, M, H, D], kp, vp [B, N, H, D], mask broadcastable to [B, H, M, N].

    Returns (out [B, M, H, D], p [B, H, M, N], lse [B, H, M]); a row with no key gives out 0,
    p 0 and lse -inf.
    """
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


def _padded_attention_bwd(
    qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, p: torch.Tensor, dop: torch.Tensor,
    dlse: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention backward written out: returns dq, dk, dv (padded layouts) and dS = dbias.

    dP = dO V^T, delta = rowsum(P * dP) (= rowsum(dO * O)) - dlse, dS = P * (dP - delta),
    dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO. Rows whose dO (and dlse) are zero, such as
    padding, contribute nothing.
    """
    dp = torch.einsum("bmhd,bnhd->bhmn", dop, vp)
    delta = (p * dp).sum(dim=-1)  # [B, H, M]
    if dlse is not None:
        delta = delta - dlse
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhmn,bnhd->bmhd", ds, kp) * scale
    dk = torch.einsum("bhmn,bmhd->bnhd", ds, qp) * scale
    dv = torch.einsum("bhmn,bmhd->bnhd", p, dop)
    return dq, dk, dv, ds


def _causal_mask(valid: torch.Tensor, causal: bool) -> torch.Tensor:
    """Key mask [B, 1, N, N] (or [B, 1, 1, N] without causality) from valid [B, N]."""
    mask = valid[:, None, None, :]
    if causal:
        n = valid.shape[1]
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()[None, None]
    return mask


def _scatter_rows(padded: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, total: int):
    """[B, N, ...] -> [total, ...] with the valid rows put back (zeros elsewhere)."""
    out = padded.new_zeros((total, *padded.shape[2:]))
    return out.index_put((rows[valid],), padded[valid])


def _degenerate_zero(*tensors: torch.Tensor | None) -> torch.Tensor:
    # keeps the inputs in the autograd graph so gradients come back as zeros, not None
    return sum((t.sum() * 0).to(torch.float64) for t in tensors if t is not None)


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged self-attention. q, k, v [T, H, D] -> (out [T, H, D] in q's dtype, lse [H, T])."""
    T, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = _compute_dtype(q.dtype, upcast)
    lse_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    N = int(max_seq_len)
    with torch.autocast(q.device.type, enabled=False):
        lse = torch.full((H, T), _LN_INF, dtype=lse_dt, device=q.device)
        if T == 0 or N == 0:
            out = torch.zeros((T, H, D), dtype=cdt, device=q.device) + _degenerate_zero(q, k, v)
            return out.to(q.dtype), lse
        rows, valid = _padded_index(offsets, N)
        o, _, l = _padded_attention(q.to(cdt)[rows], k.to(cdt)[rows], v.to(cdt)[rows],
                                    _causal_mask(valid, causal), None, scale)
        out = _scatter_rows(o, rows, valid, T)
        lse = lse.index_put((torch.arange(H, device=q.device)[:, None], rows[valid][None, :]),
                            l.permute(1, 0, 2)[:, valid].to(lse_dt))
        return out.to(q.dtype), lse


def flash_attention_reference_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash_attention_reference: dout [T, H, D], dlse [H, T] or None."""
    T, H, D = q.shape
    cdt = _compute_dtype(q.dtype, True)
    N = int(max_seq_len)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        if T == 0 or N == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rows, valid = _padded_index(offsets, N)
        qp, kp, vp = (t.to(cdt)[rows] for t in (q, k, v))
        _, p, _ = _padded_attention(qp, kp, vp, _causal_mask(valid, causal), None, scale)
        dop = dout.to(cdt)[rows] * valid[:, :, None, None]  # padding rows carry no gradient
        dlse_p = None
        if dlse is not None:
            dlse_p = dlse.to(cdt)[:, rows].permute(1, 0, 2) * valid[:, None, :]  # [B, H, N]
        grads = _padded_attention_bwd(qp, kp, vp, p, dop, dlse_p, scale)[:3]
        return tuple(_scatter_rows(g, rows, valid, T).to(t.dtype)
                     for g, t in zip(grads, (q, k, v)))


def dense_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense queries over jagged keys. q [B, Tq, H, D], k, v [T, H, D], bias [B, H, Tq, N].

    Returns (out [B, Tq, H, D] in q's dtype, lse [H, B, Tq]).
    """
    B, Tq, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = _compute_dtype(q.dtype, upcast)
    lse_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    N = int(max_seq_len)
    with torch.autocast(q.device.type, enabled=False):
        if k.shape[0] == 0 or N == 0 or B == 0:
            out = torch.zeros((B, Tq, H, D), dtype=cdt, device=q.device)
            out = out + _degenerate_zero(q, k, v, bias)
            lse = torch.full((H, B, Tq), _LN_INF, dtype=lse_dt, device=q.device)
            return out.to(q.dtype), lse
        rows, valid = _padded_index(offsets, N)
        o, _, l = _padded_attention(q.to(cdt), k.to(cdt)[rows], v.to(cdt)[rows],
                                    valid[:, None, None, :],
                                    None if bias is None else bias.to(cdt), scale)
        return o.to(q.dtype).contiguous(), l.permute(1, 0, 2).to(lse_dt).contiguous()


def dense_attention_reference_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    offsets: torch.Tensor, max_seq_len: int, bias: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of dense_attention_reference: dq, dk, dv and dbias (None without bias)."""
    B, Tq, H, D = q.shape
    T = k.shape[0]
    cdt = _compute_dtype(q.dtype, True)
    N = int(max_seq_len)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        dbias = None if bias is None else torch.zeros_like(bias)
        if T == 0 or N == 0 or B == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias
        rows, valid = _padded_index(offsets, N)
        qp, kp, vp = q.to(cdt), k.to(cdt)[rows], v.to(cdt)[rows]
        _, p, _ = _padded_attention(qp, kp, vp, valid[:, None, None, :],
                                    None if bias is None else bias.to(cdt), scale)
        dq, dk, dv, ds = _padded_attention_bwd(qp, kp, vp, p, dout.to(cdt), None, scale)
        dk = _scatter_rows(dk, rows, valid, T).to(k.dtype)
        dv = _scatter_rows(dv, rows, valid, T).to(v.dtype)
        if bias is not None:
            dbias = ds.to(bias.dtype).contiguous()
        return dq.to(q.dtype).contiguous(), dk, dv, dbias
