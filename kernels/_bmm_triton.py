"""Triton kernels and launchers for jagged_dense_bmm and jagged_jagged_bmm.

The two kernels cover all six products of the forward and backward passes (a transposed operand is
a strided view, never a copy; docs/kernels.md#batched-matrix-products). Both accumulate tl.dot
tiles in fp32 and round once on the store; fp32 inputs use IEEE products unless torch allows TF32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import _launch_configs as _lc
from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import slot_tile, col_block, dot_precision, num_slots

# Launch parameters by element size (2: bf16/fp16, 4: fp32), module level so a tuning script can
# override them; `bmm_config` clamps the blocks to the operands. jagged_dense_bmm: BLOCK_T rows
# of a sequence per work slot, BLOCK_M output columns, BLOCK_K reduction step. jagged_jagged_bmm:
# a [BLOCK_K, BLOCK_M] tile of the output, BLOCK_T rows of the sequence per reduction step.
# fp32 tiles are smaller: the same tile takes twice the shared memory per stage.
DENSE_BMM_CONFIGS = {
    2: {"BLOCK_T": 128, "BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    4: {"BLOCK_T": 64, "BLOCK_M": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
}
JAGGED_BMM_CONFIGS = {  # T_SPLITS > 1: split-T (see the kernel), set by `split_t` where it pays
    2: {"BLOCK_K": 128, "BLOCK_M": 128, "BLOCK_T": 64, "T_SPLITS": 1, "num_warps": 8, "num_stages": 3},
    4: {"BLOCK_K": 64, "BLOCK_M": 64, "BLOCK_T": 32, "T_SPLITS": 1, "num_warps": 4, "num_stages": 3},
}
# split-T in the hand rule: where the output tiles leave at least half the SMs idle and sequences
# are long, SPLITS programs share each tile's reduction (docs/tuning.md, "jagged_jagged_bmm split-T")
SPLIT_T_MIN_MEAN_LEN, SPLIT_T_SPLITS = 2048, 4


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_t(B: int, T: int, K: int, M: int, cfg: dict, sms: int) -> int:
    """The hand rule's T_SPLITS: SPLIT_T_SPLITS when B x the output tiles fill at most half of
    `sms` SMs and the mean length T / B is at least SPLIT_T_MIN_MEAN_LEN, else 1 (also where the
    SM count is unknown, sms = 0: the interpreter)."""
    programs = B * triton.cdiv(K, cfg["BLOCK_K"]) * triton.cdiv(M, cfg["BLOCK_M"])
    few = 0 < 2 * programs <= sms
    return SPLIT_T_SPLITS if few and T // max(B, 1) >= SPLIT_T_MIN_MEAN_LEN else 1


def bmm_base_config(op: str, dtype: torch.dtype) -> dict:
    """The hand-rule launch dict of op ("dense" or "jagged") in dtype, before clamping."""
    table = DENSE_BMM_CONFIGS if op == "dense" else JAGGED_BMM_CONFIGS
    return table[4 if dtype.itemsize >= 4 else 2]


def bmm_config(op: str, K: int, M: int, dtype: torch.dtype, B: int, N: int, T: int, sms: int = 0) -> dict:
    """Launch keywords of op ("dense" or "jagged") for a [*, K] x [*, M] product in dtype: the
    hand rule or the launch table's pick (kernels/_launch_configs.py), clamped to the operands.
    `sms`: the device's SM count, for the hand rule's split-T (0: none)."""
    base = bmm_base_config(op, dtype)
    cfg = _lc.tuned(f"jagged_{op}_bmm", _lc.bucket(B, N, T, K, M, dtype), base) if _lc.active() else base
    hand = cfg is base
    cfg = dict(cfg, BLOCK_K=col_block(K, hi=cfg["BLOCK_K"]), BLOCK_M=col_block(M, hi=cfg["BLOCK_M"]),
               PRECISION=dot_precision(dtype))
    if op == "jagged" and hand:
        cfg["T_SPLITS"] = split_t(B, T, K, M, cfg, sms)
    return cfg


# jagged [T, K] @ dense [B, K, M] -> jagged [T, M]. Grid: work slots of BLOCK_T rows x column
# blocks of M, flattened with the column blocks fastest (the programs that read one A tile run
# side by side, so it comes from L2 after the first). One program computes the rows
# [j * BLOCK_T, +BLOCK_T) of sequence b (see _triton_common) x BLOCK_M columns, looping over K;
# no program is spent on padding. Rows in [max_seq_len, len_b) (the truncated tail) are written
# with zeros: their A rows are masked to 0, and a block entirely past max_seq_len skips the
# product.
@triton.jit(do_not_specialize=["N", "num_seqs"])
def _jagged_dense_bmm_kernel(
    a_ptr, w_ptr, c_ptr, offsets_ptr, N, K, M, num_seqs,
    stride_at, stride_ak, stride_wb, stride_wk, stride_wm, stride_ct, stride_cm,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n_mb = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    b, begin, n_rows, row0, rows, cols = slot_tile(offsets_ptr, pid // n_mb, pid % n_mb, num_seqs,
                                                    BLOCK_T, BLOCK_M)
    if row0 >= n_rows:  # the spare slot of b
        return
    col_ok = cols < M
    length = tl.minimum(n_rows, N)
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    if row0 < length:  # a block entirely past max_seq_len skips the product
        row_ok = rows < length
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (begin + rows)[:, None] * stride_at + ks[None, :] * stride_ak
        w_ptrs = (w_ptr + b.to(tl.int64) * stride_wb + ks[:, None] * stride_wk
                  + cols[None, :] * stride_wm)
        for k in range(0, K, BLOCK_K):
            k_ok = (k + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
    c_ptrs = c_ptr + (begin + rows)[:, None] * stride_ct + cols[None, :] * stride_cm
    c_ok = (rows < n_rows)[:, None] & col_ok[None, :]  # rows past max_seq_len store zeros
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_ok)


# jagged [T, K]^T @ jagged [T, M] -> dense [B, K, M]. Grid: B x row blocks of K x column blocks
# of M x T_SPLITS, flattened with b slowest (the programs that read one sequence run side by side,
# so its rows come from L2 after the first). With T_SPLITS = 1 one program owns a [BLOCK_K,
# BLOCK_M] tile of C_b and reduces over the first min(len_b, N) rows of the sequence, so no
# atomics; an empty sequence stores zeros. With T_SPLITS = S > 1 (split-T, for few long
# sequences: B x tiles programs leave SMs idle and the longest sequence's serial loop sets the
# time) the rows are cut in S chunks of whole BLOCK_T steps, and each program adds its partial
# tile into a zero-initialised fp32 output with relaxed atomics; a program whose chunk is empty
# returns at once (its zeros are already there).
@triton.jit(do_not_specialize=["N"])
def _jagged_jagged_bmm_kernel(
    a_ptr, c_ptr, out_ptr, offsets_ptr, N, K, M,
    stride_at, stride_ak, stride_ct, stride_cm, stride_ob, stride_ok, stride_om,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, T_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n_kb, n_mb = tl.cdiv(K, BLOCK_K), tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    split = pid % T_SPLITS
    pid = pid // T_SPLITS
    b = (pid // (n_kb * n_mb)).to(tl.int64)
    tile = pid % (n_kb * n_mb)
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    length = tl.minimum(tl.load(offsets_ptr + b + 1).to(tl.int64) - begin, N)
    chunk = tl.cdiv(tl.cdiv(length, T_SPLITS), BLOCK_T) * BLOCK_T  # whole BLOCK_T steps
    t_begin = split * chunk
    t_end = tl.minimum(length, t_begin + chunk)
    if T_SPLITS > 1:
        if t_begin >= t_end:
            return
    ks = (tile // n_mb) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (tile % n_mb) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_ok = ks < K
    col_ok = cols < M
    ts = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
    for t in range(t_begin, t_end, BLOCK_T):
        t_ok = (t + ts) < t_end
        rows = begin + t + ts
        a_t = tl.load(a_ptr + ks[:, None] * stride_ak + rows[None, :] * stride_at,
                      mask=k_ok[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_T]
        c = tl.load(c_ptr + rows[:, None] * stride_ct + cols[None, :] * stride_cm,
                    mask=t_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_M]
        acc = tl.dot(a_t, c, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + b * stride_ob + ks[:, None] * stride_ok + cols[None, :] * stride_om
    if T_SPLITS > 1:
        tl.atomic_add(out_ptrs, acc, mask=k_ok[:, None] & col_ok[None, :], sem="relaxed")
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def jagged_dense_bmm_triton(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    """values [T, K] @ dense [B, K, M] per sequence -> [T, M]; any strides."""
    (T, K), M = values.shape, dense.shape[2]
    out = new_output((T, M), values)  # [T, M]
    if out.numel() == 0:
        return out
    B = offsets.numel() - 1
    kw = bmm_config("dense", K, M, values.dtype, B, max_seq_len, T)
    grid = (num_slots(T, B, kw["BLOCK_T"]) * triton.cdiv(M, kw["BLOCK_M"]),)
    with device_guard(values):
        _jagged_dense_bmm_kernel[grid](
            values, dense, out, offsets, max_seq_len, K, M, B,
            values.stride(0), values.stride(1), dense.stride(0), dense.stride(1), dense.stride(2),
            out.stride(0), out.stride(1), **kw,
        )
    return out


def jagged_jagged_bmm_triton(
    a: torch.Tensor, c: torch.Tensor, offsets: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    """a [T, K]^T @ c [T, M] per sequence -> [B, K, M]; any strides."""
    B, K, M = offsets.numel() - 1, a.shape[1], c.shape[1]
    if B * K * M == 0:
        return new_output((B, K, M), a)
    kw = bmm_config("jagged", K, M, a.dtype, B, max_seq_len, a.shape[0],
                    sm_count(a.device) if a.is_cuda else 0)
    if kw["T_SPLITS"] > 1 and torch.are_deterministic_algorithms_enabled():  # atomics add in arrival order
        kw = dict(kw, T_SPLITS=1)
    split = kw["T_SPLITS"] > 1  # the chunks' fp32 atomic sums, cast once at the end
    out = torch.zeros((B, K, M), dtype=torch.float32, device=a.device) if split else new_output((B, K, M), a)
    grid = (B * triton.cdiv(K, kw["BLOCK_K"]) * triton.cdiv(M, kw["BLOCK_M"]) * kw["T_SPLITS"],)
    with device_guard(a):
        _jagged_jagged_bmm_kernel[grid](
            a, c, out, offsets, max_seq_len, K, M,
            a.stride(0), a.stride(1), c.stride(0), c.stride(1),
            out.stride(0), out.stride(1), out.stride(2), **kw,
        )
    return out.to(a.dtype) if split else out
