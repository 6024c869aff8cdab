"""Triton kernels and launchers for jagged self-attention (FlashAttention-2 on jagged rows).

Layout: q, k, v, out [T, H, D] (last dim contiguous); offsets [B+1]; lse and delta [H, T] fp32; only
the first min(len_b, max_seq_len) rows of sequence b take part (the others get zeros, lse -inf).
Grid: the work slots of _triton_common x H heads, head fastest. Forward: a program per query block
over its keys; backward: a delta pre-pass, then one launch of dK/dV and dQ programs (no atomics).
Numerics: exp2 of prescaled scores, fp32 statistics and accumulators, P and dS cast to the input
dtype only as MMA operands. Why: docs/kernels.md#flash-attention-self-attention."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _launch_configs as _lc
from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import (LN2_C, LOG2E, LOG2E_C, INTERPRET, dot_precision, key_block_grads, last_dim_contiguous,
                                    load_rows, num_slots, online_softmax, row_block, zero_past_max, zero_rows)


# ---- kernels ------------------------------------------------------------------------------
# Sizes that change from batch to batch are not specialised on (no recompile per batch shape).
_NO_SPEC = ["stride_lh", "max_seq_len", "num_heads", "num_seqs", "window"]


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, seq_len,
    offs_m, offs_n, offs_d, d_ok, qk_scale, window,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi); MASKED blocks check length (and causality, and
    the window |i - j| <= window: a row may then see no key in a block)."""
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
            if WINDOW:
                ok = ok & (tl.abs(cols[None, :] - offs_m[:, None]) <= window)
            s = tl.where(ok, s, float("-inf"))
        # without a window every row has seen a finite score by now (column 0 is never masked
        # for a real row), so m_new is finite and exp2 never sees (-inf) - (-inf)
        m_new, p, alpha, l_i = online_softmax(s, m_i, l_i, WINDOW)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_NO_SPEC)
