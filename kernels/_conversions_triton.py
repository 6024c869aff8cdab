"""Triton kernels and launchers for jagged <-> padded conversions.

jagged_to_padded writes every padded element, so it runs on the padded grid (B, row blocks of
N, column blocks of D). padded_to_jagged writes the jagged rows only, so it runs on the work
slots of _triton_common (row blocks of real sequences, column blocks of D): no program is
spent on padding at low density. Both only move data, so they are exact in every dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _launch_configs as _lc
from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import slot_tile, col_block, num_slots

_BLOCK_N = 32  # jagged_to_padded: padded rows per tile
# padded_to_jagged launch parameters (module level, so a tuning script can override them):
# jagged rows per work slot, the widest column block, warps. The cost-model sweep's five shapes
# (docs/tuning.md, "First GPU sweep") put this config within 1% of the best on each.
P2J_CONFIG = {"BLOCK_N": 128, "BLOCK_D": 128, "num_warps": 8}


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


# One program: work slot pid0 (rows [j * BLOCK_N, +BLOCK_N) of sequence b) x columns of block
# pid1. Rows < min(len_b, N) copy padded[b]; rows in [N, len_b) (the truncated tail) are written
# with zeros; the slots of b cover all its rows, so every jagged row is written exactly once.
@triton.jit(do_not_specialize=["N", "num_seqs"])
def _padded_to_jagged_kernel(
    padded_ptr, offsets_ptr, out_ptr, N, D, num_seqs,
    stride_pb, stride_pn, stride_pd, stride_ot, stride_od,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, begin, n_rows, row0, rows, cols = slot_tile(offsets_ptr, tl.program_id(0), tl.program_id(1),
                                                    num_seqs, BLOCK_N, BLOCK_D)
    if row0 >= n_rows:  # the spare slot of b
        return
    col_ok = cols[None, :] < D
    src = (padded_ptr + b.to(tl.int64) * stride_pb + rows[:, None] * stride_pn
           + cols[None, :] * stride_pd)
    x = tl.load(src, mask=(rows[:, None] < tl.minimum(n_rows, N)) & col_ok, other=0.0)
    dst = out_ptr + (begin + rows)[:, None] * stride_ot + cols[None, :] * stride_od
    tl.store(dst, x, mask=(rows[:, None] < n_rows) & col_ok)


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
    cfg = P2J_CONFIG
    if _lc.active():  # the launch table's pick for this shape (kernels/_launch_configs.py)
        cfg = _lc.tuned("padded_to_jagged", _lc.bucket(B, N, total, D, padded.dtype), cfg)
    block_d = col_block(D, hi=cfg["BLOCK_D"])
    grid = (num_slots(total, B, cfg["BLOCK_N"]), triton.cdiv(D, block_d))
    with device_guard(padded):
        _padded_to_jagged_kernel[grid](
            padded, offsets, out, N, D, B,
            padded.stride(0), padded.stride(1), padded.stride(2), out.stride(0), out.stride(1),
            BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d, num_warps=cfg["num_warps"],
        )
    return out
