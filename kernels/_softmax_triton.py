"""Triton kernels and launchers for jagged_softmax (forward and backward).

Grid: one program per (sequence b, column block of H), column blocks fastest; a program owns whole
columns of one sequence (no atomics, one launch). A sequence that fits in one tile is loaded once, in
the smallest tile of the ladder SMALL_N .. BLOCK_N that holds it; a longer one is streamed twice in
STREAM_N-row tiles. Statistics in fp32; exp2 of (x - max) * log2(e); one reciprocal per column."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _launch_configs as _lc
from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import LOG2E_C, zero_rows, col_block

# Launch parameters (module level, so a tuning script can override them), forward and backward:
# BLOCK_N rows of the largest single tile, SMALL_N (<= BLOCK_N, both powers of two) rows of the
# smallest, STREAM_N rows of the tiles a longer sequence is streamed in, BLOCK_H the widest
# column block, warps. BLOCK_N, BLOCK_H and warps: the fastest single config over the cost-model
# sweep's five softmax shapes (docs/tuning.md, "First GPU sweep"); SMALL_N 32 and STREAM_N 64:
# docs/tuning.md, "Softmax instruction counts" (a kernel's registers are those of its largest
# path, so the streamed path, rare where the mean length fits a single tile, keeps a small tile;
# `softmax_config` gives it BLOCK_N rows where most sequences stream).
SOFTMAX_CONFIG = {"BLOCK_N": 256, "SMALL_N": 32, "STREAM_N": 64, "BLOCK_H": 16, "num_warps": 4}


def softmax_config(B: int, T: int) -> dict:
    """The hand rule for B sequences of T rows in all: SOFTMAX_CONFIG, with streamed tiles of
    BLOCK_N rows where the mean length is longer than BLOCK_N (most sequences stream then)."""
    if T // max(B, 1) > SOFTMAX_CONFIG["BLOCK_N"]:
        return dict(SOFTMAX_CONFIG, STREAM_N=SOFTMAX_CONFIG["BLOCK_N"])
    return SOFTMAX_CONFIG


@triton.jit
def _seq_cols(offsets_ptr, N, H, BLOCK_H: tl.constexpr):
    """(begin, end, length, cols, col_ok) of this program: sequence pid // n_col_blocks."""
    n_cb = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    b = (pid // n_cb).to(tl.int64)
    cols = (pid % n_cb) * BLOCK_H + tl.arange(0, BLOCK_H)
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    return begin, end, tl.minimum(end - begin, N), cols, cols < H


@triton.jit
def _on_rung(length, SMALL_N: tl.constexpr, k: tl.constexpr):
    """Whether the single tile of SMALL_N << k rows is the smallest of the ladder that holds
    `length` rows: length in (SMALL_N << k) // 2, SMALL_N << k], from 0 on the first rung."""
    lo: tl.constexpr = 0 if k == 0 else (SMALL_N << k) // 2
    return (length > lo) & (length <= (SMALL_N << k))


# Forward, one tile: every row of the sequence at once. The column max m (-inf for a column of
# only -inf, which then uses 0 as its shift to avoid inf - inf), s = sum(exp(x - m)), then
# exp(x - m) / s from the registers: one read, one write.
@triton.jit
def _softmax_fwd_tile(x_ptr, y_ptr, begin, length, cols, col_ok,
                      stride_xt, stride_xh, stride_yt, stride_yh, ROWS: tl.constexpr):
    r = tl.arange(0, ROWS)
    mask = (r < length)[:, None] & col_ok[None, :]
    rows = begin + r
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh,
                mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    e = tl.math.exp2((x - shift[None, :]) * LOG2E_C)
    s = tl.sum(e, axis=0)
    inv = 1.0 / tl.where(s > 0.0, s, 1.0)  # only empty/masked columns have s == 0; they store nothing
    y = e * inv[None, :]
    tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, y, mask=mask)


# Forward, streamed: pass 1 keeps the online (max m, sum s) pair per column: s is rescaled by
# exp(m_old - m_new) whenever the max grows, so exp never overflows (as in flash attention), with
# the same -inf rule; pass 2 writes exp(x - m) / s.
@triton.jit
def _softmax_fwd_stream(x_ptr, y_ptr, begin, length, cols, col_ok,
                        stride_xt, stride_xh, stride_yt, stride_yh,
                        ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows0 = tl.arange(0, ROWS)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, length, ROWS):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh,
                    mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.math.exp2((m - shift) * LOG2E_C) + tl.sum(tl.math.exp2((x - shift[None, :]) * LOG2E_C), axis=0)
        m = m_new
    shift = tl.where(m == float("-inf"), 0.0, m)
    inv = 1.0 / tl.where(s > 0.0, s, 1.0)
    for start in range(0, length, ROWS):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh,
                    mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.math.exp2((x - shift[None, :]) * LOG2E_C) * inv[None, :]
        tl.store(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, y, mask=mask)


