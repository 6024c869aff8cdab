"""Index helpers of the torch path: work that follows the real lengths, not max_seq_len.

``row_index``: one entry per row an op reads (the row-wise ops); ``length_groups``: the non-empty
sequences bucketed by length and padded to their bucket's longest (the matrix products);
``gather_groups`` zero-fills that padding, so no value crosses sequences. Built from the host
offsets (a sync on CUDA), cached on their values. No Triton here. Why: docs/kernels.md#the-torch-path.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

MERGE_TOKENS = 1024


class RowIndex(NamedTuple):
    rows: torch.Tensor  # [R] int64: the rows of values an op reads (position < max_seq_len)
    seq: torch.Tensor  # [R] int64: their sequence
    pos: torch.Tensor  # [R] int64: their position within it


class Group(NamedTuple):
    seqs: torch.Tensor  # [G] int64 sequence ids
    rows: torch.Tensor  # [G, L] int64 row of values at each position (the first at padding)
    valid: torch.Tensor  # [G, L] bool: position < min(length, max_seq_len)
    pad: torch.Tensor  # [G, L] bool: ~valid
    flat: torch.Tensor  # [V] int64: the valid positions in the flattened [G * L]
    pad_flat: torch.Tensor  # [G * L - V] int64: the padding positions in it
    dst: torch.Tensor  # [V] int64: the rows of values at the valid positions


def row_index(offsets: torch.Tensor, max_seq_len: int, total: int) -> RowIndex:
    """The rows that take part (the first max_seq_len of each sequence); total = offsets[-1]."""
    return _row_index(tuple(offsets.tolist()), int(max_seq_len), int(total), offsets.device)


def length_groups(offsets: torch.Tensor, max_seq_len: int) -> list[Group]:
    """The non-empty sequences (after truncation to max_seq_len), bucketed by length."""
    return _length_groups(tuple(offsets.tolist()), int(max_seq_len), offsets.device)


@functools.lru_cache(maxsize=8)
def _row_index(off_host: tuple, max_seq_len: int, total: int, device: torch.device) -> RowIndex:
    off = torch.tensor(off_host, dtype=torch.int64, device=device)
    lengths = off[1:] - off[:-1]  # [B]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths,
                                  output_size=total)  # [T]
    rows = torch.arange(total, device=device)
    pos = rows - off[:-1][seq]
    keep = pos < max_seq_len
    if not bool(keep.all()):
        rows, seq, pos = rows[keep], seq[keep], pos[keep]
    return RowIndex(rows, seq, pos)


@functools.lru_cache(maxsize=8)
def _length_groups(off_host: tuple, max_seq_len: int, device: torch.device) -> list[Group]:
    buckets: dict[int, list[int]] = {}
    longest: dict[int, int] = {}
    for b in range(len(off_host) - 1):
        m = min(off_host[b + 1] - off_host[b], max_seq_len)
        if m > 0:
            key = (m - 1).bit_length()
            buckets.setdefault(key, []).append(b)
            longest[key] = max(longest.get(key, 0), m)
    off = torch.tensor(off_host, dtype=torch.int64, device=device)
    n = (off[1:] - off[:-1]).clamp(max=max_seq_len)  # [B]
    keys = sorted(buckets)
    groups, carry = [], []
    for i, key in enumerate(keys):
        members = carry + buckets[key]
        if i + 1 < len(keys) and len(members) * longest[keys[i + 1]] < MERGE_TOKENS:
            carry = members  # joins the next bucket
            continue
        groups.append(_group(members, longest[key], off, n))
        carry = []
    return groups


def _group(members: list[int], length: int, off: torch.Tensor, n: torch.Tensor) -> Group:
    seqs = torch.tensor(members, dtype=torch.int64, device=off.device)
    pos = torch.arange(length, device=off.device)  # [L]: the group's longest length
    valid = pos[None, :] < n[seqs][:, None]  # [G, L]
    pad = ~valid
    first = off[seqs][:, None]  # [G, 1]
    rows = torch.where(valid, first + pos[None, :], first)
    flat = valid.reshape(-1).nonzero().squeeze(1)
    pad_flat = pad.reshape(-1).nonzero().squeeze(1)
    return Group(seqs, rows, valid, pad, flat, pad_flat, rows.reshape(-1)[flat])


def segment_sum(x: torch.Tensor, idx: RowIndex, num_seqs: int) -> torch.Tensor:
    """x [R, ...] (one entry per row of idx) -> [num_seqs, ...]: the sum over each sequence."""
    return x.new_zeros((num_seqs, *x.shape[1:])).index_add(0, idx.seq, x)


def segment_amax(x: torch.Tensor, idx: RowIndex, num_seqs: int) -> torch.Tensor:
    """x [R, H] -> [num_seqs, H]: the max over each sequence (-inf for an empty one)."""
    out = x.new_full((num_seqs, *x.shape[1:]), float("-inf"))
    seq = idx.seq.view(-1, *([1] * (x.dim() - 1))).expand_as(x)
    return out.scatter_reduce(0, seq, x, "amax", include_self=True)


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, total: int, fill: float = 0.0) -> torch.Tensor:
    """x [R, ...] -> [total, ...]: x's entries at `rows`, `fill` elsewhere (differentiable)."""
    return x.new_full((total, *x.shape[1:]), fill).index_copy_(0, rows, x)


