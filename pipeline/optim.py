"""The optimizer of a run (``model.optimizer``): AdamW (the default), SGD, Adagrad, rowwise or lazyadam
(AdamW for every parameter but the item table, which takes row-wise Adagrad or Lazy Adam).

All but AdamW leave the item table undecayed and train the same weights with any
``model.embedding_grad``; AdamW needs dense table gradients (why: docs/training.md#optimizers).
"""

from __future__ import annotations

import torch
from torch import nn

# each optimizer's state of the item table: (floats per element, floats per row, floats per element of scratch in its
# update of a dense gradient), what the start-up memory check counts (pipeline.cli.check_table_memory)
TABLE_STATE = {"adamw": (2, 0, 0), "sgd": (0, 0, 0), "adagrad": (1, 0, 0), "rowwise": (0, 1, 0), "lazyadam": (2, 0, 2)}
OPTIMIZERS = tuple(TABLE_STATE)


def param_groups(name: str, params: list[nn.Parameter], table: nn.Parameter, weight_decay: float,
                 table_lr: float | None = None) -> list[dict]:
    """The parameter groups of optimizer `name` (the item table undecayed, last, at `table_lr`
    where given, unless AdamW)."""
    if name == "adamw":
        return [{"params": list(params), "weight_decay": weight_decay}]
    lr = {} if table_lr is None else {"lr": table_lr}
    return [{"params": [p for p in params if p is not table], "weight_decay": weight_decay},
            {"params": [table], "weight_decay": 0.0, **lr}]


def table_index(groups: list[dict], table: nn.Parameter) -> int:
    """The key of `table`'s state in the optimizer's state_dict over `groups` (its position)."""
    return next(i for i, p in enumerate(p for g in groups for p in g["params"]) if p is table)


def build_optimizer(name: str, params: list[nn.Parameter], table: nn.Parameter, *, lr: float,
                    weight_decay: float, betas: tuple[float, float], fused: bool | None,
                    table_lr: float | None = None) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (`table`, the item table, among them).

    fused: AdamW's one-pass update (CUDA and CPU); the others use torch's default implementation."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
    groups = param_groups(name, params, table, weight_decay, table_lr)
    if name in ("rowwise", "lazyadam"):
        return (RowwiseTableAdamW if name == "rowwise" else LazyTableAdamW)(groups, lr=lr, betas=betas, fused=fused)
    return (torch.optim.SGD if name == "sgd" else torch.optim.Adagrad)(groups, lr=lr)


def summed_rows(grad: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, gradients) of a sparse [V, D] `grad`, each row once with its repeats added up, at the
    size of its entries (coalesce reads the count on the host): the slots past the distinct rows
    hold a zero gradient, each for a row of its own (slot mod V), so that an update's index_add_
    does not pile their zeros onto one row's atomics."""
    rows, values = grad._indices()[0], grad._values().to(dtype)
    if grad.is_coalesced():
        return rows, values
    rows, order = rows.sort()
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    slot = first.cumsum(0) - 1  # the distinct row each entry adds to
    spare = torch.arange(rows.numel(), device=rows.device)
    distinct = rows.new_zeros(rows.shape).index_add_(0, slot, rows * first)
    return (torch.where(spare < first.sum(), distinct, spare % grad.shape[0]),
            values.new_zeros(values.shape).index_add_(0, slot, values[order]))


