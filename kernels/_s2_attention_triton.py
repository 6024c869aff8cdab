"""Triton kernels of S2 attention (kernels/s2.py) on jagged sequences: forward, dQ, dK/dV.

Grid: one program per (query tile, sequence, head) over max_seq_len (idle programs exit at once). A
forward or dQ program walks only the key blocks its head sees, as one flat loop (`_visible_blocks`);
a dK/dV program takes BLOCK_N keys and walks only the queries that see them. Softmax in base 2, lse
stored in base 2; delta computed by torch before the backward. Tiles: `s2_tiles` or the launch
table (families s2_fwd, s2_bwd). Why: docs/kernels.md#s2-attention."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _launch_configs as _lc
from kernels._triton_common import INTERPRET, LOG2E, online_softmax, col_block, dot_precision


@triton.jit
def _strided(j, o_h, STRIDE):
    """Whether block j (counted from the end, non-causal; from the start, causal) is one of the
    strided blocks of the head with offset o_h."""
    return ((j + o_h) % STRIDE) == 0


@triton.jit
def _program(Offsets, max_seq_len, BLOCK: tl.constexpr):
    """This program's head h, its sequence's first row and length (truncated to max_seq_len), and
    the first of its BLOCK rows in the sequence (grid: row blocks, sequences, heads)."""
    pid, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(Offsets + b).to(tl.int64)
    n = tl.minimum(tl.load(Offsets + b + 1).to(tl.int64) - start, max_seq_len).to(tl.int32)
    return h, start, n, pid * BLOCK


@triton.jit
def _tile(start, h, first, n, stride_t, stride_h, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
          HEAD_DIM: tl.constexpr):
    """Rows first..first+BLOCK of a sequence on head h: positions, their mask (< n), the mask of
    the head dim, and the element offsets [BLOCK, BLOCK_D] into a [T, H, D] tensor."""
    offs = first + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (start + offs)[:, None] * stride_t + h * stride_h + offs_d[None, :]
    return offs, offs < n, offs_d, offs_d < HEAD_DIM, rows


@triton.jit
def _visible_blocks(n, i_blk, o_h, S2_BLOCK: tl.constexpr, LOCAL, STRIDE, CAUSAL: tl.constexpr):
    """The S2 blocks that the queries of query block i_blk (causal) or of the whole sequence
    (non-causal) see on the head with offset o_h, as two arithmetic runs: (count, first block,
    step) of the strided run and (count, first block) of the local run; the blocks of the two
    runs are disjoint and together they are every block the head sees."""
    if CAUSAL:  # blocks from the start; keys up to the query block
        j_loc = tl.maximum(i_blk - LOCAL + 1, 0)  # the local run: j_loc .. i_blk
        n_loc = i_blk + 1 - j_loc
        j_str = (STRIDE - o_h % STRIDE) % STRIDE  # the strided run: below j_loc
        n_str = tl.cdiv(tl.maximum(j_loc - j_str, 0), STRIDE)
    else:  # blocks from the end; all of the sequence
        n_blocks = tl.cdiv(n, S2_BLOCK)
        j_loc = 0
        n_loc = tl.minimum(LOCAL, n_blocks)
        j_str = LOCAL + (STRIDE - (LOCAL + o_h) % STRIDE) % STRIDE  # the strided run: from LOCAL on
        n_str = tl.cdiv(tl.maximum(n_blocks - j_str, 0), STRIDE)
    return n_str, j_str, n_loc, j_loc


@triton.jit
def _nth_key_chunk(it, n, n_str, j_str, j_loc, STRIDE, S2_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr):
    """Chunk `it` of the flat walk over the visible blocks (S2_BLOCK // BLOCK_N chunks a block,
    the strided run first): its key rows and the rows [lo, hi) of its block."""
    CHUNKS: tl.constexpr = S2_BLOCK // BLOCK_N
    i = it // CHUNKS
    j = tl.where(i < n_str, j_str + i * STRIDE, j_loc + (i - n_str))
    if CAUSAL:
        lo = j * S2_BLOCK
        hi = tl.minimum(lo + S2_BLOCK, n)
        first = lo
    else:  # the block's end is exact; its start, clamped at row 0, is not a chunk boundary
        hi = n - j * S2_BLOCK
        lo = tl.maximum(hi - S2_BLOCK, 0)
        first = hi - S2_BLOCK
    return first + (it % CHUNKS) * BLOCK_N + tl.arange(0, BLOCK_N), lo, hi


@triton.jit
def _key_chunk(K, V, start, h, offs_n, lo, hi, offs_m, m_ok, offs_d, d_ok, stride_t, stride_h,
               CAUSAL: tl.constexpr):
    """The k, v rows offs_n (those in [lo, hi), a seen block's) and which (query, key) pairs count."""
    n_ok = (offs_n >= lo) & (offs_n < hi)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    rows = (start + offs_n)[:, None] * stride_t + h * stride_h + offs_d[None, :]  # as _tile's
    k = tl.load(K + rows, mask=kv_mask, other=0.0)
    v = tl.load(V + rows, mask=kv_mask, other=0.0)
    keep = n_ok[None, :] & m_ok[:, None]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None])
    return k, v, keep


