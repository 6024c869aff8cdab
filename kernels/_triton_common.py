"""Triton pieces shared by the jagged kernels: the truncated-tail zeroing, the work slots (a
flat list of (row block, sequence) programs, used by attention and the row-wise ops) and the
launch helpers.

Importing this module imports Triton: the op modules import it lazily, only on the Triton path."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import interpreter_on

LOG2E = 1.4426950408889634  # log2(e): the kernels' softmax runs in base 2 (scores * scale * LOG2E)
LN2 = 0.6931471805599453  # ln(2): base-2 log-sum-exp back to natural log
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # the same numbers inside @triton.jit code
LN2_C: tl.constexpr = tl.constexpr(LN2)


def _patch_interpreter_bf16_dot() -> None:
    """TRITON_INTERPRET only: triton 3.6's interpreter multiplies bf16 tiles as their raw uint16
    bits (np.matmul on the storage); widen them to fp32 first (exact), as the GPU MMA does."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_jagged_bf16_dot", False):
        return
    create_dot = builder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = patched
    builder._jagged_bf16_dot = True


# @triton.jit picks the interpreter when the kernel modules are imported; so do the block sizes.
INTERPRET = interpreter_on()
if INTERPRET:
    _patch_interpreter_bf16_dot()


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def zero_rows(
    ptr, stride_row, stride_col, row_begin, row_end, cols, col_ok, pid, nprog,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Store zeros into rows [row_begin, row_end) x `cols` of a [rows, cols] tensor.

    Used for the jagged rows past max_seq_len: `nprog` programs share the rows grid-stride
    (program `pid` takes row blocks pid, pid + nprog, ...), so every row is written once and
    the common case (no sequence longer than max_seq_len) costs one empty loop."""
    rows0 = tl.arange(0, BLOCK_R).to(tl.int64)
    zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=ptr.dtype.element_ty)
    for start in range(row_begin + pid * BLOCK_R, row_end, nprog * BLOCK_R):
        rows = start + rows0
        mask = (rows[:, None] < row_end) & col_ok[None, :]
        tl.store(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, zeros, mask=mask)


# ---- work slots ---------------------------------------------------------------------------
# A flat list of (block of rows, sequence) work items. Sequence b owns the slots [s(b), s(b+1))
# with s(b) = offsets[b] // BLOCK + b: at least cdiv(len_b, BLOCK) of them and one spare at most,
# so the grid, s(B) = T // BLOCK + B slots, is sized on the host without reading offsets (no
# sync) and no program is spent on padding (a grid over cdiv(max_seq_len, BLOCK) blocks per
# sequence leaves most of its programs empty on short or long-tailed lengths). Slot j of its
# sequence covers the sequence's rows [j * BLOCK, (j + 1) * BLOCK); the slots of b cover all
# len_b rows, the truncated tail (rows past max_seq_len) included.
_FINE = tl.constexpr(64)
_COARSE = tl.constexpr(256)


@triton.jit
def row_block(pid, Offsets, num_heads, num_seqs, max_seq_len, HEAD_D: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """The prologue of a program over the flat work list of (head, BLOCK rows of a sequence):
    (h, b, j, seq_start, n_rows, n_slots, seq_len, offs_d, d_ok); b int64, seq_len the rows
    that take part (at most max_seq_len), d_ok the head-dim lanes in use."""
    h = pid % num_heads
    b, j, seq_start, n_rows, n_slots = _locate(Offsets, pid // num_heads, num_seqs, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    return (h, b.to(tl.int64), j, seq_start, n_rows, n_slots, tl.minimum(n_rows, max_seq_len), offs_d,
            offs_d < HEAD_D)


@triton.jit
def load_rows(P, seq_start, h, stride_t, stride_h, offs_r, offs_d, mask):
    """Rows seq_start + offs_r, lanes offs_d, of head h of a [T, H, D] tensor (0 where masked)."""
    return tl.load(P + seq_start * stride_t + h * stride_h + offs_r[:, None] * stride_t + offs_d[None, :], mask=mask,
                   other=0.0)


@triton.jit
def online_softmax(s, m_i, l_i, GUARD_EMPTY: tl.constexpr):
    """One key block of the online softmax, in log2 units: scores s [BM, BN] and the running
    row max m_i and sum l_i -> (m_new, p, alpha, l_new); the caller rescales its accumulator
    by alpha and adds p @ v. GUARD_EMPTY: a row may have no finite score yet (m_new -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    return m_new, p, alpha, l_i * alpha + tl.sum(p, 1)


@triton.jit
def zero_past_max(base, stride_row, max_seq_len, n_rows, offs_d, d_ok, j, n_slots, BLOCK: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Zero the rows of one (sequence, head) past max_seq_len, shared by the sequence's
    n_slots programs (`j` is this one): their outputs and gradients are zero."""
    if n_rows > max_seq_len:
        zero_rows(base, stride_row, 1, max_seq_len, n_rows, offs_d, d_ok, j, n_slots, BLOCK, BLOCK_D)


@triton.jit
def key_block_grads(pid, DK, DV, Offsets, stride_dkt, stride_dkh, stride_dvt, stride_dvh, max_seq_len, num_heads,
                    num_seqs, HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The prologue of a dK/dV program over BLOCK_N key rows (row_block), with the rows of its
    (sequence, head) past max_seq_len zeroed in dK and dV: (h, b, j, seq_start, seq_len, offs_d,
    d_ok, dk_base, dv_base), the bases pointing at the head's first row."""
    h, b, j, seq_start, n_rows, n_slots, seq_len, offs_d, d_ok = row_block(
        pid, Offsets, num_heads, num_seqs, max_seq_len, HEAD_D, BLOCK_N, BLOCK_D)
    dk_base = DK + seq_start * stride_dkt + h * stride_dkh
    dv_base = DV + seq_start * stride_dvt + h * stride_dvh
    zero_past_max(dk_base, stride_dkt, max_seq_len, n_rows, offs_d, d_ok, j, n_slots, BLOCK_N, BLOCK_D)
    zero_past_max(dv_base, stride_dvt, max_seq_len, n_rows, offs_d, d_ok, j, n_slots, BLOCK_N, BLOCK_D)
    return h, b, j, seq_start, seq_len, offs_d, d_ok, dk_base, dv_base


@triton.jit
def _locate(Offsets, slot, num_seqs, BLOCK: tl.constexpr):
    """(b, j, seq_start, n_rows, n_slots): work slot `slot` is the j-th of sequence b's n_slots.

    b = #{i in [1, B): s(i) <= slot} (s strictly increasing), counted on every _FINE-th i
    first, then on the _FINE indices after the last one passed: two rounds of loads."""
    cnt = tl.zeros([], tl.int32)
    for c0 in range(0, tl.cdiv(num_seqs, _FINE), _COARSE):
        c = c0 + tl.arange(0, _COARSE)
        i = c * _FINE
        ok = (c >= 1) & (i < num_seqs)
        s = tl.load(Offsets + i, mask=ok, other=0).to(tl.int64) // BLOCK + i
        cnt += tl.sum((ok & (s <= slot)).to(tl.int32), 0)
    base = cnt * _FINE
    i = base + tl.arange(0, _FINE)
    ok = (i > base) & (i < num_seqs)
    s = tl.load(Offsets + i, mask=ok, other=0).to(tl.int64) // BLOCK + i
    b = base + tl.sum((ok & (s <= slot)).to(tl.int32), 0)
    seq_start = tl.load(Offsets + b).to(tl.int64)
    seq_end = tl.load(Offsets + b + 1).to(tl.int64)
    first = seq_start // BLOCK + b
    n_slots = (seq_end // BLOCK + b + 1 - first).to(tl.int32)
    return b, (slot - first).to(tl.int32), seq_start, (seq_end - seq_start).to(tl.int32), n_slots


@triton.jit
def slot_tile(Offsets, slot, col_blk, num_seqs, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The tile of work slot `slot` x column block `col_blk` (the row-wise ops' programs):
    (b, seq_start, n_rows, row0, rows, cols). rows = row0 + [0, BLOCK_R) are positions within
    sequence b; row0 >= n_rows only on b's spare slot, which has nothing to do."""
    b, j, seq_start, n_rows, _ = _locate(Offsets, slot, num_seqs, BLOCK_R)
    row0 = j * BLOCK_R
    cols = col_blk * BLOCK_C + tl.arange(0, BLOCK_C)
    return b, seq_start, n_rows, row0, row0 + tl.arange(0, BLOCK_R), cols


def num_slots(total_rows: int, num_seqs: int, block: int) -> int:
    """Grid size (per head) of the slot layout: s(B) = T // BLOCK + B."""
    return total_rows // block + num_seqs


# ---- launch helpers -----------------------------------------------------------------------
def col_block(n: int, lo: int = 16, hi: int = 128) -> int:
    """Power-of-two block covering `n` columns, clamped to [lo, hi]; the kernels mask the rest."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 tl.dot follows torch's matmul setting (IEEE unless the user allowed TF32)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"