class TableAdamW(torch.optim.AdamW):
    """AdamW over every group but the last, the item table, which a subclass's ``_table_step`` updates."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], fused: bool | None,
                 eps: float = 1e-8):
        super().__init__(groups, lr=lr, betas=betas, fused=fused)
        self.table_eps = eps

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # first, as AdamW does: it may compute the gradients
            with torch.enable_grad():
                loss = closure()
        table = self.param_groups[-1]["params"][0]
        given = table.grad
        if given is not None:
            self._table_step(table, given, self.param_groups[-1]["lr"])
            table.grad = None  # AdamW skips a parameter without a gradient
        try:
            super().step()
        finally:
            table.grad = given
        return loss


class RowwiseTableAdamW(TableAdamW):
    """AdamW over every group but the last, the item table, which takes row-wise Adagrad (the
    embedding optimizer of production rankers, FBGEMM's EXACT_ROWWISE_ADAGRAD):

        s[i] += mean_d g[i, d]^2;    w[i] -= lr * g[i] / (sqrt(s[i]) + eps)

    One float of state per row (`sum_sq`, ``[V]``, and a step count) where AdamW keeps two per
    element, 2 x D x 4 bytes a row. A row a step did not touch (a zero row of a dense gradient, or one absent from a
    sparse gradient) keeps its weights and state, so the three ``model.embedding_grad`` modes train
    the same table. The update has no host sync with a dense gradient (a CUDA graph can hold it)."""

    def _table_step(self, table: torch.Tensor, given: torch.Tensor, lr: float) -> None:
        state = self.state[table]
        if "sum_sq" not in state:
            wide = torch.promote_types(table.dtype, torch.float32)  # float32, or float64 for a float64 table
            state["sum_sq"] = torch.zeros(table.shape[0], dtype=wide, device=table.device)
            state["step"] = torch.zeros((), dtype=torch.float32, device=table.device)  # AdamW's loader wants one
        s = state["sum_sq"]
        state["step"].add_(1)
        if given.is_sparse:
            rows, g = summed_rows(given, s.dtype)
            s.index_add_(0, rows, g.square().mean(1))
            table.index_add_(0, rows, (g / (s[rows].sqrt() + self.table_eps).unsqueeze(1) * -lr).to(table.dtype))
        else:  # no [V, D] temporary: a norm per row, then one fused update
            s.add_(torch.linalg.vector_norm(given, dim=1, dtype=s.dtype).square_(), alpha=1 / table.shape[1])
            table.addcdiv_(given, s.sqrt().add_(self.table_eps).unsqueeze(1), value=-lr)


class LazyTableAdamW(TableAdamW):
    """AdamW over every group but the last, the item table, which takes Lazy Adam (FBGEMM's fused embedding Adam):
    a row that a step's gradient holds (a non-zero row of a dense gradient, an entry of a sparse one) updates its
    moments and weights as torch.optim.Adam, bias-corrected by the table's step count; any other row keeps them
    (AdamW would decay its moments and move it). So the ``model.embedding_grad`` modes train the same table."""

    def _table_step(self, table: torch.Tensor, given: torch.Tensor, lr: float) -> None:
        state, (b1, b2) = self.state[table], self.param_groups[-1]["betas"]
        if "exp_avg" not in state:
            moments = [torch.zeros_like(table, dtype=torch.promote_types(table.dtype, torch.float32)) for _ in "mv"]
            state.update(exp_avg=moments[0], exp_avg_sq=moments[1], step=table.new_zeros((), dtype=torch.float32))
        m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"].add_(1).to(state["exp_avg"].dtype)
        rows, g = summed_rows(given, m.dtype) if given.is_sparse else (None, given.to(m.dtype))
        used = g.ne(0).any(1, keepdim=True).to(m.dtype)  # a summed gradient's padding slots: zeros, unused
        if rows is None:  # the whole table in place
            m_new, v_new = m.lerp_(g, used * (1 - b1)), v.lerp_(g * g, used * (1 - b2))
        else:  # the step's rows: each moment read once, its change added to the table's (an unused slot adds zeros)
            m_new, v_new = m[rows], v[rows]
            for x, new, target, beta in ((m, m_new, g, b1), (v, v_new, g * g, b2)):
                x.index_add_(0, rows, change := (target - new).mul_(used * (1 - beta)))
                new.add_(change)
        denom = (v_new / (1 - b2 ** t)).sqrt_().add_(self.table_eps).mul_(1 - b1 ** t)  # dense: [V, D] temporaries
        if rows is None:
            table.addcdiv_(m * used, denom, value=-lr)
        else:
            table.index_add_(0, rows, (m_new * used / denom * -lr).to(table.dtype))
