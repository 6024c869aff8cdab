"""Jagged tensor ops and jagged flash attention: torch references and Triton kernels.

Jagged convention: ``values`` ``[T, ...]`` with each sequence's rows contiguous; ``offsets`` ``[B+1]``
int64 (int32 accepted), from 0, non-decreasing, ending at T; ``max_seq_len`` a host int: rows past it
are ignored (zero outputs and gradients); length-0 sequences work. Every public op takes
``backend="torch" | "triton" | "auto"`` (``kernels._dispatch``). How they are built: docs/kernels.md.
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