def gather_groups(x: torch.Tensor, groups: list[Group], zero_pad: bool = True) -> list[torch.Tensor]:
    """x [T, ...] -> [G, L, ...] per group: its rows, zeros at padding (with zero_pad=False,
    copies of the sequence's first row: for blocks whose padding is masked or dropped)."""
    return [_gather(x, g, zero_pad) for g in groups]


def _gather(x: torch.Tensor, g: Group, zero_pad: bool) -> torch.Tensor:
    block = x.index_select(0, g.rows.reshape(-1))  # [G * L, ...]
    if zero_pad and g.pad_flat.numel():
        block = block.index_fill_(0, g.pad_flat, 0)
    return block.view(*g.rows.shape, *x.shape[1:])


def scatter_groups(parts: list[torch.Tensor], groups: list[Group], total: int,
                   like: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-group padded results parts[i] [G, L, ...] -> [total, ...], `fill` at the rows no
    group covers (empty sequences, positions past max_seq_len). `like` gives the dtype, the
    device and the trailing shape (differentiable: in-place copies into a fresh tensor)."""
    shape = (total, *like.shape[1:])
    covered = sum(g.dst.numel() for g in groups)
    out = like.new_empty(shape) if covered == total else like.new_full(shape, fill)
    for p, g in zip(parts, groups):
        # a transposed block (the fused kernels' [G, H, L, D] outputs) is read in place
        src = p.flatten(0, 1).index_select(0, g.flat) if p.is_contiguous() else p[g.valid]
        out.index_copy_(0, g.dst, src)
    return out


def by_seq(parts: list[torch.Tensor], groups: list[Group], shape: tuple, like: torch.Tensor,
           fill: float = 0.0) -> torch.Tensor:
    """Per-group results parts[i] [G, ...] -> [B, ...] (= shape) at the groups' sequences,
    `fill` for the sequences no group holds (the empty ones)."""
    out = like.new_full(shape, fill)
    for p, g in zip(parts, groups):
        out.index_copy_(0, g.seqs, p)
    return out


def keep_in_graph(*tensors: torch.Tensor | None) -> torch.Tensor | int:
    """A zero scalar that depends on every tensor given, so that an op whose output does not
    read them (nothing to attend to, everything truncated) still returns zero gradients for
    them, not None; it sums an empty slice, so a NaN in them does not leak into the result."""
    return sum(t.reshape(-1)[:0].sum() for t in tensors if t is not None)
