"""Triton pieces shared by the jagged feature-interaction kernels.

Importing this module imports Triton: the op modules import it lazily, only on the Triton path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import interpreter_on


@triton.jit
def _zero_rows(
    ptr, stride_row, stride_col, row_begin, row_end, cols, col_ok, pid, nprog,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Store zeros into rows [row_begin, row_end) x `cols` of a [rows, cols] tensor.

    Used for the jagged rows past max_seq_len: `nprog` programs share the rows grid-stride
    (program `pid` takes row blocks pid, pid + nprog, ...), so every row is written once and
    the common case (no sequence longer than max_seq_len) costs one empty loop.
    """
    rows0 = tl.arange(0, BLOCK_R).to(tl.int64)
    zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=ptr.dtype.element_ty)
    for start in range(row_begin + pid * BLOCK_R, row_end, nprog * BLOCK_R):
        rows = start + rows0
        mask = (rows[:, None] < row_end) & col_ok[None, :]
        tl.store(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, zeros, mask=mask)


def col_block(n: int, lo: int = 16, hi: int = 128) -> int:
    """Power-of-two block covering `n` columns, clamped to [lo, hi]; the kernels mask the rest."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 tl.dot follows torch's matmul setting (IEEE unless the user allowed TF32)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def dot_upcast(dtype: torch.dtype) -> bool:
    """True only under TRITON_INTERPRET=1 with bf16 operands: the interpreter's tl.dot multiplies
    bf16 bit patterns (triton-lang/triton#11584), so the kernels cast those tiles to fp32 first
    (exact: a bf16 product fits in fp32). Compiled kernels never take this branch."""
    return interpreter_on() and dtype == torch.bfloat16
