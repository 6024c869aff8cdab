"""The user encoder of the ALURE system: a long history -> one user embedding, served to the ranker.

``UserEncoder(EncoderConfig(), vocab_size=V, n_actions=A).encode(...)`` -> ``[B, dim]``; called
with a batch dict it returns the click logit of the batch's candidates, its training objective
(trained and exported by ``python -m pipeline.user_embeddings``; why this objective: docs/training.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.attention import Histories
from models.layers import EncoderBlock, HistoryEmbedding, mlp


@dataclass
class EncoderConfig:
    dim: int = 64  # the user embedding's width
    embed_dim: int = 64
    num_heads: int = 2
    num_layers: int = 2
    ffn_mult: int = 2
    num_age_buckets: int = 32
    max_seq_len: int = 4096  # the encoder reads up to this many most recent items


class UserEncoder(nn.Module):
    """History -> user embedding [B, dim]; with a candidate, the click logit it was trained on."""

    def __init__(self, cfg: EncoderConfig, *, vocab_size: int, n_actions: int, kernel_backend: str = "auto"):
        super().__init__()
        self.cfg, self.kernel_backend = cfg, kernel_backend
        d = cfg.embed_dim
        self.embed = HistoryEmbedding(vocab_size, n_actions, d, cfg.num_age_buckets)
        self.blocks = nn.ModuleList(EncoderBlock(d, cfg.num_heads, cfg.ffn_mult) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, cfg.dim)
        self.cand = nn.Linear(d, cfg.dim)
        self.head = mlp(3 * cfg.dim, [2 * cfg.dim])

    def encode(self, hist_item, hist_action, hist_age, offsets, max_seq_len: int) -> torch.Tensor:
        """Jagged histories (values [T], offsets [B+1]) -> the mean of the encoded items, projected: [B, dim]."""
        hist = Histories(offsets, max_seq_len, "jagged", self.kernel_backend)
        x = self.embed(hist_item, hist_action, hist_age)  # [T, D]
        for block in self.blocks:
            x = block(x, hist)
        x = self.norm(x)
        total = hist.pool(x.new_ones(x.shape[0], 1), x).squeeze(1)  # [B, D]
        mean = total / hist.lengths.clamp(min=1).to(total.dtype)[:, None]
        return self.out(mean)

    def forward(self, batch: dict) -> torch.Tensor:
        """The click logit [B] (float32) of a batch of pipeline.batches: logit = MLP([u, c, u * c])."""
        u = self.encode(batch["hist_item"], batch["hist_action"], batch["hist_age"], batch["offsets"],
                        batch["max_seq_len"])
        c = self.cand(self.embed.item(batch["cand_item"]))
        return self.head(torch.cat([u, c, u * c], dim=-1)).squeeze(-1).float()
