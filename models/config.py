"""The ranker's hyperparameters: defaults here, deltas in experiments/configs/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

ATTENTIONS = ("dense", "sdpa", "jagged")


class InvalidConfig(ValueError):
    """A ranker setting that cannot work; the message names the option (the CLI prints it alone)."""

KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass
class UserEmbeddingConfig:
    """A user embedding learned offline (python -m pipeline.user_embeddings) as a ranker feature.

    Args:
        dim: width of the embeddings in the file (checked against it).
        path: the Parquet file written by `pipeline.user_embeddings export` (its manifest
            <path>.json beside it).
        lag_days: an impression on day t reads the newest embedding with as_of_day <= t -
            lag_days (an embedding as of day d is computed from the logs before day d)."""

    dim: int
    path: str
    lag_days: int = 0

    def __post_init__(self) -> None:
        if self.dim <= 0:
            raise InvalidConfig(f"user_embedding.dim must be > 0, got {self.dim}")
        if self.lag_days < 0:
            raise InvalidConfig(f"user_embedding.lag_days must be >= 0 (a negative lag reads embeddings "
                             f"computed after the impression: leakage), got {self.lag_days}")
        if not str(self.path):
            raise InvalidConfig("user_embedding.path is empty")


@dataclass
class S2Config:
    """S2 attention in the history encoder (kernels/s2.py): each head sees the local_blocks
    most recent key blocks of `block` items and every stride-th block at its own offset.

    Args:
        block: items per key block (a positive multiple of 16).
        local_blocks: most recent blocks every head sees.
        stride: a head sees every stride-th older block.
        dense_every: every dense_every-th encoder layer stays dense (the hybrid layout that
            keeps quality); 0: every layer is S2.
        allow_partial_context: accept heads that together miss some block residues (s2
            coverage < 1: fewer heads than the stride needs, with the default offsets)."""

    block: int = 64
    local_blocks: int = 4
    stride: int = 8
    dense_every: int = 2
    allow_partial_context: bool = False

    def __post_init__(self) -> None:
        if self.dense_every < 0:
            raise InvalidConfig(f"s2.dense_every must be >= 0, got {self.dense_every}")
        try:
            self.shards()
        except (ValueError, TypeError) as err:
            raise InvalidConfig(f"model.ranker.s2: {err}") from None

    def shards(self):
        from kernels.s2 import S2Shards

        return S2Shards(self.block, self.local_blocks, self.stride)

    def is_dense(self, layer: int) -> bool:
        """Whether encoder layer `layer` (0-based) stays dense."""
        return self.dense_every > 0 and (layer + 1) % self.dense_every == 0


@dataclass
class RankerConfig:
    """The ranker's architecture (model.ranker.*); sizes that come from the data are not here.

    Args:
        attention: how the history is laid out and attended: dense (padded, matmul-mask-softmax),
            sdpa (padded, scaled_dot_product_attention with a key-padding mask) or jagged
            (values + offsets through the kernels package). Same parameters, same function.
        embed_dim: width of every embedding and of the encoder.
        num_heads: attention heads (embed_dim must be a multiple).
        num_layers: self-attention blocks over the history (0: none).
        ffn_mult: hidden width of each block's feed-forward layer, in multiples of embed_dim.
        num_age_buckets: log-spaced buckets of an item's age (one hour to ten years).
        target_attention: the candidate attends over the encoded history.
        interaction: the candidate-conditioned poolings of the history (jagged bmm ops).
        category_embedding: add the embedding of each item's category (the data set's catalogue)
            to its item embedding, in the history and for the candidate; off: item ids only.
        rotary_positions: rotate the queries and keys of self-attention and target attention by
            each item's recency (rotary embeddings; the candidate sits just after the most recent
            item), so that attention sees the order of the history; off: age buckets only.
        raw_history: target attention, the mean and the poolings read the embedded items before
            the encoder blocks, and a second target attention reads the encoded ones (the blocks
            can only add to what the ranker without them reads); off: all read the encoded items.
        local_window: self-attention of an item reads only the items at most this many places
            before or after it in its history (every head, every block): a locality prior for
            short-range order (data_gen's motifs; docs/data.md: what it did); none: the whole history.
        pool_heads: poolings of the interaction block.
        mlp_dims: hidden widths of the final MLP.
        kernel_backend: the kernels' implementation: auto (Triton on CUDA, torch reference on
            CPU), torch (the reference everywhere, for debugging) or triton.
        user_embedding: a user embedding learned offline, joined to each example as of its
            day (timeline data only): {dim, path, lag_days}; none by default.
        s2: S2 attention in the encoder's self-attention (jagged attention only): {block, local_blocks, stride,
            dense_every, allow_partial_context}; none by default."""

    attention: Literal["dense", "sdpa", "jagged"] = "jagged"
    embed_dim: int = 64
    num_heads: int = 2
    num_layers: int = 2
    ffn_mult: int = 2
    num_age_buckets: int = 32
    target_attention: bool = True
    interaction: bool = True
    category_embedding: bool = True
    rotary_positions: bool = True
    raw_history: bool = False
    local_window: Optional[int] = None
    pool_heads: int = 4
    mlp_dims: list[int] = field(default_factory=lambda: [256, 128])
    kernel_backend: Literal["auto", "torch", "triton"] = "auto"
    user_embedding: Optional[UserEmbeddingConfig] = None
    s2: Optional[S2Config] = None

    def __post_init__(self) -> None:
        if isinstance(self.user_embedding, dict):  # from a checkpoint's hyperparameters
            self.user_embedding = UserEmbeddingConfig(**self.user_embedding)
        if isinstance(self.s2, dict):
            self.s2 = S2Config(**self.s2)
        if self.s2 is not None:
            if self.attention != "jagged":
                raise InvalidConfig(f"model.ranker.s2 needs attention jagged (the S2 mask lives in the jagged "
                                    f"kernels), got attention {self.attention!r}")
            from kernels.s2 import s2_coverage

            coverage = s2_coverage(self.s2.shards(), self.num_heads)
            if coverage < 1.0 and not self.s2.allow_partial_context:
                raise InvalidConfig(f"model.ranker.s2: {self.num_heads} heads see {coverage:.0%} of the block residues "
                                    f"of stride {self.s2.stride}: older context is lost; use num_heads >= stride or "
                                    "set s2.allow_partial_context true")
        if self.local_window is not None and self.local_window < 1:
            raise InvalidConfig(f"model.ranker.local_window must be >= 1 (or null: the whole history), "
                                f"got {self.local_window}")
        if self.local_window is not None and self.s2 is not None:
            raise InvalidConfig("model.ranker.local_window and model.ranker.s2 are two sparsity patterns: set one")
        if self.attention not in ATTENTIONS:
            raise InvalidConfig(f"model.ranker.attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise InvalidConfig(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        for name in ("embed_dim", "num_heads", "ffn_mult", "num_age_buckets", "pool_heads"):
            if getattr(self, name) <= 0:
                raise InvalidConfig(f"ranker {name} must be > 0, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise InvalidConfig(f"ranker num_layers must be >= 0, got {self.num_layers}")
        if self.embed_dim % self.num_heads:
            raise InvalidConfig(
                f"ranker embed_dim ({self.embed_dim}) must be a multiple of num_heads ({self.num_heads})"
            )
        if any(d <= 0 for d in self.mlp_dims):
            raise InvalidConfig(f"ranker mlp_dims must all be > 0, got {self.mlp_dims}")


def feature_width(n_dense: int, cfg: RankerConfig) -> int:
    """Columns of a batch's "dense" tensor: the data set's n_dense features, then, with a user
    embedding, its dim values and a known flag (1: joined, 0: the user has none yet)."""
    return n_dense + (cfg.user_embedding.dim + 1 if cfg.user_embedding is not None else 0)
