"""Triton kernels and launchers for jagged_softmax (forward and backward).

Grid (B, column blocks of H): one program owns whole columns of one sequence, so the
reductions over the sequence need no atomics and no second launch. Each program streams the
sequence twice in BLOCK_N-row tiles, whatever its length, with fp32 statistics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import _zero_rows, col_block

_TILE = 4096  # elements per [BLOCK_N, BLOCK_H] tile


# Forward. Pass 1 keeps the online (max m, sum s) pair per column: s is rescaled by
# exp(m_old - m_new) whenever the max grows, so exp never overflows (as in flash attention);
# a column that has seen only -inf keeps m = -inf and uses 0 as its shift to avoid inf - inf.
# Pass 2 writes exp(x - m) / s. Rows past max_seq_len are written with zeros.
@triton.jit
def _jagged_softmax_fwd_kernel(
    x_ptr, offsets_ptr, y_ptr, N, H,
    stride_xt, stride_xh, stride_yt, stride_yh,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    length = tl.minimum(end - begin, N)
    rows0 = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, length, BLOCK_N):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh,
                    mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[None, :]), axis=0)
        m = m_new
    shift = tl.where(m == float("-inf"), 0.0, m)
    s = tl.where(s > 0.0, s, 1.0)  # only empty/masked columns have s == 0; they store nothing
    for start in range(0, length, BLOCK_N):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh,
                    mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - shift[None, :]) / s[None, :]
        tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, y, mask=mask)
    _zero_rows(y_ptr, stride_yt, stride_yh, begin + N, end, cols, col_ok, 0, 1, BLOCK_N, BLOCK_H)


# Backward: grad_x = y * (g - sum_rows(g * y)) per column, the sum in fp32 (pass 1), then the
# elementwise pass 2; rows past max_seq_len get zero gradient.
@triton.jit
def _jagged_softmax_bwd_kernel(
    g_ptr, y_ptr, offsets_ptr, gx_ptr, N, H,
    stride_gt, stride_gh, stride_yt, stride_yh, stride_xt, stride_xh,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    length = tl.minimum(end - begin, N)
    rows0 = tl.arange(0, BLOCK_N)
    dot = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, length, BLOCK_N):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        g = tl.load(g_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gh, mask=mask, other=0.0)
        y = tl.load(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, mask=mask, other=0.0)
        dot += tl.sum(g.to(tl.float32) * y.to(tl.float32), axis=0)
    for start in range(0, length, BLOCK_N):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        g = tl.load(g_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gh, mask=mask, other=0.0)
        y = tl.load(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, mask=mask, other=0.0)
        gx = y.to(tl.float32) * (g.to(tl.float32) - dot[None, :])
        tl.store(gx_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh, gx, mask=mask)
    _zero_rows(gx_ptr, stride_xt, stride_xh, begin + N, end, cols, col_ok, 0, 1, BLOCK_N, BLOCK_H)


def _blocks(H: int) -> tuple[int, int]:
    block_h = col_block(H, lo=16, hi=64)
    return _TILE // block_h, block_h


def jagged_softmax_fwd_triton(values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    T, H = values.shape
    out = new_output((T, H), values)  # [T, H]
    if out.numel() == 0:
        return out
    block_n, block_h = _blocks(H)
    grid = (offsets.numel() - 1, triton.cdiv(H, block_h))
    with device_guard(values):
        _jagged_softmax_fwd_kernel[grid](
            values, offsets, out, max_seq_len, H,
            values.stride(0), values.stride(1), out.stride(0), out.stride(1),
            BLOCK_N=block_n, BLOCK_H=block_h,
        )
    return out


def jagged_softmax_bwd_triton(
    grad: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    T, H = out.shape
    grad_values = new_output((T, H), out)  # [T, H]
    if grad_values.numel() == 0:
        return grad_values
    block_n, block_h = _blocks(H)
    grid = (offsets.numel() - 1, triton.cdiv(H, block_h))
    with device_guard(out):
        _jagged_softmax_bwd_kernel[grid](
            grad, out, offsets, grad_values, max_seq_len, H,
            grad.stride(0), grad.stride(1), out.stride(0), out.stride(1),
            grad_values.stride(0), grad_values.stride(1),
            BLOCK_N=block_n, BLOCK_H=block_h,
        )
    return grad_values
