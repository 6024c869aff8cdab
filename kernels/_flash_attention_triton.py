"""Triton kernels and launchers for jagged self-attention (FlashAttention-2 on jagged rows).

Layout: q, k, v, out [T, H, D] (last dim contiguous, any row/head strides); offsets [B+1];
lse and delta [H, T] fp32. Sequence b is rows offsets[b]:offsets[b+1]; only its first
L_b = min(len_b, max_seq_len) rows take part, the others get zeros (lse -inf).

Work partitioning (FA2): the forward and the dQ pass run one program per (query block, sequence,
head); the dK/dV pass one per (key block, sequence, head), looping over the query blocks, so no
program writes what another writes: no atomics anywhere. A tiny pre-pass computes
delta = rowsum(dO * O) (minus dlse when lse itself has a gradient). The grid is 1-D over
num_blocks(max_seq_len) x B x H, head fastest (the heads of one token sit side by side in
memory); a program whose block starts past its sequence's length only zeroes its share of the
truncated tail (rows past max_seq_len, usually none) and exits.

Numerics: scores are prescaled by scale * log2(e) so the softmax uses exp2; the running max,
the running sum, the accumulators and lse are fp32; P and dS are cast to the input dtype only as
MMA operands (as FA2 does). fp32 inputs use IEEE dots unless torch allows TF32 matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import interpreter_on
from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import _zero_rows, dot_precision

LOG2E = 1.4426950408889634


def _patch_interpreter_bf16_dot() -> None:
    """TRITON_INTERPRET only: triton 3.6's interpreter multiplies bf16 tiles as their raw uint16
    bits (np.matmul on the storage); widen them to fp32 first (exact), as the GPU MMA does."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_jagged_bf16_dot", False):
        return
    create_dot = builder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = patched
    builder._jagged_bf16_dot = True


# ---- kernels ------------------------------------------------------------------------------
# Sizes that change from batch to batch are not specialised on (no recompile per batch shape).
_NO_SPEC = ["stride_lh", "max_seq_len", "num_heads", "num_seqs", "num_m_blocks", "num_n_blocks"]


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, seq_len,
    offs_m, offs_n, offs_d, d_ok, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi); MASKED blocks check length (and causality)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # [BN]
        kv_ok = d_ok[None, :]
        if MASKED:
            kv_ok = kv_ok & (cols[:, None] < seq_len)
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BM, BN], log2 units
        if MASKED:
            ok = cols[None, :] < seq_len
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None])
            s = tl.where(ok, s, float("-inf"))
        # every row has seen a finite score by now (column 0 is never masked for a real row),
        # so m_new is finite and exp2 never sees (-inf) - (-inf)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_NO_SPEC[:5])
