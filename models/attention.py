"""The three layouts of a batch of histories and the attention each one runs.

Every layout receives the same jagged batch. ``jagged`` keeps ``[T, D]`` values + offsets
end to end and calls the ``kernels`` ops. ``dense`` and ``sdpa`` pad once, on the device,
right after the embeddings (``jagged_to_padded``: that copy, and every op over the padding
afterwards, is their cost) and run the encoder on ``[B, N, D]`` with N = max_seq_len.

Padded rows never reach the output: keys are masked, pooled values are masked, and the target
attention of an empty history is zeroed. An empty history attends to all of its (zero) padding
instead of to nothing, so that no softmax row is all ``-inf`` (no NaN in any layout); the
result is then multiplied by 0, as the jagged kernels return 0 for it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from kernels import jagged_dense_attention, jagged_dense_bmm, jagged_flash_attention, jagged_jagged_bmm, jagged_to_padded


def rotary_angles(pos: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """exp(i * angle) of the rotary angles of positions pos [...], computed in `dtype` (fp32 or
    fp64): complex [..., 1, head_dim // 2]."""
    inv = 10000.0 ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=dtype) / head_dim)
    angle = pos.to(dtype)[..., None, None] * inv  # [..., 1, Dh/2]
    return torch.polar(torch.ones_like(angle), angle)


def rotate(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [..., H, Dh]: each pair (2j, 2j + 1) as a complex number
    times turn [..., 1, Dh/2] (rotary_angles), in fp32 (one complex product: 3x faster on a CPU
    than the split halves); fp64 stays fp64."""
    real = torch.promote_types(x.dtype, torch.float32)
    pairs = torch.view_as_complex(x.to(real).unflatten(-1, (-1, 2)))  # [..., H, Dh/2]
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


def _padded_attention(q, k, v, key_mask, impl: str):
    """q [B, Nq, H, Dh], k/v [B, N, H, Dh], key_mask [B, N] or [B, Nq, N] bool (True = attend)
    -> [B, Nq, H, Dh]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, *, Dh]
    mask = key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask[:, None]  # [B, 1, Nq or 1, N]
    if impl == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # [B, H, Nq, N]
        scores = scores.masked_fill(~mask, float("-inf"))
        # softmax in at least fp32 (bf16/fp16 under autocast), fp64 stays fp64
        p = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        out = p.to(v.dtype) @ v
    return out.transpose(1, 2)  # [B, Nq, H, Dh]


class Histories:
    """A batch of histories in one attention layout (dense, sdpa or jagged), and the sequence ops
    of that layout.

    offsets: [B+1] int64 of the jagged batch (lengths already <= max_seq_len upstream).
    max_seq_len: host int, N of the padded layout and the kernels' max_seq_len."""

    def __init__(self, offsets: torch.Tensor, max_seq_len: int, attention: str, kernel_backend: str = "auto"):
        self.offsets = offsets
        self.max_seq_len = int(max_seq_len)
        self.attention = attention
        self.kernel_backend = kernel_backend
        self.lengths = offsets[1:] - offsets[:-1]  # [B]
        self.padded = attention != "jagged"
        self._angles = None
        self._windows: dict[int, torch.Tensor] = {}  # window -> [B, N, N] mask of the padded layouts
        if self.padded:
            pos = torch.arange(self.max_seq_len, device=offsets.device)
            self.mask = pos[None, :] < self.lengths[:, None]  # [B, N] real items
            self.key_mask = self.mask | (self.lengths == 0)[:, None]  # empty rows attend padding

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """Jagged [T, D] -> this layout: [T, D] (jagged) or [B, N, D] (padded, zeros)."""
        if not self.padded:
            return x
        return jagged_to_padded(x, self.offsets, self.max_seq_len, backend=self.kernel_backend)

    def rotary(self, x: torch.Tensor) -> torch.Tensor:
        """q or k of the history, [T, H, Dh] or [B, N, H, Dh], rotated by each item's recency
        (items after it in its history: 0 for the most recent), the same in every layout."""
        if self._angles is None:
            if self.padded:  # negative past the end of a history: padding, never attended
                pos = self.lengths[:, None] - 1 - torch.arange(x.shape[1], device=x.device)  # [B, N]
            else:  # no host sync: the row of each item from the offsets on the device
                t = torch.arange(x.shape[0], device=x.device)
                row = torch.searchsorted(self.offsets[1:], t, right=True)
                pos = self.offsets[row + 1] - 1 - t  # [T]
            self._angles = rotary_angles(pos, x.shape[-1], torch.promote_types(x.dtype, torch.float32))
        return rotate(x, self._angles)

    def self_attention(self, q, k, v, shards=None, window: int | None = None) -> torch.Tensor:
        """q, k, v [T, H, Dh] or [B, N, H, Dh] -> the same shape; bidirectional within a history.
        shards: an S2 layout (kernels.S2Shards; jagged layout only) or None (every key);
        window: item i reads items j with |i - j| <= window only (None: every item)."""
        with record_function("attention/self"):  # a profiler range (pipeline.trace); no-op otherwise
            if not self.padded:
                return jagged_flash_attention(q, k, v, self.offsets, self.max_seq_len, backend=self.kernel_backend,
                                              shards=shards, window=window)
            return _padded_attention(q, k, v, self._window_mask(window), self.attention)

    def _window_mask(self, window: int | None) -> torch.Tensor:
        """Keys each query reads in the padded layout: [B, N] (every real key) or, with a window,
        [B, N, N] (real keys within it; a padded query reads every real key, so that no softmax
        row is empty: its output is never read)."""
        if window is None:
            return self.key_mask
        if window not in self._windows:  # once per batch: every block reads the same mask
            pos = torch.arange(self.max_seq_len, device=self.offsets.device)
            near = (pos[:, None] - pos[None, :]).abs() <= window  # [N, N]
            self._windows[window] = self.key_mask[:, None, :] & (near[None] | ~self.mask[:, :, None])
        return self._windows[window]

    def target_attention(self, q, k, v) -> torch.Tensor:
        """q [B, 1, H, Dh] over k, v in this layout -> [B, 1, H, Dh]; zeros for empty histories."""
        with record_function("attention/target"):  # a profiler range (pipeline.trace); no-op otherwise
            if not self.padded:
                return jagged_dense_attention(
                    q, k, v, self.offsets, self.max_seq_len, backend=self.kernel_backend
                )
            out = _padded_attention(q, k, v, self.key_mask, self.attention)
            return out * (self.lengths > 0).to(out.dtype)[:, None, None, None]

    def scores(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-item scores x_t . w_b: x in this layout, w [B, D, K] -> [T, K] or [B, N, K]."""
        if not self.padded:
            return jagged_dense_bmm(x, self.offsets, w, self.max_seq_len, backend=self.kernel_backend)
        return x @ w

    def pool(self, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """sum_t s_t^T x_t over real items: s [*, K], x [*, D] in this layout -> [B, K, D]."""
        if not self.padded:
            return jagged_jagged_bmm(s, x, self.offsets, self.max_seq_len, backend=self.kernel_backend)
        s = s * self.mask[..., None].to(s.dtype)  # padded rows of x carry garbage: drop them
        return s.transpose(1, 2) @ x
