"""Jagged inputs, their padded copies, and the fp32 references the outputs are checked against.

The harness pads by itself (a gather/scatter through a row index), never through the kernels it
measures. References: the torch backend on small cases, else ``padded_attention`` in chunks of
sequences whose fp32 scores stay under REF_CHUNK_BYTES."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels import jagged_dense_attention, jagged_flash_attention, offsets_from_lengths
from kernels._attention_reference import padded_attention
from experiments.bench.suites import Shape, make_lengths, seed_for

REF_CHUNK_BYTES = 1 << 30
SMALL_REF_TOKENS = 4096  # at most this many tokens: use the project's torch reference


@dataclass
class Jagged:
    """Random jagged inputs of one shape, on the device; `lengths` stays on the CPU."""

    shape: Shape
    lengths: torch.Tensor  # [B] int64, CPU
    offsets: torch.Tensor  # [B+1] int64, device
    pos: torch.Tensor  # [T] int64, device: row b*N + i of the padded [B*N] layout
    q: torch.Tensor  # [T, H, D] (ops: [T, D])
    k: torch.Tensor
    v: torch.Tensor
    qd: torch.Tensor | None = None  # [B, Tq, H, D] dense queries (dense_attention)
    extra: dict = field(default_factory=dict)  # further inputs of one op, shared by its providers

    @property
    def T(self) -> int:
        return int(self.lengths.sum())

    @property
    def max_len(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0


def padded_positions(lengths: torch.Tensor, N: int, device: torch.device) -> torch.Tensor:
    B = lengths.numel()
    starts = offsets_from_lengths(lengths)[:-1]
    row = torch.arange(int(lengths.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, lengths)
    pos = torch.repeat_interleave(torch.arange(B, dtype=torch.int64) * N, lengths) + row
    return pos.to(device)


def make_jagged(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0, per_head: bool = True) -> Jagged:
    lengths = make_lengths(shape.B, shape.N, shape.density, seed_for(shape, seed))
    T = int(lengths.sum())
    gen = torch.Generator(device=device).manual_seed(seed_for(shape, seed) + 1)
    dims = (T, shape.H, shape.D) if per_head else (T, shape.D)

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=gen)

    qd = rand(shape.B, shape.Tq, shape.H, shape.D) if shape.Tq else None
    return Jagged(shape=shape, lengths=lengths, offsets=offsets_from_lengths(lengths).to(device),
                  pos=padded_positions(lengths, shape.N, device), q=rand(*dims), k=rand(*dims), v=rand(*dims), qd=qd)


def to_padded(x: torch.Tensor, pos: torch.Tensor, B: int, N: int, fill: float = 0.0) -> torch.Tensor:
    """[T, *F] jagged -> [B, N, *F] padded (rows past each length hold `fill`)."""
    out = torch.full((B * N, *x.shape[1:]), fill, device=x.device, dtype=x.dtype)
    out[pos] = x
    return out.view(B, N, *x.shape[1:])


def from_padded(p: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[B, N, *F] padded -> [T, *F] jagged."""
    return p.reshape(-1, *p.shape[2:])[pos]


def key_mask(lengths: torch.Tensor, N: int, device: torch.device) -> torch.Tensor:
    """[B, 1, 1, N] bool, True where the key is a real token."""
    return (torch.arange(N)[None, :] < lengths[:, None]).to(device)[:, None, None, :]


def _chunks(lengths: torch.Tensor, per_seq_bytes):
    """Consecutive runs of sequences whose padded fp32 work stays under REF_CHUNK_BYTES."""
    lens, start = lengths.tolist(), 0
    B = len(lens)
    while start < B:
        end, lmax = start, 0
        while end < B:
            lmax_new = max(lmax, lens[end])
            if end > start and (end + 1 - start) * per_seq_bytes(lmax_new) > REF_CHUNK_BYTES:
                break
            lmax, end = lmax_new, end + 1
        yield start, end, max(lmax, 1)
        start = end


def reference_self_attention(j: Jagged) -> torch.Tensor:
    """fp32 softmax(q k^T / sqrt(D)) v within each sequence: [T, H, D]."""
    H, D = j.shape.H, j.shape.D
    if j.T <= SMALL_REF_TOKENS:
        return jagged_flash_attention(j.q.float(), j.k.float(), j.v.float(), j.offsets, j.shape.N, backend="torch")
    out = torch.empty(j.T, H, D, device=j.q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(D)
    off = j.offsets.cpu()
    for b0, b1, L in _chunks(j.lengths, lambda L: H * L * L * 20 + 3 * H * L * D * 4):
        lens = j.lengths[b0:b1]
        pos = padded_positions(lens, L, j.q.device)
        rows = slice(int(off[b0]), int(off[b1]))
        pad = [to_padded(t[rows].float(), pos, b1 - b0, L) for t in (j.q, j.k, j.v)]  # [b, L, H, D]
        o, _, _ = padded_attention(*pad, key_mask(lens, L, j.q.device), None, scale)
        out[rows] = from_padded(o, pos)
    return out


def reference_dense_attention(j: Jagged) -> torch.Tensor:
    """fp32 attention of qd [B, Tq, H, D] over each sequence's keys: [B, Tq, H, D]."""
    B, H, D, Tq = j.shape.B, j.shape.H, j.shape.D, j.shape.Tq
    if j.T <= SMALL_REF_TOKENS:
        return jagged_dense_attention(j.qd.float(), j.k.float(), j.v.float(), j.offsets, j.shape.N, backend="torch")
    out = torch.empty(B, Tq, H, D, device=j.q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(D)
    off = j.offsets.cpu()
    for b0, b1, L in _chunks(j.lengths, lambda L: H * Tq * L * 20 + 2 * H * L * D * 4):
        lens = j.lengths[b0:b1]
        pos = padded_positions(lens, L, j.q.device)
        rows = slice(int(off[b0]), int(off[b1]))
        kp, vp = (to_padded(t[rows].float(), pos, b1 - b0, L) for t in (j.k, j.v))  # [b, L, H, D]
        out[b0:b1], _, _ = padded_attention(j.qd[b0:b1].float(), kp, vp, key_mask(lens, L, j.q.device), None, scale)
    return out
