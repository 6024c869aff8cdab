"""Triton kernels and launchers for jagged_dense_elementwise_add / _mul (forward and backward).

Forward: the work slots of _triton_common (row blocks of real sequences, column blocks of D),
since it writes jagged rows only; no program is spent on padding at low density. Backward: the
padded grid (B, row blocks of N, column blocks of D), N = dense.shape[1], since it writes every
element of grad_dense. Math in fp32, one rounding on the store, as torch does for low-precision
add and mul."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._jagged_common import device_guard, new_output
from kernels._triton_common import slot_tile, zero_rows, col_block, num_slots

# Launch parameters (module level, so a tuning script can override them). Forward: jagged rows
# per work slot, the widest column block, warps. Backward: padded rows per tile, the same.
FWD_CONFIG = {"BLOCK_N": 64, "BLOCK_D": 128, "num_warps": 4}
BWD_CONFIG = {"BLOCK_N": 32, "BLOCK_D": 128, "num_warps": 4}


# Forward, one program per work slot pid0 (rows [j * BLOCK_N, +BLOCK_N) of sequence b) x
# columns of block pid1: out = x + dense[b, n] (or x * dense[b, n]) for n < min(len_b, N). Rows
# in [N, len_b) read nothing (masked loads give 0 and 0 + 0 = 0 * 0 = 0) and store zeros; the
# slots of b cover all its rows. Padding rows of dense are not read.
@triton.jit(do_not_specialize=["N", "num_seqs"])
def _jagged_dense_elementwise_fwd_kernel(
    x_ptr, d_ptr, out_ptr, offsets_ptr, N, D, num_seqs,
    stride_xt, stride_xd, stride_db, stride_dn, stride_dd, stride_ot, stride_od,
    IS_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, begin, n_rows, row0, rows, cols = slot_tile(offsets_ptr, tl.program_id(0), tl.program_id(1),
                                                    num_seqs, BLOCK_N, BLOCK_D)
    if row0 >= n_rows:  # the spare slot of b
        return
    col_ok = cols[None, :] < D
    mask = (rows[:, None] < tl.minimum(n_rows, N)) & col_ok
    jag = (begin + rows)[:, None]
    x_ptrs = x_ptr + jag * stride_xt + cols[None, :] * stride_xd
    d_ptrs = (d_ptr + b.to(tl.int64) * stride_db + rows[:, None] * stride_dn
              + cols[None, :] * stride_dd)
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
    y = x * d if IS_MUL else x + d
    out_ptrs = out_ptr + jag * stride_ot + cols[None, :] * stride_od
    tl.store(out_ptrs, y, mask=(rows[:, None] < n_rows) & col_ok)


# Backward, both gradients in one pass. At padded position n of sequence b:
#   add: grad_x = g,            grad_dense = g            (n < len_b), 0 (n >= len_b)
#   mul: grad_x = g * dense,    grad_dense = g * x        (n < len_b), 0 (n >= len_b)
# Every element of grad_dense [B, N, D] is written; jagged rows past N get zero grad_x.
@triton.jit
def _jagged_dense_elementwise_bwd_kernel(
    g_ptr, x_ptr, d_ptr, gx_ptr, gd_ptr, offsets_ptr, N, D,
    stride_gt, stride_gd, stride_xt, stride_xd, stride_db, stride_dn, stride_dd,
    stride_gxt, stride_gxd, stride_gdb, stride_gdn, stride_gdd,
    IS_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    begin = tl.load(offsets_ptr + b).to(tl.int64)
    end = tl.load(offsets_ptr + b + 1).to(tl.int64)
    length = tl.minimum(end - begin, N)
    mask = (rows[:, None] < length) & col_ok[None, :]
    jag = (begin + rows)[:, None]
    dense_off = b * stride_db + rows[:, None] * stride_dn + cols[None, :] * stride_dd
    g = tl.load(g_ptr + jag * stride_gt + cols[None, :] * stride_gd, mask=mask, other=0.0).to(tl.float32)
    if IS_MUL:
        x = tl.load(x_ptr + jag * stride_xt + cols[None, :] * stride_xd, mask=mask, other=0.0)
        d = tl.load(d_ptr + dense_off, mask=mask, other=0.0)
        gx = g * d.to(tl.float32)
        gd = g * x.to(tl.float32)
    else:
        gx = g
        gd = g
    tl.store(gx_ptr + jag * stride_gxt + cols[None, :] * stride_gxd, gx, mask=mask)
    gd_ptrs = gd_ptr + b * stride_gdb + rows[:, None] * stride_gdn + cols[None, :] * stride_gdd
    tl.store(gd_ptrs, gd, mask=(rows[:, None] < N) & col_ok[None, :])
    zero_rows(gx_ptr, stride_gxt, stride_gxd, begin + N, end, cols, col_ok,
               pid_n, tl.num_programs(1), BLOCK_N, BLOCK_D)


def jagged_dense_elementwise_fwd_triton(
    values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, is_mul: bool
) -> torch.Tensor:
    B, N, D = dense.shape
    out = new_output(tuple(values.shape), values)  # [T, D]
    if out.numel() == 0:
        return out
    cfg = FWD_CONFIG
    block_d = col_block(D, hi=cfg["BLOCK_D"])
    grid = (num_slots(values.shape[0], B, cfg["BLOCK_N"]), triton.cdiv(D, block_d))
    with device_guard(values):
        _jagged_dense_elementwise_fwd_kernel[grid](
            values, dense, out, offsets, N, D, B,
            values.stride(0), values.stride(1), dense.stride(0), dense.stride(1), dense.stride(2),
            out.stride(0), out.stride(1),
            IS_MUL=is_mul, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d, num_warps=cfg["num_warps"],
        )
    return out


def jagged_dense_elementwise_bwd_triton(
    grad: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor | None, dense: torch.Tensor | None, max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_values [T, D], grad_dense [B, N, D]); values and dense are given for mul only."""
    (T, D), B, N = grad.shape, offsets.numel() - 1, max_seq_len
    grad_values = new_output((T, D), grad)
    grad_dense = new_output((B, N, D), grad)
    if B == 0 or D == 0:
        return grad_values, grad_dense
    is_mul = values is not None
    x, d = (values, dense) if is_mul else (grad, grad_dense)  # unused placeholders for add
    block_d = col_block(D, hi=BWD_CONFIG["BLOCK_D"])
    grid = (B, max(1, triton.cdiv(N, BWD_CONFIG["BLOCK_N"])), triton.cdiv(D, block_d))
    with device_guard(grad):
        _jagged_dense_elementwise_bwd_kernel[grid](
            grad, x, d, grad_values, grad_dense, offsets, N, D,
            grad.stride(0), grad.stride(1), x.stride(0), x.stride(1),
            d.stride(0), d.stride(1), d.stride(2),
            grad_values.stride(0), grad_values.stride(1),
            grad_dense.stride(0), grad_dense.stride(1), grad_dense.stride(2),
            IS_MUL=is_mul, BLOCK_N=BWD_CONFIG["BLOCK_N"], BLOCK_D=block_d,
            num_warps=BWD_CONFIG["num_warps"],
        )
    return grad_values, grad_dense