def _flash_fwd_kernel(
    Q, K, V, O, LSE, Offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lh, qk_scale, max_seq_len, num_heads, num_seqs, num_m_blocks,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (sequence, head) against all its keys."""
    pid = tl.program_id(0)
    h = pid % num_heads
    b = (pid // num_heads) % num_seqs
    m_blk = pid // (num_heads * num_seqs)
    seq_start = tl.load(Offsets + b).to(tl.int64)
    n_rows = (tl.load(Offsets + b + 1).to(tl.int64) - seq_start).to(tl.int32)
    seq_len = tl.minimum(n_rows, max_seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    o_base = O + seq_start * stride_ot + h * stride_oh
    lse_base = LSE + h * stride_lh + seq_start
    if n_rows > max_seq_len:  # truncated tail: zeros, lse -inf (grid-strided over m blocks)
        _zero_rows(o_base, stride_ot, 1, max_seq_len, n_rows, offs_d, d_ok, m_blk, num_m_blocks,
                   BLOCK_M, BLOCK_D)
        offs_r = tl.arange(0, BLOCK_M)
        for r0 in range(max_seq_len + m_blk * BLOCK_M, n_rows, num_m_blocks * BLOCK_M):
            tl.store(lse_base + r0 + offs_r, tl.full([BLOCK_M], float("-inf"), tl.float32),
                     mask=r0 + offs_r < n_rows)
    start_m = m_blk * BLOCK_M
    if start_m >= seq_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < seq_len
    q = tl.load(Q + seq_start * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt
                + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + seq_start * stride_kt + h * stride_kh
    v_base = V + seq_start * stride_vt + h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # stage 1: key blocks that need no mask; stage 2: the diagonal / ragged-end blocks
    if CAUSAL:
        lo = start_m  # BLOCK_M is a multiple of BLOCK_N, so [0, start_m) is whole blocks
        hi = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        lo = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, lo,
                               seq_len, offs_m, offs_n, offs_d, d_ok, qk_scale,
                               BLOCK_N, False, False, DOT_PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi,
                               seq_len, offs_m, offs_n, offs_d, d_ok, qk_scale,
                               BLOCK_N, True, CAUSAL, DOT_PREC)
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_base + offs_m, lse, mask=m_ok)


@triton.jit(do_not_specialize=["num_rows", "stride_dh"])
def _attn_bwd_preprocess_kernel(
    O, DO, DLSE, DELTA, num_rows, stride_ot, stride_oh, stride_dot, stride_doh, stride_dh,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """One program: delta[h, rows] = rowsum(dO * O) - dlse for BLOCK_R rows of one head."""
    h = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    mask = r_ok[:, None] & (offs_d[None, :] < HEAD_D)
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:  # d lse / d s = P, so a gradient on lse folds into delta
        delta -= tl.load(DLSE + h * stride_dh + rows, mask=r_ok, other=0.0)
    tl.store(DELTA + h * stride_dh + rows, delta, mask=r_ok)


@triton.jit(do_not_specialize=_NO_SPEC[:4] + _NO_SPEC[5:])
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, Offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    qk_scale, sm_scale, max_seq_len, num_heads, num_seqs, num_n_blocks,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: dK, dV of BLOCK_N key rows of one (sequence, head), over its query blocks."""
    pid = tl.program_id(0)
    h = pid % num_heads
    b = (pid // num_heads) % num_seqs
    n_blk = pid // (num_heads * num_seqs)
    seq_start = tl.load(Offsets + b).to(tl.int64)
    n_rows = (tl.load(Offsets + b + 1).to(tl.int64) - seq_start).to(tl.int32)
    seq_len = tl.minimum(n_rows, max_seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    dk_base = DK + seq_start * stride_dkt + h * stride_dkh
    dv_base = DV + seq_start * stride_dvt + h * stride_dvh
    if n_rows > max_seq_len:
        _zero_rows(dk_base, stride_dkt, 1, max_seq_len, n_rows, offs_d, d_ok, n_blk,
                   num_n_blocks, BLOCK_N, BLOCK_D)
        _zero_rows(dv_base, stride_dvt, 1, max_seq_len, n_rows, offs_d, d_ok, n_blk,
                   num_n_blocks, BLOCK_N, BLOCK_D)
    start_n = n_blk * BLOCK_N
    if start_n >= seq_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_mask = (offs_n[:, None] < seq_len) & d_ok[None, :]
    k = tl.load(K + seq_start * stride_kt + h * stride_kh + offs_n[:, None] * stride_kt
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + seq_start * stride_vt + h * stride_vh + offs_n[:, None] * stride_vt
                + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    q_base = Q + seq_start * stride_qt + h * stride_qh
    do_base = DO + seq_start * stride_dot + h * stride_doh
    lse_base = LSE + h * stride_lh + seq_start
    delta_base = DELTA + h * stride_lh + seq_start
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, seq_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < seq_len
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask,
                     other=0.0)
        # rows past the sequence get lse = +inf, hence P = 0: no extra mask on the query side
        lse2 = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BN, BM]
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # [BN, BM]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    tl.store(dk_base + offs_n[:, None] * stride_dkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_base + offs_n[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=_NO_SPEC[:5])
def _flash_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, Offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    qk_scale, sm_scale, max_seq_len, num_heads, num_seqs, num_m_blocks,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: dQ of BLOCK_M query rows of one (sequence, head), over its key blocks."""
    pid = tl.program_id(0)
    h = pid % num_heads
    b = (pid // num_heads) % num_seqs
    m_blk = pid // (num_heads * num_seqs)
    seq_start = tl.load(Offsets + b).to(tl.int64)
    n_rows = (tl.load(Offsets + b + 1).to(tl.int64) - seq_start).to(tl.int32)
    seq_len = tl.minimum(n_rows, max_seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    dq_base = DQ + seq_start * stride_dqt + h * stride_dqh
    if n_rows > max_seq_len:
        _zero_rows(dq_base, stride_dqt, 1, max_seq_len, n_rows, offs_d, d_ok, m_blk,
                   num_m_blocks, BLOCK_M, BLOCK_D)
    start_m = m_blk * BLOCK_M
    if start_m >= seq_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seq_len
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + seq_start * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt
                + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + seq_start * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot
                 + offs_d[None, :], mask=q_mask, other=0.0)
    lse2 = tl.load(LSE + h * stride_lh + seq_start + offs_m, mask=m_ok,
                   other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + h * stride_lh + seq_start + offs_m, mask=m_ok, other=0.0)
    k_base = K + seq_start * stride_kt + h * stride_kh
    v_base = V + seq_start * stride_vt + h * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, seq_len) if CAUSAL else seq_len
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BM, BN]
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(ok, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # [BM, BN]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    tl.store(dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# ---- block-size heuristics ----------------------------------------------------------------
# Hand-picked per head dim for now (issue 4 autotunes them, keyed on head dim and length).


def _interpreting() -> bool:
    if interpreter_on():
        _patch_interpreter_bf16_dot()
        return True
    return False


def fwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """BLOCK_M, BLOCK_N (BLOCK_M % BLOCK_N == 0), num_warps, num_stages for the forward.

    Picked so that ptxas reports no (or few) spills for sm_90 (``python -m kernels.gpu_check
    --ptxas``); fp32 inputs use IEEE FMA dots, whose tiles must stay small.
    """
    if _interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    bd = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        bm, bn, warps, stages = (64, 32, 8, 1) if bd <= 64 else (16, 16, 4, 1)
    elif bd <= 128:
        bm, bn, warps, stages = 128, 64, 8, 3
    else:
        bm, bn, warps, stages = 128, 32, 8, 3
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def bwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Block sizes of the dK/dV pass (M_KV, N_KV) and of the dQ pass (M_Q, N_Q)."""
    if _interpreting():
        return dict(M_KV=16, N_KV=16, M_Q=16, N_Q=16, num_warps=4, num_stages=1)
    bd = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        m_kv, n_kv, m_q, n_q, warps, stages = (
            (32, 32, 32, 32, 8, 1) if bd <= 64 else
            (16, 32, 32, 16, 4, 1) if bd <= 128 else (16, 16, 16, 16, 4, 1))
    elif bd <= 64:
        m_kv, n_kv, m_q, n_q, warps, stages = 64, 64, 64, 64, 4, 2
    elif bd <= 128:
        m_kv, n_kv, m_q, n_q, warps, stages = 32, 64, 64, 32, 8, 2
    else:
        m_kv, n_kv, m_q, n_q, warps, stages = 32, 32, 32, 32, 8, 1
    return dict(M_KV=m_kv, N_KV=n_kv, M_Q=m_q, N_Q=n_q, num_warps=warps, num_stages=stages)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ---- launchers ----------------------------------------------------------------------------


def flash_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
    max_seq_len: int, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, D] (q's dtype), lse [H, T] fp32. Inputs already validated by the caller."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    T, H, D = q.shape
    B = offsets.numel() - 1
    out = new_output((T, H, D), q)
    lse = new_output((H, T), q.new_empty(0, dtype=torch.float32))
    if B == 0 or T == 0:
        return out, lse
    cfg = fwd_config(D, q.dtype)
    num_m = max(triton.cdiv(max_seq_len, cfg["BLOCK_M"]), 1)
    grid = (num_m * B * H,)
    with device_guard(q):
        _flash_fwd_kernel[grid](
            q, k, v, out, lse, offsets,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            scale * LOG2E, max_seq_len, H, B, num_m,
            HEAD_D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, DOT_PREC=dot_precision(q.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out, lse


def attention_bwd_delta(
    out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
) -> torch.Tensor:
    """delta [H, R] fp32 = rowsum(dout * out) - dlse; out, dout [R, H, D], last dim contiguous."""
    R, H, D = out.shape
    delta = torch.empty((H, R), dtype=torch.float32, device=out.device)
    if R == 0:
        return delta
    block_r = 16 if _interpreting() else 64
    has_dlse = dlse is not None
    if has_dlse:
        dlse = dlse.to(torch.float32).contiguous()
    with device_guard(out):
        _attn_bwd_preprocess_kernel[(triton.cdiv(R, block_r), H)](
            out, dout, dlse if has_dlse else delta, delta, R,
            out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
            HEAD_D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_R=block_r, HAS_DLSE=has_dlse,
        )
    return delta


def flash_attention_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, offsets: torch.Tensor,
    max_seq_len: int, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv [T, H, D] in the inputs' dtype."""
    q, k, v, out, dout = (_last_dim_contiguous(t) for t in (q, k, v, out, dout))
    T, H, D = q.shape
    B = offsets.numel() - 1
    dq, dk, dv = new_output((T, H, D), q), new_output((T, H, D), k), new_output((T, H, D), v)
    if B == 0 or T == 0:
        return dq, dk, dv
    delta = attention_bwd_delta(out, dout, dlse)
    cfg = bwd_config(D, q.dtype)
    common = dict(HEAD_D=D, BLOCK_D=triton.next_power_of_2(D), CAUSAL=causal,
                  DOT_PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    num_n = max(triton.cdiv(max_seq_len, cfg["N_KV"]), 1)
    num_m = max(triton.cdiv(max_seq_len, cfg["M_Q"]), 1)
    with device_guard(q):
        _flash_bwd_dkdv_kernel[(num_n * B * H,)](
            q, k, v, dout, dk, dv, lse, delta, offsets,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
            dv.stride(1), lse.stride(0), scale * LOG2E, scale, max_seq_len, H, B, num_n,
            BLOCK_M=cfg["M_KV"], BLOCK_N=cfg["N_KV"], **common,
        )
        _flash_bwd_dq_kernel[(num_m * B * H,)](
            q, k, v, dout, dq, lse, delta, offsets,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
            scale * LOG2E, scale, max_seq_len, H, B, num_m,
            BLOCK_M=cfg["M_Q"], BLOCK_N=cfg["N_Q"], **common,
        )
    return dq, dk, dv

