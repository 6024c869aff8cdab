"""The optimizer of a run (``model.optimizer``): AdamW (the default), SGD or Adagrad.

Comparing the embedding-gradient modes (``model.embedding_grad``, :mod:`pipeline.gradsync`)
needs an optimizer whose update of a row depends only on that row's gradient and treats a row
that a step did not touch the same whether its gradient is a dense zero or absent from a sparse
tensor. Plain SGD (no momentum) and Adagrad (``torch.optim.Adagrad``: element-wise, the same
rule as the row-wise Adagrad of production rankers per element) do: an absent row and a zero
row both leave the row and its state unchanged, so the three modes train the same weights (up
to the order of floating-point sums).

AdamW cannot be compared as is. It has no sparse-gradient path (``torch.optim.AdamW`` refuses a
sparse gradient), and with dense zeros it still moves every row whose moments are non-zero and
decays every row: work and results no sparse method can reproduce. ``torch.optim.SparseAdam``
is not the same algorithm either: it updates the moments of the present rows only, so a row's
moments stop decaying while it is not looked up. So ``sparse`` needs sgd or adagrad; ``dense``
and ``densify`` hand the optimizer dense gradients and run with any of the three.

Weight decay (``model.weight_decay``) under sgd and adagrad applies to every parameter but the
item table: decaying the table moves every row on every step, which a sparse update cannot do,
so the table is left undecayed in every mode alike.
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
