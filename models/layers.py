"""Building blocks of the ranker. Each works on any layout: per-row ops see ``[..., D]``,
sequence ops go through :class:`models.attention.Histories`."""

from __future__ import annotations

import math

import torch
from torch import nn

from models.attention import Histories, rotary_angles, rotate

_MAX_AGE_DAYS = 3650.0
# ids start small: a rarely seen item's random vector would otherwise drown its category's (and
# its action's and age's) in every attention score
ITEM_INIT_SCALE = 0.1
_ITEM_DRAW_ROWS = 1 << 18  # rows per draw of the item table's initial values


def draw_item_rows(seed: int, vocab_size: int, dim: int, rank: int = 0, world: int = 1,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows ``rank::world`` ([ceil((vocab_size - rank) / world), dim] fp32) of the item table's
    initial values: N(0, (ITEM_INIT_SCALE / sqrt(dim))^2) from a generator of their own seeded with
    `seed`, drawn in fixed blocks of rows, so that every process draws the same table whichever
    rows it keeps (a shard of a table no process could hold whole) and the global RNG is untouched."""
    gen = torch.Generator(device).manual_seed(seed)
    parts = []
    for lo in range(0, vocab_size, _ITEM_DRAW_ROWS):
        block = torch.randn(min(_ITEM_DRAW_ROWS, vocab_size - lo), dim, generator=gen, device=device)
        parts.append(block[(rank - lo) % world::world])
    rows = torch.cat(parts) if parts else torch.empty(0, dim, device=device)
    return rows.mul_(ITEM_INIT_SCALE * dim**-0.5)


class HistoryEmbedding(nn.Module):
    """Item (+ category) + action + age-bucket embeddings of the history rows, summed: -> [T, D].

    The item table is shared with the candidate (:attr:`item`, :meth:`candidate`); its initial
    rows come from :func:`draw_item_rows` with ``item_seed`` (on the ``meta`` device with
    ``item_device="meta"``: a caller that keeps a shard draws it). Ages (days,
    >= 0) fall into log-spaced buckets from one hour to ten years. ``sparse_item``: the item
    table's gradient is a sparse tensor (the rows a batch looked up) instead of a dense
    ``[vocab_size, dim]`` one. ``n_categories`` > 0: an item's category embedding is added to its
    item embedding; the category of each id is the buffer ``item_category`` (the data set's
    catalogue, :meth:`set_categories`; until then every id is of the extra "unknown" category)."""

    def __init__(self, vocab_size: int, n_actions: int, dim: int, num_age_buckets: int, sparse_item: bool = False,
                 n_categories: int = 0, item_device: str | None = None):
        super().__init__()
        self.item_seed = torch.initial_seed()  # seed_everything's seed: the table's own draw
        rows = torch.empty(vocab_size, dim, device="meta") if item_device == "meta" else \
            draw_item_rows(self.item_seed, vocab_size, dim)
        self.item = nn.Embedding(vocab_size, dim, sparse=sparse_item, _weight=rows)
        self.action = nn.Embedding(n_actions, dim)
        self.age = nn.Embedding(num_age_buckets, dim)
        self.category = nn.Embedding(n_categories + 1, dim) if n_categories > 0 else None
        if self.category is not None:
            self.register_buffer("item_category", torch.full((vocab_size,), n_categories, dtype=torch.int32))
        edges = torch.logspace(math.log10(1 / 24), math.log10(_MAX_AGE_DAYS), num_age_buckets - 1)
        self.register_buffer("age_edges", edges, persistent=False)
        for table in (self.action, self.age, self.category):
            if table is not None:
                nn.init.normal_(table.weight, std=dim**-0.5)

    def set_categories(self, item_category) -> None:
        """The category of every item id ([vocab_size] ints in [0, n_categories]; n_categories:
        unknown), copied in place (a captured CUDA graph keeps reading the same buffer)."""
        self.item_category.copy_(torch.as_tensor(item_category))

    def item_rows(self, hist: torch.Tensor, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The item table's rows of the histories [T] and the candidates [B] by one lookup: one
        [vocab_size, D] gradient where two lookups make two and add them. A sharded table
        (pipeline.table) looks up each of these very tensors from its prefetch."""
        if not isinstance(self.item, nn.Embedding):
            return self.item(hist), self.item(cand)
        return self.item(torch.cat([hist.long(), cand.long()])).split([hist.numel(), cand.numel()])

    def candidate(self, item: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The candidate's embedding [B, D]: its item's (`rows`, if looked up), plus its category's."""
        x = self.item(item) if rows is None else rows
        return x if self.category is None else x + self.category(self.item_category[item.long()])

    def forward(self, item: torch.Tensor, action: torch.Tensor, age: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        buckets = torch.bucketize(age.float(), self.age_edges)  # [T] in [0, num_age_buckets)
        return self.candidate(item, rows) + self.action(action.long()) + self.age(buckets)  # [T, D]


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + Attn(LN(x)), then x + FFN(LN(x)); with ``shards`` (an
    S2 layout, kernels.S2Shards) each head attends to its strided key blocks only, with
    ``window`` each item to the items at most that many places away."""

    def __init__(self, dim: int, num_heads: int, ffn_mult: int, shards=None, rotary: bool = False,
                 window: int | None = None):
        super().__init__()
        self.num_heads, self.shards, self.window = num_heads, shards, window  # shards: an S2 layout or None (dense)
        self.rotary = rotary  # q and k rotated by the items' recency (Histories.rotary)
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_mult * dim), nn.GELU(), nn.Linear(ffn_mult * dim, dim))
        for out in (self.proj, self.ffn[-1]):  # the block starts as the identity: it must earn its mixing
            nn.init.zeros_(out.weight)
            nn.init.zeros_(out.bias)

    def forward(self, x: torch.Tensor, hist: Histories) -> torch.Tensor:
        """x [T, D] (jagged) or [B, N, D] (padded) -> same shape."""
        qkv = self.qkv(self.norm1(x)).unflatten(-1, (3, self.num_heads, -1))  # [..., 3, H, Dh]
        q, k, v = qkv.unbind(-3)  # [..., H, Dh]
        if self.rotary:
            q, k = hist.rotary(q), hist.rotary(k)
        x = x + self.proj(hist.self_attention(q, k, v, self.shards, self.window).flatten(-2))
        return x + self.ffn(self.norm2(x))


class TargetAttention(nn.Module):
    """The candidate attends over the encoded history: -> [B, D] (zeros for an empty history).
    ``rotary``: the candidate's query sits at recency -1, the history's keys at their own."""

    def __init__(self, dim: int, num_heads: int, rotary: bool = False):
        super().__init__()
        self.num_heads, self.rotary = num_heads, rotary
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, cand: torch.Tensor, x: torch.Tensor, hist: Histories) -> torch.Tensor:
        q = self.q(cand).unflatten(-1, (1, self.num_heads, -1))  # [B, 1, H, Dh]
        k, v = self.kv(x).unflatten(-1, (2, self.num_heads, -1)).unbind(-3)  # [..., H, Dh]
        if self.rotary:
            real = torch.promote_types(q.dtype, torch.float32)
            q = rotate(q, rotary_angles(torch.full(q.shape[:2], -1, device=q.device), q.shape[-1], real))
            k = hist.rotary(k)
        return self.proj(hist.target_attention(q, k, v).flatten(-3))  # [B, D]


class HistoryInteraction(nn.Module):
    """K candidate-conditioned poolings of the history (second-order candidate x item x item).

    The candidate gives K probe vectors C_b [D, K]; every history item gets scores
    s_t = x_t C_b / sqrt(D) (``jagged_dense_bmm``); the pooling P_b = sum_t s_t^T x_t / len_b
    (``jagged_jagged_bmm``) is [K, D]. Output: LayerNorm(flatten(P)) [B, K * D]."""

    def __init__(self, dim: int, pool_heads: int):
        super().__init__()
        self.pool_heads = pool_heads
        self.probe = nn.Linear(dim, dim * pool_heads)
        self.norm = nn.LayerNorm(dim * pool_heads)

    def forward(self, cand: torch.Tensor, x: torch.Tensor, hist: Histories) -> torch.Tensor:
        dim = cand.shape[-1]
        probes = self.probe(cand).unflatten(-1, (dim, self.pool_heads))  # [B, D, K]
        s = hist.scores(x, probes.to(x.dtype)) * dim**-0.5  # [T, K] or [B, N, K]
        pooled = hist.pool(s, x)  # [B, K, D]
        pooled = pooled / hist.lengths.clamp(min=1).to(pooled.dtype)[:, None, None]
        return self.norm(pooled.flatten(1))  # [B, K * D]


def mlp(in_dim: int, dims: list[int]) -> nn.Sequential:
    """Linear-ReLU stack ending in one logit."""
    layers: list[nn.Module] = []
    for d in dims:
        layers += [nn.Linear(in_dim, d), nn.ReLU()]
        in_dim = d
    layers.append(nn.Linear(in_dim, 1))
    return nn.Sequential(*layers)
