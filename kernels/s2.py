"""S2 attention (per-head strided context shards) for jagged sequences: the spec and its oracle.

``S2Shards`` is the layout (its docstring: which keys each head's queries see);
``s2_attention_reference`` the masked dense reference (the Triton kernels' oracle and the torch
backend); ``s2_coverage`` the fraction of block residues some head sees. Why: docs/kernels.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels._segments import keep_in_graph


@dataclass(frozen=True)
class S2Shards:
    """The S2 layout: key blocks of ``block`` rows, the ``local_blocks`` nearest always seen, every
    ``stride``-th block at each head's offset o_h (``head_offsets[h]``; default
    ``(h * max(1, stride // H)) % stride``). In a sequence of n rows (after truncation, row 0 the oldest):

    - non-causal: key t is in block ``j = (n - 1 - t) // block`` (block 0: the most recent rows);
      every query of head h sees key t iff ``j < local_blocks`` or ``(j + o_h) % stride == 0``;
    - causal: ``j = t // block``, ``i = s // block``; query s of head h sees key t iff ``t <= s``
      and (``i - j < local_blocks`` or ``(j + o_h) % stride == 0``);
    - a query that sees no key (possible with ``local_blocks=0``) gets zeros, as an empty sequence."""

    block: int
    local_blocks: int
    stride: int
    head_offsets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("block", "local_blocks", "stride"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise TypeError(f"S2Shards.{name} must be an int, got {getattr(self, name)!r}")
        if self.block <= 0 or self.block % 16:
            raise ValueError(f"S2Shards.block must be a positive multiple of 16, got {self.block}")
        if self.local_blocks < 0:
            raise ValueError(f"S2Shards.local_blocks must be >= 0, got {self.local_blocks}")
        if self.stride < 1:
            raise ValueError(f"S2Shards.stride must be >= 1, got {self.stride}")
        if self.head_offsets is not None:
            object.__setattr__(self, "head_offsets", tuple(self.head_offsets))
            bad = [o for o in self.head_offsets if not isinstance(o, int) or not 0 <= o < self.stride]
            if bad:
                raise ValueError(f"S2Shards.head_offsets must be ints in [0, stride={self.stride}), got {bad[0]!r}")

    def offsets_for(self, num_heads: int) -> tuple[int, ...]:
        """o_h of each of num_heads heads (the given head_offsets, checked, or the default)."""
        if self.head_offsets is None:
            step = max(1, self.stride // num_heads)
            return tuple((h * step) % self.stride for h in range(num_heads))
        if len(self.head_offsets) != num_heads:
            raise ValueError(f"S2Shards.head_offsets has {len(self.head_offsets)} entries for {num_heads} heads")
        return self.head_offsets


def s2_coverage(shards: S2Shards, num_heads: int) -> float:
    """The fraction of block residues (mod stride) that some head sees: 1.0 when the heads
    together keep every block of the context (the local window aside)."""
    seen = {(-o) % shards.stride for o in shards.offsets_for(num_heads)}
    return len(seen) / shards.stride


def _visible(shards: S2Shards, n: torch.Tensor, L: int, offs: torch.Tensor, causal: bool) -> torch.Tensor:
    """Bool [B, H, Lq, L]: query s of sequence b sees key t on head h (Lq = L, or 1 when every
    query sees the same keys); positions past n are False."""
    pos = torch.arange(L, device=n.device)
    valid = pos[None, :] < n[:, None]  # [B, L]
    o = offs[None, :, None]  # [1, H, 1]
    if not causal:
        j = ((n[:, None] - 1 - pos[None, :]).clamp(min=0) // shards.block)[:, None, :]  # [B, 1, L]
        keep = (j < shards.local_blocks) | ((j + o) % shards.stride == 0)  # [B, H, L]
        return (keep & valid[:, None, :])[:, :, None, :]  # [B, H, 1, L]
    j = (pos // shards.block)[None, None, None, :]  # key blocks [1, 1, 1, L]
    i = (pos // shards.block)[None, None, :, None]  # query blocks [1, 1, L, 1]
    keep = ((i - j) < shards.local_blocks) | ((j + o[..., None]) % shards.stride == 0)  # [1, H, L, L]
    causal_ok = pos[None, :] <= pos[:, None]  # [L(s), L(t)]
    return keep & causal_ok & valid[:, None, None, :] & valid[:, None, :, None]


def s2_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                           max_seq_len: int, shards: S2Shards, causal: bool = False,
                           scale: float | None = None) -> torch.Tensor:
    """Jagged attention with the S2 mask, through padded dense math (differentiable): out [T, H, D]
    in q's dtype, zeros for rows past max_seq_len and for queries that see no key. Computes in
    fp32 (fp64 for fp64 inputs)."""
    T, H, D = q.shape
    offs = torch.tensor(shards.offsets_for(H), device=q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    n = lengths.clamp(max=max_seq_len)  # [B]
    L = int(n.max()) if n.numel() else 0
    if L == 0 or T == 0:
        return q.new_zeros(q.shape) + keep_in_graph(q, k, v)
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < n[:, None]  # [B, L]
    rows = (offsets[:-1].to(torch.int64)[:, None] + pos[None, :]).clamp(max=max(T - 1, 0))  # [B, L]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D], zeros at padding
        # a select, not a product: padding rows index other sequences' rows, whose NaN must not leak
        xp = torch.where(valid[..., None, None], x.to(cdt)[rows], 0.0)
        return xp.permute(0, 2, 1, 3)

    qp, kp, vp = padded(q), padded(k), padded(v)
    see = _visible(shards, n, L, offs, causal)  # [B, H, 1 or L, L]
    scores = (qp @ kp.transpose(-1, -2)) * scale  # [B, H, L, L]
    scores = scores.masked_fill(~see, float("-inf"))
    any_key = see.any(-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~any_key, 0.0), dim=-1) * any_key  # a row seeing no key: zeros
    out = (p @ vp).permute(0, 2, 1, 3)  # [B, L, H, D]
    flat = valid.reshape(-1).nonzero().squeeze(1)
    dst = rows.reshape(-1)[flat]
    result = out.reshape(-1, H, D)[flat]
    return q.new_zeros(q.shape).index_put((dst,), result.to(q.dtype))
