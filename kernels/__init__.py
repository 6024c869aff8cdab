"""Jagged tensor ops and jagged flash attention: torch references and Triton kernels.

Jagged convention (used by every op): ``values`` is ``[T, ...]`` with the rows of each
sequence contiguous; ``offsets`` is ``[B+1]`` int64 (int32 accepted), ``offsets[0] == 0``,
non-decreasing, ``offsets[-1] == T``; ``max_seq_len`` is a host int. Rows of a sequence past
``max_seq_len`` are ignored (outputs zero, gradients zero); the data pipeline truncates
upstream, keeping the most recent items (the end of each sequence). Length-0 sequences work.

Every public op takes ``backend="torch" | "triton" | "auto"``; see ``kernels._dispatch``.
"""

from kernels._validation import set_debug_checks
from kernels.conversions import jagged_to_padded, offsets_from_lengths, padded_to_jagged
from kernels.softmax import jagged_softmax
from kernels.bmm import jagged_dense_bmm, jagged_jagged_bmm
from kernels.elementwise import jagged_dense_elementwise_add, jagged_dense_elementwise_mul
from kernels.flash_attention import jagged_flash_attention
from kernels.dense_attention import jagged_dense_attention
from kernels.s2 import S2Shards, s2_coverage

__all__ = [
    "set_debug_checks",
    "offsets_from_lengths",
    "jagged_to_padded",
    "padded_to_jagged",
    "jagged_softmax",
    "jagged_dense_bmm",
    "jagged_jagged_bmm",
    "jagged_dense_elementwise_add",
    "jagged_dense_elementwise_mul",
    "jagged_flash_attention",
    "jagged_dense_attention",
    "S2Shards",
    "s2_coverage",
]
