"""Triton kernels and launchers for jagged <-> padded conversions.

Both kernels run on a grid (B, row blocks of N, column blocks of D); they only move data, so
they are exact in every dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import _zero_rows, col_block

_BLOCK_N = 32


# One program: rows [pid1 * BLOCK_N, +BLOCK_N) x columns of block pid2 of padded[b]. Rows below
# the sequence's (truncated) length copy values, the rest take padding_value; every padded
# element is written and no jagged row past max_seq_len is read.
@triton.jit
def _jagged_to_padded_kernel(
    values_ptr, offsets_ptr, out_ptr, padding_value, N, D,
    stride_vt, stride_vd, stride_ob, stride_on, stride_od,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    length = tl.minimum(tl.load(offsets_ptr + b + 1).to(tl.int64) - begin, N)
    col_ok = cols[None, :] < D
    src = values_ptr + (begin + rows)[:, None] * stride_vt + cols[None, :] * stride_vd
    x = tl.load(src, mask=(rows[:, None] < length) & col_ok, other=padding_value)
    dst = out_ptr + b * stride_ob + rows[:, None] * stride_on + cols[None, :] * stride_od
    tl.store(dst, x, mask=(rows[:, None] < N) & col_ok)


# One program: the same tile, in the other direction. Rows < min(length, N) copy padded[b];
# jagged rows >= N are written with zeros, shared grid-stride by the row-block programs.
@triton.jit
def _padded_to_jagged_kernel(
    padded_ptr, offsets_ptr, out_ptr, N, D,
    stride_pb, stride_pn, stride_pd, stride_ot, stride_od,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    length = tl.minimum(end - begin, N)
    col_ok = cols < D
    if pid_n * BLOCK_N < length:
        mask = (rows[:, None] < length) & col_ok[None, :]
        src = padded_ptr + b * stride_pb + rows[:, None] * stride_pn + cols[None, :] * stride_pd
        x = tl.load(src, mask=mask)
        dst = out_ptr + (begin + rows)[:, None] * stride_ot + cols[None, :] * stride_od
        tl.store(dst, x, mask=mask)
    _zero_rows(out_ptr, stride_ot, stride_od, begin + N, end, cols, col_ok,
               pid_n, tl.num_programs(1), BLOCK_N, BLOCK_D)


def jagged_to_padded_triton(
    values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int, padding_value: float
) -> torch.Tensor:
    B, D = offsets.numel() - 1, values.shape[1]
    out = new_output((B, max_seq_len, D), values)  # [B, N, D]
    if out.numel() == 0:
        return out
    block_d = col_block(D)
    grid = (B, triton.cdiv(max_seq_len, _BLOCK_N), triton.cdiv(D, block_d))
    with device_guard(values):
        _jagged_to_padded_kernel[grid](
            values, offsets, out, padding_value, max_seq_len, D,
            values.stride(0), values.stride(1), out.stride(0), out.stride(1), out.stride(2),
            BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
        )
    return out


def padded_to_jagged_triton(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    B, N, D = padded.shape
    out = new_output((total, D), padded)  # [T, D]
    if out.numel() == 0:
        return out
    block_d = col_block(D)
    grid = (B, max(1, triton.cdiv(N, _BLOCK_N)), triton.cdiv(D, block_d))
    with device_guard(padded):
        _padded_to_jagged_kernel[grid](
            padded, offsets, out, N, D,
            padded.stride(0), padded.stride(1), padded.stride(2), out.stride(0), out.stride(1),
            BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
        )
    return out
