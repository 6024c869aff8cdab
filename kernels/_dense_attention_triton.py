"""Triton kernels and launchers for jagged-dense (target) attention.

Layout: q, out [B, Tq, H, D] (last dim contiguous); k, v [T, H, D] jagged by offsets [B+1]; bias
[B, H, Tq, N] (any strides), N = max_seq_len; lse [H, B, Tq] fp32. Sequence b's keys are its first
min(len_b, N) rows. Grid: forward and dQ(+dBias) programs per (query block, sequence, head) over the
key blocks; dK/dV programs per (key slot, head) over the Tq queries, in the same backward launch.
No atomics, except dQ under SPLIT_DQ (fp32 atomics into a zeroed buffer: not bit-deterministic).
Numerics as flash attention's; an empty row gives out = 0, lse = -inf. Why: docs/kernels.md."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _launch_configs as _lc
from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import (LN2_C, LOG2E, LOG2E_C, INTERPRET, dot_precision, key_block_grads, last_dim_contiguous,
                                    load_rows, num_slots, online_softmax, zero_rows)


# Sizes that change from batch to batch are not specialised on (no recompile per batch shape).
_NO_SPEC = ["max_seq_len", "num_queries", "num_heads", "num_seqs"]


@triton.jit
def _query_block(pid, Q, Offsets, stride_qb, stride_qt, stride_qh, max_seq_len, num_queries, num_heads, num_seqs,
                 HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The prologue of a program over (query block, sequence, head), pid = (m_blk * num_seqs + b)
    * num_heads + h: (h, b, seq_start, n_rows, seq_len, offs_m, m_ok, offs_d, d_ok, q_mask, q),
    q the block's [BLOCK_M, BLOCK_D] queries (zero past num_queries and HEAD_D)."""
    h = pid % num_heads
    b = ((pid // num_heads) % num_seqs).to(tl.int64)
    m_blk = pid // (num_heads * num_seqs)
    seq_start = tl.load(Offsets + b.to(tl.int32)).to(tl.int64)
    n_rows = (tl.load(Offsets + b.to(tl.int32) + 1).to(tl.int64) - seq_start).to(tl.int32)
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < num_queries
    d_ok = offs_d < HEAD_D
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=q_mask, other=0.0)
    return h, b, seq_start, n_rows, tl.minimum(n_rows, max_seq_len), offs_m, m_ok, offs_d, d_ok, q_mask, q


@triton.jit
def _scores(q, k, bias_ptrs, b_mask, qk_scale, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):
    """q @ k^T in log2 units (+ bias * log2 e): q [R, D], k [C, D] -> [R, C] fp32."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=b_mask, other=0.0).to(tl.float32) * LOG2E_C
    return s


@triton.jit(do_not_specialize=_NO_SPEC)
def _dense_fwd_kernel(
    Q, K, V, Bias, O, LSE, Offsets,
    stride_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bb, stride_bh, stride_bq, stride_bn, stride_ob, stride_ot, stride_oh,
    qk_scale, max_seq_len, num_queries, num_heads, num_seqs,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program: BLOCK_M dense queries of one (sequence, head) over the sequence's keys."""
    pid = tl.program_id(0)
    h, b, seq_start, n_rows, seq_len, offs_m, m_ok, offs_d, d_ok, q_mask, q = _query_block(
        pid, Q, Offsets, stride_qb, stride_qt, stride_qh, max_seq_len, num_queries, num_heads, num_seqs,
        HEAD_D, BLOCK_M, BLOCK_D)
    k_base = K + seq_start * stride_kt + h * stride_kh
    v_base = V + seq_start * stride_vt + h * stride_vh
    bias_base = Bias + b * stride_bb + h * stride_bh + offs_m[:, None] * stride_bq
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, bias_base + offs_n[None, :] * stride_bn, m_ok[:, None] & n_ok[None, :],
                    qk_scale, HAS_BIAS, DOT_PREC)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new, p, alpha, l_i = online_softmax(s, m_i, l_i, True)  # a row may have no finite score yet
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * LN2_C, float("-inf"))
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + (h * num_seqs + b) * num_queries + offs_m, lse, mask=m_ok)