@triton.jit
def _query_tile(Q, HeadOff, start, h, m0, n, stride_t, stride_h, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """A forward or dQ program's query rows m0..m0+BLOCK_M: _tile's positions, masks and offsets,
    the q tile and the head's stride offset."""
    offs_m, m_ok, offs_d, d_ok, qrows = _tile(start, h, m0, n, stride_t, stride_h, BLOCK_M, BLOCK_D, HEAD_DIM)
    q = tl.load(Q + qrows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    return offs_m, m_ok, offs_d, d_ok, qrows, q, tl.load(HeadOff + h)


@triton.jit
def _s2_fwd(Q, K, V, O, LSE2, Offsets, HeadOff, stride_t, stride_h, num_heads, max_seq_len, qk_scale,
            S2_BLOCK: tl.constexpr, LOCAL, STRIDE, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr):
    h, start, n, m0 = _program(Offsets, max_seq_len, BLOCK_M)
    if m0 >= n:
        return
    offs_m, m_ok, offs_d, d_ok, qrows, q, o_h = _query_tile(Q, HeadOff, start, h, m0, n, stride_t, stride_h,
                                                            BLOCK_M, BLOCK_D, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    i_blk = m0 // S2_BLOCK  # causal: the tile's query block (BLOCK_M divides S2_BLOCK)
    n_str, j_str, n_loc, j_loc = _visible_blocks(n, i_blk, o_h, S2_BLOCK, LOCAL, STRIDE, CAUSAL)
    # one flat loop over the visible blocks' key chunks (no branch, no nested loop: the compiler
    # can pipeline the next chunk's loads under this one's math)
    for it in range(0, (n_str + n_loc) * (S2_BLOCK // BLOCK_N)):
        offs_n, lo, hi = _nth_key_chunk(it, n, n_str, j_str, j_loc, STRIDE, S2_BLOCK, BLOCK_N, CAUSAL)
        k, v, keep = _key_chunk(K, V, start, h, offs_n, lo, hi, offs_m, m_ok, offs_d, d_ok, stride_t, stride_h,
                                CAUSAL)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(keep, s, float("-inf"))
        m_new, p, alpha, l_i = online_softmax(s, m_i, l_i, True)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + qrows, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))  # inf: p = 0 in the backward
    tl.store(LSE2 + (start + offs_m) * num_heads + h, lse2, mask=m_ok)  # [T, H]


@triton.jit
def _s2_bwd_dq(Q, K, V, DO, DQ, LSE2, Delta, Offsets, HeadOff, stride_t, stride_h, num_heads, max_seq_len,
               qk_scale, sm_scale, S2_BLOCK: tl.constexpr, LOCAL, STRIDE, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr):
    h, start, n, m0 = _program(Offsets, max_seq_len, BLOCK_M)
    if m0 >= n:
        return
    offs_m, m_ok, offs_d, d_ok, qrows, q, o_h = _query_tile(Q, HeadOff, start, h, m0, n, stride_t, stride_h,
                                                            BLOCK_M, BLOCK_D, HEAD_DIM)
    do = tl.load(DO + qrows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    lse2 = tl.load(LSE2 + (start + offs_m) * num_heads + h, mask=m_ok, other=float("inf"))
    delta = tl.load(Delta + (start + offs_m) * num_heads + h, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    i_blk = m0 // S2_BLOCK
    n_str, j_str, n_loc, j_loc = _visible_blocks(n, i_blk, o_h, S2_BLOCK, LOCAL, STRIDE, CAUSAL)
    for it in range(0, (n_str + n_loc) * (S2_BLOCK // BLOCK_N)):  # as the forward's walk
        offs_n, lo, hi = _nth_key_chunk(it, n, n_str, j_str, j_loc, STRIDE, S2_BLOCK, BLOCK_N, CAUSAL)
        k, v, keep = _key_chunk(K, V, start, h, offs_n, lo, hi, offs_m, m_ok, offs_d, d_ok, stride_t, stride_h,
                                CAUSAL)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    tl.store(DQ + qrows, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _s2_bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, Delta, Offsets, HeadOff, stride_t, stride_h, num_heads,
                 max_seq_len, qk_scale, sm_scale, S2_BLOCK: tl.constexpr, LOCAL, STRIDE, CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    h, start, n, n0 = _program(Offsets, max_seq_len, BLOCK_N)
    if n0 >= n:
        return
    o_h = tl.load(HeadOff + h)
    offs_n, n_ok, offs_d, d_ok, krows = _tile(start, h, n0, n, stride_t, stride_h, BLOCK_N, BLOCK_D, HEAD_DIM)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:  # the chunk lies in one block j (BLOCK_N divides S2_BLOCK)
        j = n0 // S2_BLOCK
        key_seen = n_ok
        q_lo = n0
        q_hi = tl.where(_strided(j, o_h, STRIDE), n, tl.minimum(n, (j + LOCAL) * S2_BLOCK))
    else:  # blocks counted from the end: the chunk may straddle two
        jn = (n - 1 - offs_n) // S2_BLOCK
        key_seen = n_ok & ((jn < LOCAL) | _strided(jn, o_h, STRIDE))
        q_lo = 0
        q_hi = tl.where(tl.max(key_seen.to(tl.int32), 0) > 0, n, 0)
    if q_lo < q_hi:
        k = tl.load(K + krows, mask=kv_mask, other=0.0)
        v = tl.load(V + krows, mask=kv_mask, other=0.0)
        for m0 in range(q_lo, q_hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < q_hi
            qrows = (start + offs_m)[:, None] * stride_t + h * stride_h + offs_d[None, :]
            q = tl.load(Q + qrows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(DO + qrows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            lse2 = tl.load(LSE2 + (start + offs_m) * num_heads + h, mask=m_ok, other=float("inf"))
            delta = tl.load(Delta + (start + offs_m) * num_heads + h, mask=m_ok, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
            keep = key_seen[:, None] & m_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :])
            pt = tl.where(keep, tl.exp2(st - lse2[None, :]), 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            dst = tl.where(keep, pt * (dpt - delta[None, :]), 0.0)  # an unseen key's row may hold anything
            dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
    tl.store(DK + krows, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + krows, dv.to(DV.dtype.element_ty), mask=kv_mask)


def s2_tiles(dtype: torch.dtype, head_dim: int, block: int) -> tuple[dict, dict]:
    """The hand rules (families s2_fwd and s2_bwd of kernels/_launch_configs.py): the forward's
    BLOCK_M queries a program walking key chunks of BLOCK_N; the backward's dQ programs likewise
    (BLOCK_M, BLOCK_N) and its dK/dV programs N_KV keys walking query steps of M_KV. The dense
    kernels' choices (docs/tuning.md) where the S2 block allows them (every tile divides the
    block: causal tiles lie in one block); 16-row tiles in fp32, above D = 128 and in the interpreter."""
    if INTERPRET or dtype == torch.float32 or head_dim > 128:  # larger tiles spill above D = 128
        return (dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
                dict(BLOCK_M=16, BLOCK_N=16, M_KV=16, N_KV=16, num_warps=4, num_stages=1))
    bm = 64 if block % 64 == 0 else 32 if block % 32 == 0 else 16
    step = min(bm, 32 if head_dim <= 64 else 16)
    # 64-row tiles spill with 4 warps at D = 128 (experiments.bench.gpu_check --ptxas)
    warps = 4 if head_dim <= 64 or bm == 16 else 8
    return (dict(BLOCK_M=bm, BLOCK_N=step, num_warps=warps, num_stages=3),
            dict(BLOCK_M=bm, BLOCK_N=step, M_KV=step, N_KV=bm, num_warps=warps, num_stages=3))


def fits(cfg: dict, block: int, causal: bool) -> bool:
    """Whether a launch config of either family can run the layout's block: key chunks (BLOCK_N)
    divide the block; in causal mode query tiles (BLOCK_M) and dK/dV key tiles (N_KV) too."""
    tiles = [cfg["BLOCK_N"]] + ([cfg["BLOCK_M"], cfg.get("N_KV", block)] if causal else [])
    return all(t > 0 and block % t == 0 for t in tiles)


# launch keywords per (dtype, head dim, layout, causal, shape bucket): built once
_KW: dict = _lc.register_cache({})


def _launch_args(q: torch.Tensor, shards, causal: bool, B: int, max_seq_len: int) -> tuple[dict, dict, dict]:
    """Launch keywords of the forward, dQ and dK/dV kernels: the hand rules, or a launch table's
    (or a forced) config where it fits the block."""
    T, H, D = q.shape
    bucket = _lc.bucket(B, max_seq_len, T, H) if _lc.active() else ()  # host ints: no sync
    key = (q.dtype, D, shards.block, shards.local_blocks, shards.stride, causal, bucket)
    kws = _KW.get(key)
    if kws is None:
        fwd, bwd = s2_tiles(q.dtype, D, shards.block)
        if bucket:
            feats = (*bucket, D, q.dtype, int(causal))
            tuned_fwd, tuned_bwd = _lc.tuned("s2_fwd", feats, fwd), _lc.tuned("s2_bwd", feats, bwd)
            fwd = tuned_fwd if fits(tuned_fwd, shards.block, causal) else fwd
            bwd = tuned_bwd if fits(tuned_bwd, shards.block, causal) else bwd
        common = dict(S2_BLOCK=shards.block, LOCAL=shards.local_blocks, STRIDE=shards.stride, CAUSAL=causal,
                      BLOCK_D=col_block(D, 16, 256), HEAD_DIM=D, DOT_PREC=dot_precision(q.dtype))
        run = dict(num_warps=bwd["num_warps"], num_stages=bwd["num_stages"])
        kws = (dict(common, **fwd), dict(common, BLOCK_M=bwd["BLOCK_M"], BLOCK_N=bwd["BLOCK_N"], **run),
               dict(common, BLOCK_M=bwd["M_KV"], BLOCK_N=bwd["N_KV"], **run))
        if q.dtype != torch.float32:  # fp32's DOT_PREC follows a torch setting: not cached
            _KW[key] = kws
    return kws


_HEAD_OFFSETS: dict[tuple, torch.Tensor] = {}


def _head_offsets(shards, num_heads: int, device) -> torch.Tensor:
    """The heads' stride offsets [H] int32 on the device, made once per (offsets, device) and
    kept: a tensor built from host ints on every call is a host-to-device copy, which a CUDA
    graph capture refuses (the training loop's graphs warm up first, so the capture finds it)."""
    key = (shards.offsets_for(num_heads), torch.device(device))
    heads = _HEAD_OFFSETS.get(key)
    if heads is None:
        heads = _HEAD_OFFSETS[key] = torch.tensor(key[0], dtype=torch.int32, device=device)
    return heads


@torch.compiler.disable
def s2_attention_fwd(q, k, v, offsets, max_seq_len: int, shards, causal: bool, scale: float):
    """(out [T, H, D] in q's dtype, lse2 [T, H] fp32 in base 2, +inf for rows that see nothing)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    T, H, _ = q.shape
    B = offsets.numel() - 1
    out = torch.zeros_like(q)
    lse2 = torch.full((T, H), float("inf"), dtype=torch.float32, device=q.device)
    if T and B and max_seq_len:
        kw, _, _ = _launch_args(q, shards, causal, B, max_seq_len)
        grid = (triton.cdiv(max_seq_len, kw["BLOCK_M"]), B, H)
        _s2_fwd[grid](q, k, v, out, lse2, offsets, _head_offsets(shards, H, q.device), q.stride(0), q.stride(1),
                      H, max_seq_len, scale * LOG2E, **kw)
    return out, lse2


@torch.compiler.disable
def s2_attention_bwd(dout, q, k, v, out, lse2, offsets, max_seq_len: int, shards, causal: bool, scale: float):
    """dq, dk, dv of s2_attention_fwd."""
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    T, H, _ = q.shape
    B = offsets.numel() - 1
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if T and B and max_seq_len:
        delta = (dout.float() * out.float()).sum(-1).contiguous()  # [T, H]
        _, kw, kv_kw = _launch_args(q, shards, causal, B, max_seq_len)
        heads = _head_offsets(shards, H, q.device)
        common = (offsets, heads, q.stride(0), q.stride(1), H, max_seq_len, scale * LOG2E, scale)
        _s2_bwd_dq[(triton.cdiv(max_seq_len, kw["BLOCK_M"]), B, H)](q, k, v, dout, dq, lse2, delta, *common, **kw)
        _s2_bwd_dkdv[(triton.cdiv(max_seq_len, kv_kw["BLOCK_N"]), B, H)](q, k, v, dout, dk, dv, lse2, delta,
                                                                        *common, **kv_kw)
    return dq, dk, dv
