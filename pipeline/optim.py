"""The optimizer of a run (``model.optimizer``): AdamW (the default), SGD or Adagrad.

SGD and Adagrad leave the item table undecayed and train the same weights with any
``model.embedding_grad``; AdamW needs dense table gradients (why: docs/training.md#optimizers).
"""

from __future__ import annotations

import torch
from torch import nn

OPTIMIZERS = ("adamw", "sgd", "adagrad")


def param_groups(name: str, params: list[nn.Parameter], table: nn.Parameter, weight_decay: float) -> list[dict]:
    """The parameter groups of optimizer `name` (the item table undecayed, last, unless AdamW)."""
    if name == "adamw":
        return [{"params": list(params), "weight_decay": weight_decay}]
    return [{"params": [p for p in params if p is not table], "weight_decay": weight_decay},
            {"params": [table], "weight_decay": 0.0}]


def table_index(groups: list[dict], table: nn.Parameter) -> int:
    """The key of `table`'s state in the optimizer's state_dict over `groups` (its position)."""
    return next(i for i, p in enumerate(p for g in groups for p in g["params"]) if p is table)


def build_optimizer(name: str, params: list[nn.Parameter], table: nn.Parameter, *, lr: float,
                    weight_decay: float, betas: tuple[float, float], fused: bool | None) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (`table`, the item table, among them).

    fused: AdamW's one-pass update (CUDA and CPU); the others use torch's default implementation.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
    groups = param_groups(name, params, table, weight_decay)
    return (torch.optim.SGD if name == "sgd" else torch.optim.Adagrad)(groups, lr=lr)
