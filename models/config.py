"""The ranker's hyperparameters: defaults here, deltas in experiments/configs/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

BACKENDS = ("dense", "sdpa", "jagged")
KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass
class RankerConfig:
    """The ranker's architecture (model.ranker.*); sizes that come from the data are not here.

    Args:
        backend: how the history is laid out and attended: dense (padded, matmul-mask-softmax),
            sdpa (padded, scaled_dot_product_attention with a key-padding mask) or jagged
            (values + offsets through the kernels package). Same parameters, same function.
        embed_dim: width of every embedding and of the encoder.
        num_heads: attention heads (embed_dim must be a multiple).
        num_layers: self-attention blocks over the history (0: none).
        ffn_mult: hidden width of each block's feed-forward layer, in multiples of embed_dim.
        num_age_buckets: log-spaced buckets of an item's age (one hour to ten years).
        target_attention: the candidate attends over the encoded history.
        interaction: the candidate-conditioned poolings of the history (jagged bmm ops).
        pool_heads: poolings of the interaction block.
        mlp_dims: hidden widths of the final MLP.
        kernel_backend: the kernels' implementation: auto (Triton on CUDA, torch reference on
            CPU), torch (the reference everywhere, for debugging) or triton.
    """

    backend: Literal["dense", "sdpa", "jagged"] = "jagged"
    embed_dim: int = 64
    num_heads: int = 2
    num_layers: int = 2
    ffn_mult: int = 2
    num_age_buckets: int = 32
    target_attention: bool = True
    interaction: bool = True
    pool_heads: int = 4
    mlp_dims: list[int] = field(default_factory=lambda: [256, 128])
    kernel_backend: Literal["auto", "torch", "triton"] = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"ranker backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        for name in ("embed_dim", "num_heads", "ffn_mult", "num_age_buckets", "pool_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ranker {name} must be > 0, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise ValueError(f"ranker num_layers must be >= 0, got {self.num_layers}")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"ranker embed_dim ({self.embed_dim}) must be a multiple of num_heads ({self.num_heads})"
            )
        if any(d <= 0 for d in self.mlp_dims):
            raise ValueError(f"ranker mlp_dims must all be > 0, got {self.mlp_dims}")
