"""The optimizer of a run (``model.optimizer``): AdamW (the default), SGD or Adagrad.

SGD and Adagrad leave the item table undecayed and train the same weights with any
``model.embedding_grad``; AdamW needs dense table gradients (why: docs/training.md#optimizers).
"""

from __future__ import annotations

import torch
from torch import nn

OPTIMIZERS = ("adamw", "sgd", "adagrad")


def build_optimizer(name: str, params: list[nn.Parameter], table: nn.Parameter, *, lr: float,
                    weight_decay: float, betas: tuple[float, float], fused: bool | None) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (`table`, the item table, among them).

    fused: AdamW's one-pass update (CUDA and CPU); the others use torch's default implementation.
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
    groups = [{"params": [p for p in params if p is not table], "weight_decay": weight_decay},
              {"params": [table], "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
