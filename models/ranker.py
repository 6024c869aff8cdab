"""The ranker: history encoder, target attention, interaction, MLP -> one logit per example."""

from __future__ import annotations

import torch
from torch import nn

from models.attention import Histories
from models.config import RankerConfig
from models.layers import EncoderBlock, HistoryEmbedding, HistoryInteraction, TargetAttention, mlp


class Ranker(nn.Module):
    """Click-through ranker over a user's history and one candidate item.

    item (+ category) embeddings (shared by history and candidate) + action + age-bucket embeddings
    -> ``num_layers`` pre-norm self-attention blocks over the history (layout by
    ``cfg.attention``; rotary recency positions) -> target attention of the candidate over the
    encoded history
    -> candidate-conditioned pooling of the history (interaction block)
    -> MLP over [candidate, mean of the encoded history, target attention, pooling,
    dense features, user embedding, log1p(length)] -> logit. With ``cfg.raw_history`` the mean,
    target attention and pooling read the items before the blocks, and a second target attention
    reads the encoded ones (the blocks can only add).

    With ``cfg.user_embedding`` the ``dense`` input carries, after the data set's n_dense
    features, an embedding learned offline (dim values) and a known flag: rows without one
    (a user not seen before its as-of day) use a learned "unknown" vector instead. The vector
    goes through LayerNorm and a projection to embed_dim; the MLP takes it and its elementwise
    product with the candidate's item embedding (an MLP over a concatenation hardly learns a
    product, and what a user-level vector says about a click is how it matches the candidate:
    the encoder's own head reads it as [u, c, u * c]).

    ``n_categories`` (the data set's; 0: none) sizes the category embedding of
    ``cfg.category_embedding``; the training module sets the catalogue
    (``embed.set_categories``). The parameters do not depend on the attention layout: a
    state_dict of one loads into the others.
    ``sparse_item_grad`` makes the item table's gradient sparse (how it is computed, not what:
    the training loop chooses it, :mod:`pipeline.gradsync`); ``item_device="meta"`` leaves the
    item table undrawn, for a caller that shards it (:func:`models.layers.draw_item_rows`)."""

    def __init__(self, cfg: RankerConfig, *, vocab_size: int, n_actions: int, n_dense: int,
                 sparse_item_grad: bool = False, n_categories: int = 0, item_device: str | None = None):
        super().__init__()
        self.cfg = cfg
        d, rotary = cfg.embed_dim, cfg.rotary_positions
        self.embed = HistoryEmbedding(vocab_size, n_actions, d, cfg.num_age_buckets, sparse_item=sparse_item_grad,
                                      n_categories=n_categories if cfg.category_embedding else 0,
                                      item_device=item_device)
        s2 = cfg.s2
        self.blocks = nn.ModuleList(
            EncoderBlock(d, cfg.num_heads, cfg.ffn_mult, None if s2 is None or s2.is_dense(i) else s2.shards(),
                         rotary=rotary, window=cfg.local_window)
            for i in range(cfg.num_layers))
        self.norm = nn.LayerNorm(d)
        self.target = TargetAttention(d, cfg.num_heads, rotary=rotary) if cfg.target_attention else None
        two_reads = cfg.raw_history and cfg.num_layers > 0
        # with raw_history the features read the items before the encoder; the encoder adds a read
        self.target_encoded = TargetAttention(d, cfg.num_heads, rotary=rotary) if two_reads else None
        self.norm_raw = nn.LayerNorm(d) if two_reads else None
        self.interaction = HistoryInteraction(d, cfg.pool_heads) if cfg.interaction else None
        self.n_dense = n_dense
        self.dense_proj = nn.Linear(n_dense, d) if n_dense > 0 else None
        user = cfg.user_embedding
        if user is not None:
            self.user_unknown = nn.Parameter(torch.zeros(user.dim))
            self.user_proj = nn.Sequential(nn.LayerNorm(user.dim), nn.Linear(user.dim, d))
        n_feats = (2 + cfg.target_attention + two_reads + cfg.pool_heads * cfg.interaction + (n_dense > 0)
                   + 2 * (user is not None))
        in_dim = d * n_feats + 1
        self.head = mlp(in_dim, cfg.mlp_dims)

    def forward(
        self,
        hist_item: torch.Tensor,
        hist_action: torch.Tensor,
        hist_age: torch.Tensor,
        offsets: torch.Tensor,
        max_seq_len: int,
        cand_item: torch.Tensor,
        dense: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B] (float32; float64 for a float64 model).

        hist_item [T] int32/int64, hist_action [T] integer, hist_age [T] float (days): the
        histories, jagged by offsets [B+1] int64 (each at most max_seq_len long, most recent
        items kept); cand_item [B] integer; dense [B, feature_width] float (models.feature_width:
        the data set's dense features, then the user embedding's columns if configured)."""
        hist = Histories(offsets, max_seq_len, self.cfg.attention, self.cfg.kernel_backend)
        hist_rows, cand_rows = self.embed.item_rows(hist_item, cand_item)
        x = hist.layout(self.embed(hist_item, hist_action, hist_age, hist_rows))  # [T, D] or [B, N, D]
        raw = x
        for block in self.blocks:
            x = block(x, hist)
        x = self.norm(x)
        cand = self.embed.candidate(cand_item, cand_rows)  # [B, D]
        feats = []
        if self.target_encoded is not None:
            feats.append(self.target_encoded(cand, x, hist))
            x = self.norm_raw(raw)
        feats += [cand, self._mean(x, hist)]
        if self.target is not None:
            feats.append(self.target(cand, x, hist))
        if self.interaction is not None:
            feats.append(self.interaction(cand, x, hist))
        if self.dense_proj is not None:
            feats.append(self.dense_proj(dense[:, :self.n_dense]))
        if self.cfg.user_embedding is not None:  # the vector, and read against the candidate
            user = self._user(dense[:, self.n_dense:])
            feats += [user, user * cand.to(user.dtype)]
        feats.append(torch.log1p(hist.lengths.to(cand.dtype))[:, None])
        feats = [f.to(cand.dtype) for f in feats]
        logits = self.head(torch.cat(feats, dim=-1)).squeeze(-1)  # [B]
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32

    def _user(self, cols: torch.Tensor) -> torch.Tensor:
        """[B, dim + 1] (embedding, known flag) -> [B, D]; unknown rows take the learned vector."""
        emb, known = cols[:, :-1], cols[:, -1:] > 0.5
        emb = torch.where(known, emb, self.user_unknown.to(emb.dtype))
        return self.user_proj(emb.to(self.user_unknown.dtype))

    @staticmethod
    def _mean(x: torch.Tensor, hist: Histories) -> torch.Tensor:
        """Mean of the encoded history over real items -> [B, D] (zeros when empty)."""
        ones = x.new_ones(*x.shape[:-1], 1)  # [T, 1] or [B, N, 1]
        total = hist.pool(ones, x).squeeze(1)  # [B, D]
        return total / hist.lengths.clamp(min=1).to(total.dtype)[:, None]