# Forward: softmax over the first min(len_b, N) rows of each column; rows past max_seq_len are
# written with zeros.
@triton.jit(do_not_specialize=["N"])
def _jagged_softmax_fwd_kernel(
    x_ptr, offsets_ptr, y_ptr, N, H,
    stride_xt, stride_xh, stride_yt, stride_yh,
    BLOCK_N: tl.constexpr, SMALL_N: tl.constexpr, RUNGS: tl.constexpr, STREAM_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    begin, end, length, cols, col_ok = _seq_cols(offsets_ptr, N, H, BLOCK_H)
    args = (x_ptr, y_ptr, begin, length, cols, col_ok, stride_xt, stride_xh, stride_yt, stride_yh)
    for k in tl.static_range(RUNGS):  # the tile of SMALL_N << k rows: lengths in (its half, it]
        if _on_rung(length, SMALL_N, k):
            _softmax_fwd_tile(*args, SMALL_N << k)
    if length > BLOCK_N:
        _softmax_fwd_stream(*args, STREAM_N, BLOCK_H)
    zero_rows(y_ptr, stride_yt, stride_yh, begin + N, end, cols, col_ok, 0, 1, BLOCK_N, BLOCK_H)


# Backward, one tile: grad_x = y * (g - sum_rows(g * y)) per column, the sum in fp32, g and y
# read once.
@triton.jit
def _softmax_bwd_tile(g_ptr, y_ptr, gx_ptr, begin, length, cols, col_ok,
                      stride_gt, stride_gh, stride_yt, stride_yh, stride_xt, stride_xh,
                      ROWS: tl.constexpr):
    r = tl.arange(0, ROWS)
    mask = (r < length)[:, None] & col_ok[None, :]
    rows = begin + r
    g = tl.load(g_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gh, mask=mask, other=0.0)
    y = tl.load(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, mask=mask, other=0.0)
    g, y = g.to(tl.float32), y.to(tl.float32)
    dot = tl.sum(g * y, axis=0)
    tl.store(gx_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh,
             y * (g - dot[None, :]), mask=mask)


# Backward, streamed: the sum in pass 1, the elementwise pass 2.
@triton.jit
def _softmax_bwd_stream(g_ptr, y_ptr, gx_ptr, begin, length, cols, col_ok,
                        stride_gt, stride_gh, stride_yt, stride_yh, stride_xt, stride_xh,
                        ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows0 = tl.arange(0, ROWS)
    dot = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, length, ROWS):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        g = tl.load(g_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gh, mask=mask, other=0.0)
        y = tl.load(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, mask=mask, other=0.0)
        dot += tl.sum(g.to(tl.float32) * y.to(tl.float32), axis=0)
    for start in range(0, length, ROWS):
        mask = ((start + rows0) < length)[:, None] & col_ok[None, :]
        rows = begin + start + rows0
        g = tl.load(g_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gh, mask=mask, other=0.0)
        y = tl.load(y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yh, mask=mask, other=0.0)
        gx = y.to(tl.float32) * (g.to(tl.float32) - dot[None, :])
        tl.store(gx_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh, gx, mask=mask)


# Backward: grad_x = y * (g - sum_rows(g * y)) per column; rows past max_seq_len get zero
# gradient.
@triton.jit(do_not_specialize=["N"])
def _jagged_softmax_bwd_kernel(
    g_ptr, y_ptr, offsets_ptr, gx_ptr, N, H,
    stride_gt, stride_gh, stride_yt, stride_yh, stride_xt, stride_xh,
    BLOCK_N: tl.constexpr, SMALL_N: tl.constexpr, RUNGS: tl.constexpr, STREAM_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    begin, end, length, cols, col_ok = _seq_cols(offsets_ptr, N, H, BLOCK_H)
    args = (g_ptr, y_ptr, gx_ptr, begin, length, cols, col_ok,
            stride_gt, stride_gh, stride_yt, stride_yh, stride_xt, stride_xh)
    for k in tl.static_range(RUNGS):  # as in the forward
        if _on_rung(length, SMALL_N, k):
            _softmax_bwd_tile(*args, SMALL_N << k)
    if length > BLOCK_N:
        _softmax_bwd_stream(*args, STREAM_N, BLOCK_H)
    zero_rows(gx_ptr, stride_xt, stride_xh, begin + N, end, cols, col_ok, 0, 1, BLOCK_N, BLOCK_H)


def _launch(H: int, B: int, family: str, N: int, T: int, dtype: torch.dtype) -> tuple[tuple[int], dict]:
    """(grid, launch keywords) from SOFTMAX_CONFIG (or the launch table's pick for this shape,
    kernels/_launch_configs.py): B x column blocks programs, flattened."""
    cfg = softmax_config(B, T)
    if _lc.active():
        cfg = _lc.tuned(family, _lc.bucket(B, N, T, H, dtype), cfg)
    block_h = col_block(H, lo=min(16, cfg["BLOCK_H"]), hi=cfg["BLOCK_H"])
    small = min(cfg["SMALL_N"], cfg["BLOCK_N"])
    kw = dict(BLOCK_N=cfg["BLOCK_N"], SMALL_N=small, RUNGS=(cfg["BLOCK_N"] // small).bit_length(),
              STREAM_N=cfg["STREAM_N"], BLOCK_H=block_h, num_warps=cfg["num_warps"])
    return (B * triton.cdiv(H, block_h),), kw


def jagged_softmax_fwd_triton(values: torch.Tensor, offsets: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    T, H = values.shape
    out = new_output((T, H), values)  # [T, H]
    if out.numel() == 0:
        return out
    grid, kw = _launch(H, offsets.numel() - 1, "softmax_fwd", max_seq_len, T, values.dtype)
    with device_guard(values):
        _jagged_softmax_fwd_kernel[grid](
            values, offsets, out, max_seq_len, H,
            values.stride(0), values.stride(1), out.stride(0), out.stride(1), **kw,
        )
    return out


def jagged_softmax_bwd_triton(
    grad: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, max_seq_len: int
) -> torch.Tensor:
    T, H = out.shape
    grad_values = new_output((T, H), out)  # [T, H]
    if grad_values.numel() == 0:
        return grad_values
    grid, kw = _launch(H, offsets.numel() - 1, "softmax_bwd", max_seq_len, T, out.dtype)
    with device_guard(out):
        _jagged_softmax_bwd_kernel[grid](
            grad, out, offsets, grad_values, max_seq_len, H,
            grad.stride(0), grad.stride(1), out.stride(0), out.stride(1),
            grad_values.stride(0), grad_values.stride(1), **kw,
        )
    return grad_values
