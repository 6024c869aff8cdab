"""Triton kernels and launchers for jagged_dense_bmm and jagged_jagged_bmm.

The two kernels cover all six products of the forward and backward passes (the launchers take
any strides, so a transposed operand is a view, never a copy):

    jagged_dense_bmm   y_b = x_b @ W_b            dx_b = dy_b @ W_b^T   dW_b = x_b^T @ dy_b
    jagged_jagged_bmm  C_b = a_b^T @ c_b          da_b = c_b @ dC_b^T   dc_b = a_b @ dC_b

Both accumulate tl.dot tiles in fp32 and round once on the store. fp32 inputs use IEEE
products unless torch allows TF32 (``torch.set_float32_matmul_precision``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import _zero_rows, col_block, dot_precision, dot_upcast

_BLOCK_T = 64  # rows of a sequence per tile
_BLOCK_M = 64  # output columns per tile
_BLOCK_K = 32  # reduction step


# jagged [T, K] @ dense [B, K, M] -> jagged [T, M]. Grid (B, row blocks of N, column blocks of
# M): one program computes a [BLOCK_T, BLOCK_M] tile of sequence b, looping over K. Programs
# whose rows start past the sequence's length skip the product (no work on padding); rows past
# max_seq_len are zeroed grid-stride by the row-block programs.
@triton.jit
def _jagged_dense_bmm_kernel(
    a_ptr, w_ptr, c_ptr, offsets_ptr, N, K, M,
    stride_at, stride_ak, stride_wb, stride_wk, stride_wm, stride_ct, stride_cm,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < M
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    length = tl.minimum(end - begin, N)
    if pid_t * BLOCK_T < length:
        rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < length
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (begin + rows)[:, None] * stride_at + ks[None, :] * stride_ak
        w_ptrs = w_ptr + b * stride_wb + ks[:, None] * stride_wk + cols[None, :] * stride_wm
        acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = (k + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        c_ptrs = c_ptr + (begin + rows)[:, None] * stride_ct + cols[None, :] * stride_cm
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    _zero_rows(c_ptr, stride_ct, stride_cm, begin + N, end, cols, col_ok,
               pid_t, tl.num_programs(1), BLOCK_T, BLOCK_M)


# jagged [T, K]^T @ jagged [T, M] -> dense [B, K, M]. Grid (B, row blocks of K, column blocks
# of M): one program owns a [BLOCK_K, BLOCK_M] tile of C_b and reduces over the first
# min(len_b, N) rows of the sequence, so no atomics; an empty sequence stores zeros.
@triton.jit
def _jagged_jagged_bmm_kernel(
    a_ptr, c_ptr, out_ptr, offsets_ptr, N, K, M,
    stride_at, stride_ak, stride_ct, stride_cm, stride_ob, stride_ok, stride_om,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_ok = ks < K
    col_ok = cols < M
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    length = tl.minimum(tl.load(offsets_ptr + b + 1).to(tl.int64) - begin, N)
    ts = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
    for t in range(0, length, BLOCK_T):
        t_ok = (t + ts) < length
        rows = begin + t + ts
        a_t = tl.load(a_ptr + ks[:, None] * stride_ak + rows[None, :] * stride_at,
                      mask=k_ok[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_T]
        c = tl.load(c_ptr + rows[:, None] * stride_ct + cols[None, :] * stride_cm,
                    mask=t_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_M]
        if UPCAST:
            a_t, c = a_t.to(tl.float32), c.to(tl.float32)
        acc = tl.dot(a_t, c, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + b * stride_ob + ks[:, None] * stride_ok + cols[None, :] * stride_om
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def jagged_dense_bmm_triton(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    """values [T, K] @ dense [B, K, M] per sequence -> [T, M]; any strides."""
    (T, K), M = values.shape, dense.shape[2]
    out = new_output((T, M), values)  # [T, M]
    if out.numel() == 0:
        return out
    block_m = col_block(M, hi=_BLOCK_M)
    block_k = col_block(K, hi=_BLOCK_K)
    grid = (offsets.numel() - 1, max(1, triton.cdiv(max_seq_len, _BLOCK_T)), triton.cdiv(M, block_m))
    with device_guard(values):
        _jagged_dense_bmm_kernel[grid](
            values, dense, out, offsets, max_seq_len, K, M,
            values.stride(0), values.stride(1), dense.stride(0), dense.stride(1), dense.stride(2),
            out.stride(0), out.stride(1),
            BLOCK_T=_BLOCK_T, BLOCK_K=block_k, BLOCK_M=block_m, PRECISION=dot_precision(values.dtype),
            UPCAST=dot_upcast(values.dtype),
        )
    return out


def jagged_jagged_bmm_triton(
    a: torch.Tensor, c: torch.Tensor, offsets: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    """a [T, K]^T @ c [T, M] per sequence -> [B, K, M]; any strides."""
    B, K, M = offsets.numel() - 1, a.shape[1], c.shape[1]
    out = new_output((B, K, M), a)  # [B, K, M]
    if out.numel() == 0:
        return out
    block_k = col_block(K, hi=_BLOCK_M)
    block_m = col_block(M, hi=_BLOCK_M)
    grid = (B, triton.cdiv(K, block_k), triton.cdiv(M, block_m))
    with device_guard(a):
        _jagged_jagged_bmm_kernel[grid](
            a, c, out, offsets, max_seq_len, K, M,
            a.stride(0), a.stride(1), c.stride(0), c.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            BLOCK_K=block_k, BLOCK_M=block_m, BLOCK_T=_BLOCK_K, PRECISION=dot_precision(a.dtype),
            UPCAST=dot_upcast(a.dtype),
        )
    return out