def _flash_fwd_kernel(
    Q, K, V, O, LSE, Offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lh, qk_scale, max_seq_len, num_heads, num_seqs, window,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (sequence, head) against all its keys (WINDOW:
    the keys within `window` places only)."""
    pid = tl.program_id(0)
    h, b, j, seq_start, n_rows, n_slots, seq_len, offs_d, d_ok = row_block(
        pid, Offsets, num_heads, num_seqs, max_seq_len, HEAD_D, BLOCK_M, BLOCK_D)
    o_base = O + seq_start * stride_ot + h * stride_oh
    lse_base = LSE + h * stride_lh + seq_start
    if n_rows > max_seq_len:  # truncated tail: zeros, lse -inf (grid-strided over the slots)
        zero_rows(o_base, stride_ot, 1, max_seq_len, n_rows, offs_d, d_ok, j, n_slots,
                   BLOCK_M, BLOCK_D)
        offs_r = tl.arange(0, BLOCK_M)
        for r0 in range(max_seq_len + j * BLOCK_M, n_rows, n_slots * BLOCK_M):
            tl.store(lse_base + r0 + offs_r, tl.full([BLOCK_M], float("-inf"), tl.float32),
                     mask=r0 + offs_r < n_rows)
    n_blk = tl.cdiv(seq_len, BLOCK_M)
    if j >= n_blk:
        return
    start_m = (n_blk - 1 - j if CAUSAL else j) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < seq_len
    q = load_rows(Q, seq_start, h, stride_qt, stride_qh, offs_m, offs_d, m_ok[:, None] & d_ok[None, :])
    k_base = K + seq_start * stride_kt + h * stride_kh
    v_base = V + seq_start * stride_vt + h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # stage 1: key blocks that need no mask; stage 2: the diagonal / ragged-end blocks
    # (a window: only the blocks it reaches, all masked)
    if CAUSAL:
        lo = start_m  # BLOCK_M is a multiple of BLOCK_N, so [0, start_m) is whole blocks
        hi = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        lo = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    if WINDOW:
        lo = tl.maximum(start_m - window, 0)
        if not CAUSAL:
            hi = tl.minimum(start_m + BLOCK_M + window, seq_len)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, lo,
                                   seq_len, offs_m, offs_n, offs_d, d_ok, qk_scale, window,
                                   BLOCK_N, False, False, False, DOT_PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi,
                               seq_len, offs_m, offs_n, offs_d, d_ok, qk_scale, window,
                               BLOCK_N, True, CAUSAL, WINDOW, DOT_PREC)
    if WINDOW:  # a row past the sequence may have seen no key: keep it finite (never stored)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2_C  # natural log
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


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, lo, hi, seq_len,
    offs_n, offs_d, d_ok, qk_scale, window,
    BLOCK_M: tl.constexpr, MASK_LEN: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dK, dV of the keys offs_n over the query blocks [lo, hi)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if MASK_LEN:  # rows past the sequence get lse = +inf, hence P = 0
            m_ok = offs_m < seq_len
            q_mask = m_ok[:, None] & d_ok[None, :]
            lse2 = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf")) * LOG2E_C
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        else:
            q_mask = d_ok[None, :]
            lse2 = tl.load(lse_base + offs_m) * LOG2E_C
            delta = tl.load(delta_base + offs_m)
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask,
                     other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BN, BM]
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        if WINDOW:
            p_t = tl.where(tl.abs(offs_m[None, :] - offs_n[:, None]) <= window, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # [BN, BM]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, seq_len,
    offs_m, offs_d, d_ok, qk_scale, window,
    BLOCK_N: tl.constexpr, MASK_LEN: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dQ of the queries offs_m over the key blocks [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = d_ok[None, :]
        if MASK_LEN:
            kv_mask = kv_mask & (offs_n[:, None] < seq_len)
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BM, BN]
        p = tl.math.exp2(s - lse2[:, None])
        if MASK_LEN:  # a zero key still scores 0, and exp2(-lse2) may overflow: mask it
            p = tl.where(offs_n[None, :] < seq_len, p, 0.0)
        if CAUSAL_MASK:
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        if WINDOW:
            p = tl.where(tl.abs(offs_n[None, :] - offs_m[:, None]) <= window, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # [BM, BN]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _bwd_dkdv_program(
    pid, Q, K, V, DO, DK, DV, LSE, DELTA, Offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    qk_scale, sm_scale, max_seq_len, num_heads, num_seqs, window,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program `pid`: dK, dV of BLOCK_N key rows of one (sequence, head), over its queries."""
    h, b, j, seq_start, seq_len, offs_d, d_ok, dk_base, dv_base = key_block_grads(
        pid, DK, DV, Offsets, stride_dkt, stride_dkh, stride_dvt, stride_dvh, max_seq_len, num_heads, num_seqs,
        HEAD_D, BLOCK_N, BLOCK_D)
    n_blk = tl.cdiv(seq_len, BLOCK_N)
    if j < n_blk:
        start = (n_blk - 1 - j if CAUSAL else j) * BLOCK_N  # causal: the heaviest blocks first
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seq_len) & d_ok[None, :]
        k = load_rows(K, seq_start, h, stride_kt, stride_kh, offs_n, offs_d, kv_mask)
        v = load_rows(V, seq_start, h, stride_vt, stride_vh, offs_n, offs_d, kv_mask)
        q_base = Q + seq_start * stride_qt + h * stride_qh
        do_base = DO + seq_start * stride_dot + h * stride_doh
        lse_base = LSE + h * stride_lh + seq_start
        delta_base = DELTA + h * stride_lh + seq_start
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # one loop, every block masked: splitting off the few blocks that need masks costs
        # more registers (spills at D = 128) than the masks cost time
        lo = start if CAUSAL else 0
        hi = seq_len
        if WINDOW:  # the queries within the window of these keys
            lo = tl.maximum(start - window, lo)
            hi = tl.minimum(start + BLOCK_N + window, seq_len)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
                                 stride_dot, lo, hi, seq_len, offs_n, offs_d, d_ok,
                                 qk_scale, window, BLOCK_M, True, CAUSAL, WINDOW, DOT_PREC)
        tl.store(dk_base + offs_n[:, None] * stride_dkt + offs_d[None, :],
                 (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(dv_base + offs_n[:, None] * stride_dvt + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_program(
    pid, Q, K, V, DO, DQ, LSE, DELTA, Offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    qk_scale, sm_scale, max_seq_len, num_heads, num_seqs, window,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program `pid`: dQ of BLOCK_M query rows of one (sequence, head), over its keys."""
    h, b, j, seq_start, n_rows, n_slots, seq_len, offs_d, d_ok = row_block(
        pid, Offsets, num_heads, num_seqs, max_seq_len, HEAD_D, BLOCK_M, BLOCK_D)
    dq_base = DQ + seq_start * stride_dqt + h * stride_dqh
    zero_past_max(dq_base, stride_dqt, max_seq_len, n_rows, offs_d, d_ok, j, n_slots, BLOCK_M, BLOCK_D)
    n_blk = tl.cdiv(seq_len, BLOCK_M)
    if j < n_blk:
        start = (n_blk - 1 - j if CAUSAL else j) * BLOCK_M
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < seq_len
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = load_rows(Q, seq_start, h, stride_qt, stride_qh, offs_m, offs_d, q_mask)
        do = load_rows(DO, seq_start, h, stride_dot, stride_doh, offs_m, offs_d, q_mask)
        # rows past the sequence get lse = +inf, hence P = 0
        lse2 = tl.load(LSE + h * stride_lh + seq_start + offs_m, mask=m_ok,
                       other=float("inf")) * LOG2E_C
        delta = tl.load(DELTA + h * stride_lh + seq_start + offs_m, mask=m_ok, other=0.0)
        k_base = K + seq_start * stride_kt + h * stride_kh
        v_base = V + seq_start * stride_vt + h * stride_vh
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo = 0
        hi = tl.minimum(start + BLOCK_M, seq_len) if CAUSAL else seq_len
        if WINDOW:  # the keys within the window of these queries
            lo = tl.maximum(start - window, 0)
            hi = tl.minimum(start + BLOCK_M + window, hi)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, lo, hi,
                           seq_len, offs_m, offs_d, d_ok, qk_scale, window, BLOCK_N, True, CAUSAL,
                           WINDOW, DOT_PREC)
        tl.store(dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=_NO_SPEC + ["num_kv_programs"])
def _flash_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA, Offsets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    qk_scale, sm_scale, max_seq_len, num_heads, num_seqs, num_kv_programs, window,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One launch, two roles: the first num_kv_programs programs compute dK, dV per slot of
    BLOCK_N1 keys (query steps of BLOCK_M1), the others dQ per slot of BLOCK_M2 queries (key
    steps of BLOCK_N2)."""
    pid = tl.program_id(0)
    if pid < num_kv_programs:
        _bwd_dkdv_program(pid, Q, K, V, DO, DK, DV, LSE, DELTA, Offsets,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                          stride_lh, qk_scale, sm_scale, max_seq_len, num_heads, num_seqs, window,
                          HEAD_D, BLOCK_D, BLOCK_N1, BLOCK_M1, CAUSAL, WINDOW, DOT_PREC)
    else:
        _bwd_dq_program(pid - num_kv_programs, Q, K, V, DO, DQ, LSE, DELTA, Offsets,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_dot, stride_doh, stride_dqt, stride_dqh, stride_lh,
                        qk_scale, sm_scale, max_seq_len, num_heads, num_seqs, window,
                        HEAD_D, BLOCK_D, BLOCK_M2, BLOCK_N2, CAUSAL, WINDOW, DOT_PREC)


# ---- block sizes --------------------------------------------------------------------------
# Measured on an H100 (docs/tuning.md), keyed on the head dim and the dtype; D = 256 and
# fp32 are picked for no spills, not measured.


def fwd_config(head_dim: int, dtype: torch.dtype, short: bool = False) -> dict:
    """BLOCK_M, BLOCK_N (BLOCK_M % BLOCK_N == 0), num_warps, num_stages for the forward.

    `short`: the mean sequence length (T / B, known on the host) is under 256. fp32 inputs use
    IEEE FMA dots, whose tiles must stay small."""
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    bd = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        bm, bn, warps, stages = (64, 32, 8, 1) if bd <= 64 else (16, 16, 4, 1)
    elif bd <= 64:  # 32-key steps win below a mean length of 256 only (docs/tuning.md, v2)
        bm, bn, warps, stages = 64, (32 if short else 64), 4, 3
    elif bd <= 128:
        bm, bn, warps, stages = 64, 32, 4, 3
    else:
        bm, bn, warps, stages = 128, 32, 8, 3
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def bwd_config(head_dim: int, dtype: torch.dtype) -> dict:
    """dK/dV programs: BLOCK_N1 keys, query steps of BLOCK_M1; dQ programs: BLOCK_M2 queries,
    key steps of BLOCK_N2 (BLOCK_M1 divides BLOCK_N1, BLOCK_N2 divides BLOCK_M2); warps, stages
    shared by both (one launch)."""
    if INTERPRET:
        return dict(BLOCK_N1=32, BLOCK_M1=16, BLOCK_M2=32, BLOCK_N2=16, num_warps=4,
                    num_stages=1)
    bd = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        n1, m1, m2, n2, warps, stages = ((32, 32, 32, 32, 8, 1) if bd <= 64 else
                                         (32, 16, 32, 16, 4, 1) if bd <= 128 else
                                         (16, 16, 16, 16, 4, 1))
    elif bd <= 64:
        n1, m1, m2, n2, warps, stages = 64, 32, 64, 32, 4, 3
    elif bd <= 128:  # 16-row steps, 3 stages (docs/tuning.md, v2)
        n1, m1, m2, n2, warps, stages = 64, 16, 64, 16, 4, 3
    else:
        n1, m1, m2, n2, warps, stages = 32, 32, 32, 32, 8, 1
    return dict(BLOCK_N1=n1, BLOCK_M1=m1, BLOCK_M2=m2, BLOCK_N2=n2, num_warps=warps,
                num_stages=stages)


# launch keywords (constexprs and options) per (head dim, dtype, causal, [length class,] shape
# bucket: _lc.bucket, () when no table or forced config is in use): built once
_FWD_KW: dict = _lc.register_cache({})
_BWD_KW: dict = _lc.register_cache({})


def _fwd_kw(D: int, dtype: torch.dtype, causal: bool, short: bool, bucket: tuple = (), window: bool = False) -> dict:
    key = (D, dtype, causal, short, bucket, window)
    return _FWD_KW.get(key) or _build_kw(_FWD_KW, key, "flash_fwd", fwd_config(D, dtype, short), bucket)


def _bwd_kw(D: int, dtype: torch.dtype, causal: bool, bucket: tuple = (), window: bool = False) -> dict:
    key = (D, dtype, causal, bucket, window)
    return _BWD_KW.get(key) or _build_kw(_BWD_KW, key, "flash_bwd", bwd_config(D, dtype), bucket)


def _build_kw(cache: dict, key: tuple, family: str, cfg: dict, bucket: tuple) -> dict:
    """The hand rule `cfg` (or the launch table's pick for `bucket`) with the constexprs, kept in
    `cache` at `key` (D, dtype, causal first, has a window last) but in fp32, whose DOT_PREC
    follows a torch setting. The launch tables were tuned without a window."""
    D, dtype, causal = key[:3]
    if bucket:
        cfg = _lc.tuned(family, (*bucket, D, dtype, int(causal)), cfg)
    kw = dict(cfg, HEAD_D=D, BLOCK_D=triton.next_power_of_2(D), CAUSAL=causal, WINDOW=key[-1],
              DOT_PREC=dot_precision(dtype))
    if dtype != torch.float32:
        cache[key] = kw
    return kw


# ---- launchers ----------------------------------------------------------------------------


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int,
                        causal: bool, scale: float, window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, D] (q's dtype), lse [H, T] fp32. Inputs already validated by the caller;
    window -1: every key."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    T, H, D = q.shape
    B = offsets.shape[0] - 1
    out = new_output((T, H, D), q)
    lse = new_output((H, T), q, torch.float32)
    if B == 0 or T == 0:
        return out, lse
    bucket = _lc.bucket(B, max_seq_len, T, H) if _lc.active() else ()  # host ints: no sync
    kw = _fwd_kw(D, q.dtype, causal, T < 256 * B, bucket, window >= 0)
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    with device_guard(q):
        _flash_fwd_kernel[(num_slots(T, B, kw["BLOCK_M"]) * H,)](
            q, k, v, out, lse, offsets, qs[0], qs[1], ks[0], ks[1], vs[0], vs[1],
            H * D, D, T, scale * LOG2E, max_seq_len, H, B, window, **kw,
        )
    return out, lse


def attention_bwd_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """delta [H, R] fp32 = rowsum(dout * out) - dlse; out, dout [R, H, D], last dim contiguous."""
    R, H, D = out.shape
    delta = torch.empty((H, R), dtype=torch.float32, device=out.device)
    if R == 0:
        return delta
    block_r = 16 if INTERPRET else 64
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
    max_seq_len: int, causal: bool, scale: float, window: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv [T, H, D] in the inputs' dtype."""
    if dout.stride(-1) != 1 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v, dout = (last_dim_contiguous(t) for t in (q, k, v, dout))
    T, H, D = q.shape
    B = offsets.shape[0] - 1
    dq, dk, dv = new_output((T, H, D), q), new_output((T, H, D), k), new_output((T, H, D), v)
    if B == 0 or T == 0:
        return dq, dk, dv
    delta = attention_bwd_delta(out, dout, dlse)
    kw = _bwd_kw(D, q.dtype, causal, _lc.bucket(B, max_seq_len, T, H) if _lc.active() else (), window >= 0)
    n_kv = num_slots(T, B, kw["BLOCK_N1"]) * H
    n_q = num_slots(T, B, kw["BLOCK_M2"]) * H
    qs, ks, vs, dos, dqs = q.stride(), k.stride(), v.stride(), dout.stride(), dq.stride()
    args = (q, k, v, dout, dq, dk, dv, lse, delta, offsets,
            qs[0], qs[1], ks[0], ks[1], vs[0], vs[1], dos[0], dos[1], dqs[0], dqs[1],
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
            scale * LOG2E, scale, max_seq_len, H, B, n_kv, window)
    with device_guard(q):
        _flash_bwd_kernel[(n_kv + n_q,)](*args, **kw)
    return dq, dk, dv
