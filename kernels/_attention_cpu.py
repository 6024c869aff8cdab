"""The torch backend of both attention ops: torch's fused CPU attention kernel per length bucket.

The references' math (``kernels._attention_reference``) through
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, on the length buckets of
``kernels._segments``, in fp32 (fp64 stays fp64). The references do the work where that kernel does
not fit: CUDA tensors, a bias, a gradient of lse, a float64 backward (docs/kernels.md)."""

from __future__ import annotations

import torch

from kernels._attention_reference import (attention_mask, dense_attention_reference, dense_attention_reference_bwd,
                                          flash_attention_reference, flash_attention_reference_bwd)
from kernels._jagged_common import compute_dtype
from kernels._segments import Group, by_seq, gather_groups, length_groups, scatter_groups

_NEG_INF = float("-inf")
_FUSED = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def _fused_fits(t: torch.Tensor) -> bool:
    return _FUSED and t.device.type == "cpu"


def _fused_fwd(q, k, v, mask, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _fused_bwd(dout, q, k, v, out, lse, mask, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _key_mask(g: Group, dtype: torch.dtype) -> torch.Tensor:
    """[G, 1, 1, L] additive mask: 0 at a sequence's keys, -inf at its padding."""
    mask = torch.zeros(g.pad.shape, dtype=dtype, device=g.pad.device)
    return mask.masked_fill_(g.pad, _NEG_INF)[:, None, None, :]


def _heads_first(groups: list[Group], *tensors: torch.Tensor, zero_pad: bool = False) -> list[tuple]:
    """Per group, each [T, H, ...] tensor's padded block as [G, H, L, ...]. The padding of q, k,
    v, out and lse is masked (keys) or dropped (queries), so it only repeats a row of the same
    sequence; dout's must be zeros (a padded query row carries no gradient)."""
    cols = [[b.transpose(1, 2) for b in gather_groups(t, groups, zero_pad)] for t in tensors]
    return list(zip(*cols))


def _flash_mask(g: Group, causal: bool, dtype: torch.dtype, window: int = -1) -> torch.Tensor | None:
    # causal: query i < length sees keys 0..i, all real, so the causal flag alone masks enough
    # (padded query rows are dropped and carry a zero gradient)
    if window >= 0:  # the reference's boolean mask as an additive one
        keep = attention_mask(g.valid, False, window)  # [G, 1, L, L]; causality by the flag
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, _NEG_INF)
    return None if causal else _key_mask(g, dtype)


def flash_attention_torch_fwd(q, k, v, offsets, max_seq_len, causal, scale, window=-1):
    """(out [T, H, D] in q's dtype, lse [H, T] fp32), as the reference computes them."""
    if not _fused_fits(q):
        with torch.no_grad():
            out, lse = flash_attention_reference(q, k, v, offsets, max_seq_len, causal, scale, window=window)
        return out, lse.to(torch.float32)
    T = q.shape[0]
    cdt = compute_dtype(q.dtype)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        groups = length_groups(offsets, max_seq_len) if T and max_seq_len else []
        qc, kc, vc = (t.to(cdt) for t in (q, k, v))
        outs, lses = [], []
        for g, qkv in zip(groups, _heads_first(groups, qc, kc, vc)):
            o, lse = _fused_fwd(*qkv, _flash_mask(g, causal, cdt, window), causal, scale)
            outs.append(o.transpose(1, 2))  # [G, L, H, D]
            lses.append(lse.transpose(1, 2))  # [G, L, H]
        out = scatter_groups(outs, groups, T, qc)
        lse = scatter_groups(lses, groups, T, qc[:, :, 0], fill=_NEG_INF)  # [T, H]
        return out.to(q.dtype), lse.to(torch.float32).t().contiguous()


def flash_attention_torch_bwd(dout, dlse, q, k, v, out, lse, offsets, max_seq_len, causal, scale, window=-1):
    """dq, dk, dv of flash_attention_torch_fwd from its saved out and lse."""
    if not _fused_fits(q) or dlse is not None or q.dtype == torch.float64:
        with torch.no_grad():
            return flash_attention_reference_bwd(dout, dlse, q, k, v, offsets, max_seq_len,
                                                 causal, scale, window)
    T = q.shape[0]
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        groups = length_groups(offsets, max_seq_len) if T and max_seq_len else []
        qc, kc, vc, oc, dc = (t.float() for t in (q, k, v, out, dout))
        lse_t = lse.t()  # [T, H]
        parts: tuple[list, list, list] = ([], [], [])
        dout_blocks = _heads_first(groups, dc, zero_pad=True)
        for g, (dop,), blocks in zip(groups, dout_blocks, _heads_first(groups, qc, kc, vc, oc, lse_t)):
            grads = _fused_bwd(dop, *blocks, _flash_mask(g, causal, torch.float32, window), causal, scale)
            for acc, grad in zip(parts, grads):
                acc.append(grad.transpose(1, 2))  # [G, L, H, D]
        return tuple(scatter_groups(acc, groups, T, qc).to(t.dtype)
                     for acc, t in zip(parts, (q, k, v)))


def _dense_groups(q, k, offsets, max_seq_len):
    B, T = q.shape[0], k.shape[0]
    return length_groups(offsets, max_seq_len) if T and max_seq_len and B else []


def dense_attention_torch_fwd(q, k, v, offsets, max_seq_len, bias, scale):
    """(out [B, Tq, H, D] in q's dtype, lse [H, B, Tq] fp32), as the reference computes them."""
    if not _fused_fits(q) or bias is not None:
        with torch.no_grad():
            out, lse = dense_attention_reference(q, k, v, offsets, max_seq_len, bias, scale)
        return out, lse.to(torch.float32)
    B, Tq, H, D = q.shape
    cdt = compute_dtype(q.dtype)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        groups = _dense_groups(q, k, offsets, max_seq_len)
        qc, kc, vc = (t.to(cdt) for t in (q, k, v))
        outs, lses = [], []
        for g, (kp, vp) in zip(groups, _heads_first(groups, kc, vc)):
            qp = qc.index_select(0, g.seqs).transpose(1, 2)  # [G, H, Tq, D]
            o, lse = _fused_fwd(qp, kp, vp, _key_mask(g, cdt), False, scale)
            outs.append(o.transpose(1, 2))  # [G, Tq, H, D]
            lses.append(lse)  # [G, H, Tq]
        out = by_seq(outs, groups, (B, Tq, H, D), qc)  # zeros for an empty sequence
        lse = by_seq(lses, groups, (B, H, Tq), qc, fill=_NEG_INF)
        return out.to(q.dtype), lse.permute(1, 0, 2).to(torch.float32).contiguous()


def dense_attention_torch_bwd(dout, q, k, v, out, lse, offsets, max_seq_len, bias, scale):
    """dq, dk, dv and dbias (None without a bias) of dense_attention_torch_fwd."""
    if not _fused_fits(q) or bias is not None or q.dtype == torch.float64:
        with torch.no_grad():
            return dense_attention_reference_bwd(dout, q, k, v, offsets, max_seq_len, bias, scale)
    T = k.shape[0]
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        groups = _dense_groups(q, k, offsets, max_seq_len)
        qc, kc, vc, oc, dc = (t.float() for t in (q, k, v, out, dout))
        lse_b = lse.permute(1, 0, 2)  # [B, H, Tq]
        dqs, dks, dvs = [], [], []
        for g, (kp, vp) in zip(groups, _heads_first(groups, kc, vc)):
            per_seq = (t.index_select(0, g.seqs) for t in (dc, qc, oc))
            dop, qp, op = (t.transpose(1, 2) for t in per_seq)  # [G, H, Tq, D]
            dq, dk, dv = _fused_bwd(dop, qp, kp, vp, op, lse_b.index_select(0, g.seqs),
                                    _key_mask(g, torch.float32), False, scale)
            dqs.append(dq.transpose(1, 2))
            dks.append(dk.transpose(1, 2))
            dvs.append(dv.transpose(1, 2))
        dq = by_seq(dqs, groups, tuple(q.shape), qc)
        dk, dv = scatter_groups(dks, groups, T, kc), scatter_groups(dvs, groups, T, vc)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