@triton.jit
def _load_lse2_delta(LSE, row0, offs_m, m_ok, o_ptrs, q_mask, do):
    """lse in log2 units with -inf (no keys) and padding rows mapped to +inf (P = 0), and
    delta = rowsum(dO * O), computed here from the Tq query rows (few: cheaper than a pre-pass
    launch)."""
    lse = tl.load(LSE + row0 + offs_m, mask=m_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    o = tl.load(o_ptrs, mask=q_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    return lse2, delta


@triton.jit
def _dense_bwd_dq(
    pid, Q, K, V, Bias, DO, DQ, DBias, LSE, O, Offsets,
    stride_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bb, stride_bh, stride_bq, stride_bn, stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh, stride_dbb, stride_dbh, stride_dbq, stride_dbn,
    qk_scale, sm_scale, max_seq_len, num_queries, num_heads, num_seqs,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE_DBIAS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program `pid`: dQ (and dBias rows) of BLOCK_M queries of one (sequence, head)."""
    h, b, seq_start, n_rows, seq_len, offs_m, m_ok, offs_d, d_ok, q_mask, q = _query_block(
        pid, Q, Offsets, stride_qb, stride_qt, stride_qh, max_seq_len, num_queries, num_heads, num_seqs,
        HEAD_D, BLOCK_M, BLOCK_D)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot
                 + offs_d[None, :], mask=q_mask, other=0.0)
    lse2, delta = _load_lse2_delta(LSE, (h * num_seqs + b) * num_queries, offs_m, m_ok,
                                   O + b * stride_dob + h * stride_doh + offs_m[:, None]
                                   * stride_dot + offs_d[None, :], q_mask, do)
    k_base = K + seq_start * stride_kt + h * stride_kh
    v_base = V + seq_start * stride_vt + h * stride_vh
    bias_base = Bias + b * stride_bb + h * stride_bh + offs_m[:, None] * stride_bq
    dbias_base = DBias + b * stride_dbb + h * stride_dbh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        kv_mask = n_ok[:, None] & d_ok[None, :]
        mn_mask = m_ok[:, None] & n_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, bias_base + offs_n[None, :] * stride_bn, mn_mask, qk_scale, HAS_BIAS,
                    DOT_PREC)
        p = tl.where(n_ok[None, :], tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # [BM, BN]
        ds = p * (dp - delta[:, None])
        if STORE_DBIAS:
            tl.store(dbias_base + offs_m[:, None] * stride_dbq + offs_n[None, :] * stride_dbn,
                     ds.to(DBias.dtype.element_ty), mask=mn_mask)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
    if STORE_DBIAS:  # bias columns past the sequence: zero gradient (key positions as "rows")
        zero_rows(dbias_base, stride_dbn, stride_dbq, seq_len, max_seq_len, offs_m, m_ok, 0, 1,
                   BLOCK_N, BLOCK_M)


@triton.jit
def _dense_bwd_dkdv(
    pid, Q, K, V, Bias, DO, DQ, DK, DV, LSE, O, Offsets,
    stride_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bb, stride_bh, stride_bq, stride_bn, stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    qk_scale, sm_scale, max_seq_len, num_queries, num_heads, num_seqs,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_DQ: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program `pid` (a slot): dK, dV of BLOCK_N key rows of one (sequence, head), over all Tq
    queries; with SPLIT_DQ also this key block's share dS @ K of dQ, atomically added to DQ
    (fp32, zero-initialised)."""
    h, b, j, seq_start, seq_len, offs_d, d_ok, dk_base, dv_base = key_block_grads(
        pid, DK, DV, Offsets, stride_dkt, stride_dkh, stride_dvt, stride_dvh, max_seq_len, num_heads, num_seqs,
        HEAD_D, BLOCK_N, BLOCK_D)
    start_n = j * BLOCK_N
    if start_n >= seq_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seq_len
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = load_rows(K, seq_start, h, stride_kt, stride_kh, offs_n, offs_d, kv_mask)
    v = load_rows(V, seq_start, h, stride_vt, stride_vh, offs_n, offs_d, kv_mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    o_base = O + b * stride_dob + h * stride_doh
    dq_base = DQ + b * stride_dqb + h * stride_dqh
    bias_base = Bias + b * stride_bb + h * stride_bh + offs_n[:, None] * stride_bn
    for start_m in range(0, num_queries, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < num_queries
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask,
                     other=0.0)
        lse2, delta = _load_lse2_delta(LSE, (h * num_seqs + b) * num_queries, offs_m, m_ok,
                                       o_base + offs_m[:, None] * stride_dot + offs_d[None, :],
                                       q_mask, do)
        s_t = _scores(k, q, bias_base + offs_m[None, :] * stride_bq, n_ok[:, None] & m_ok[None, :],
                      qk_scale, HAS_BIAS, DOT_PREC)  # [BN, BM]
        p_t = tl.math.exp2(s_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
        if SPLIT_DQ:  # rows past the sequence zeroed: k is 0 there, but p_t may overflow
            ds_t = tl.where(n_ok[:, None], ds_t, 0.0)
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PREC)  # [BM, BD]
            tl.atomic_add(dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :], dq * sm_scale,
                          mask=q_mask, sem="relaxed")
    tl.store(dk_base + offs_n[:, None] * stride_dkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_base + offs_n[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=_NO_SPEC + ["num_dq_programs"])
def _dense_bwd_kernel(
    Q, K, V, Bias, DO, DQ, DK, DV, DBias, LSE, O, Offsets,
    stride_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bb, stride_bh, stride_bq, stride_bn, stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh, stride_dbb, stride_dbh, stride_dbq, stride_dbn,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    qk_scale, sm_scale, max_seq_len, num_queries, num_heads, num_seqs, num_dq_programs,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    M_KV: tl.constexpr, N_KV: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_DBIAS: tl.constexpr,
    SPLIT_DQ: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The first num_dq_programs programs: dQ (+ dBias) per query block; the rest: dK, dV per
    key slot. The dQ programs, which loop over whole sequences, are dispatched first. With
    SPLIT_DQ there are no dQ programs (num_dq_programs = 0, never STORE_DBIAS): the dK/dV
    programs add dQ into DQ, fp32. O (the forward's output) has DO's strides (both contiguous)."""
    pid = tl.program_id(0)
    if SPLIT_DQ:
        dq_program = False  # decided at compile time: the dQ branch is not built
    else:
        dq_program = pid < num_dq_programs
    if dq_program:
        _dense_bwd_dq(pid, Q, K, V, Bias, DO, DQ, DBias, LSE, O, Offsets,
                      stride_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_bb, stride_bh, stride_bq, stride_bn, stride_dob, stride_dot,
                      stride_doh, stride_dqb, stride_dqt, stride_dqh, stride_dbb, stride_dbh,
                      stride_dbq, stride_dbn, qk_scale, sm_scale, max_seq_len, num_queries,
                      num_heads, num_seqs, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, HAS_BIAS,
                      STORE_DBIAS, DOT_PREC)
    else:
        _dense_bwd_dkdv(pid - num_dq_programs, Q, K, V, Bias, DO, DQ, DK, DV, LSE, O, Offsets,
                        stride_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                        stride_vh, stride_bb, stride_bh, stride_bq, stride_bn, stride_dob,
                        stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh, stride_dkt,
                        stride_dkh, stride_dvt, stride_dvh, qk_scale, sm_scale, max_seq_len,
                        num_queries, num_heads, num_seqs, HEAD_D, BLOCK_D, M_KV, N_KV, HAS_BIAS,
                        SPLIT_DQ, DOT_PREC)


# ---- block sizes --------------------------------------------------------------------------


def dense_config(head_dim: int, num_queries: int, dtype: torch.dtype, backward: bool = False) -> dict:
    """Query blocks sized to Tq (>= 16 for the MMA), key blocks to the head dim: the 16-bit rule up
    to D = 128 is the sweep's fastest on its target-attention shapes (docs/tuning.md, "First GPU
    sweep"); fp32 and D > 128 are not swept. SPLIT_DQ is dropped under deterministic algorithms."""
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=16, M_KV=16, N_KV=16, SPLIT_DQ=0, num_warps=4, num_stages=1)
    bd = triton.next_power_of_2(head_dim)
    bm = max(16, min(64 if bd <= 128 else 32, triton.next_power_of_2(num_queries)))
    bn = 64 if bd <= 128 else 32
    if dtype == torch.float32:
        bm, bn = max(bm // 2, 16), (32 if bd <= 64 else 16)
        warps, stages, split = (8 if bd >= 128 else 4), 1, 0
    elif bd > 128:
        warps, stages, split = 8, 2, 0
    else:
        warps, stages, split = 4, (3 if backward or bd == 128 else 2), int(backward)
    return dict(BLOCK_M=bm, BLOCK_N=bn, M_KV=bm, N_KV=bn, SPLIT_DQ=split, num_warps=warps, num_stages=stages)


# launch keywords per (head dim, Tq, dtype, direction, shape bucket): built once but in fp32
_KW: dict = _lc.register_cache({})


def _dense_kw(D: int, Tq: int, dtype: torch.dtype, family: str, B: int, N: int, T: int, H: int) -> dict:
    """Launch keywords of the forward (family 'dense_fwd') or backward ('dense_bwd')."""
    bucket = _lc.bucket(B, N, T, H) if _lc.active() else ()
    key = (D, Tq, dtype, family, bucket)
    kw = _KW.get(key)
    if kw is None:
        cfg = dense_config(D, Tq, dtype, backward=family == "dense_bwd")
        if bucket:
            cfg = _lc.tuned(family, (*bucket, D, Tq, dtype), cfg)
        kw = dict(cfg, HEAD_D=D, BLOCK_D=triton.next_power_of_2(D), DOT_PREC=dot_precision(dtype))
        if dtype != torch.float32:  # fp32's DOT_PREC follows a torch setting
            _KW[key] = kw
    return kw


def _ptr(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    # an empty tensor may have no storage to point at; the kernels never read it then
    return fallback if t is None or t.numel() == 0 else t


def _bias_args(bias: torch.Tensor | None, fallback: torch.Tensor) -> tuple:
    if bias is None:
        return (fallback, 0, 0, 0, 0)
    return (_ptr(bias, fallback), *bias.stride())


# ---- launchers ----------------------------------------------------------------------------


def dense_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_seq_len: int,
                        bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Tq, H, D] (q's dtype), lse [H, B, Tq] fp32. Inputs already validated."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    B, Tq, H, D = q.shape
    out = new_output((B, Tq, H, D), q)
    lse = new_output((H, B, Tq), q, torch.float32)
    if B == 0 or Tq == 0:
        return out, lse
    kw = _dense_kw(D, Tq, q.dtype, "dense_fwd", B, max_seq_len, k.shape[0], H)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    bias_args = _bias_args(bias, q)
    with device_guard(q):
        _dense_fwd_kernel[(triton.cdiv(Tq, kw["BLOCK_M"]) * B * H,)](
            q, _ptr(k, q), _ptr(v, q), bias_args[0], out, lse, offsets,
            qs[0], qs[1], qs[2], ks[0], ks[1], vs[0], vs[1], *bias_args[1:],
            os_[0], os_[1], os_[2], scale * LOG2E, max_seq_len, Tq, H, B,
            HEAD_D=D, BLOCK_D=kw["BLOCK_D"], BLOCK_M=kw["BLOCK_M"], BLOCK_N=kw["BLOCK_N"],
            HAS_BIAS=bias is not None, DOT_PREC=kw["DOT_PREC"], num_warps=kw["num_warps"],
            num_stages=kw["num_stages"],
        )
    return out, lse


def dense_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, bias: torch.Tensor | None,
    scale: float, need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq [B, Tq, H, D], dk, dv [T, H, D], dbias [B, H, Tq, N] in bias's dtype (or None)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    if not dout.is_contiguous():
        dout = dout.contiguous()
    B, Tq, H, D = q.shape
    T = k.shape[0]
    dk, dv = new_output(k.shape, k), new_output(v.shape, v)
    store_dbias = bias is not None and need_dbias
    dbias = new_output(tuple(bias.shape), bias) if store_dbias else None
    if B == 0 or (Tq == 0 and T == 0):
        return new_output(q.shape, q), dk, dv, dbias
    if Tq == 0:  # no query: every key gradient is zero
        return new_output(q.shape, q), dk.zero_(), dv.zero_(), dbias
    if out.stride() != dout.stride():  # the kernel reads O with dO's strides
        out = out.contiguous()
    kw = _dense_kw(D, Tq, q.dtype, "dense_bwd", B, max_seq_len, T, H)
    # split-K dQ (docs/kernels.md): not with dBias (the dQ programs write it), nor without keys, nor
    # where torch is asked for deterministic results (the atomics add in arrival order)
    split = int(bool(kw["SPLIT_DQ"]) and not store_dbias and T > 0 and not torch.are_deterministic_algorithms_enabled())
    if split != kw["SPLIT_DQ"]:
        kw = dict(kw, SPLIT_DQ=split)
    # split: fp32 sums of the key blocks' atomic adds; queries without keys keep the zeros
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if split else new_output(q.shape, q)
    n_dq = 0 if split else triton.cdiv(Tq, kw["BLOCK_M"]) * B * H
    n_kv = num_slots(T, B, kw["N_KV"]) * H if T > 0 else 0
    qs, ks, vs, dos, dqs = q.stride(), k.stride(), v.stride(), dout.stride(), dq.stride()
    bias_args = _bias_args(bias, q)
    with device_guard(q):
        _dense_bwd_kernel[(n_dq + n_kv,)](
            q, _ptr(k, q), _ptr(v, q), bias_args[0], dout, dq, _ptr(dk, dq), _ptr(dv, dq),
            _ptr(dbias, dq), lse, out, offsets,
            qs[0], qs[1], qs[2], ks[0], ks[1], vs[0], vs[1], *bias_args[1:],
            dos[0], dos[1], dos[2], dqs[0], dqs[1], dqs[2],
            *(dbias.stride() if store_dbias else (0, 0, 0, 0)),
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            scale * LOG2E, scale, max_seq_len, Tq, H, B, n_dq,
            HAS_BIAS=bias is not None, STORE_DBIAS=store_dbias, **kw,
        )
    return dq.to(q.dtype), dk, dv, dbias
