"""model.optimizer rowwise and lazyadam: AdamW for the network, row-wise Adagrad or Lazy Adam for the item table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.optim import OPTIMIZERS, TABLE_STATE, build_optimizer, summed_rows

V, D = 9, 4


def _model() -> tuple[nn.Module, nn.Parameter]:
    torch.manual_seed(3)
    model = nn.ModuleDict({"table": nn.Embedding(V, D), "head": nn.Linear(D, 1)}).double()
    return model, model["table"].weight


def _grads(step: int) -> torch.Tensor:
    """A table gradient touching rows 1, 4 and 7 (row 4 twice, on even steps only)."""
    g = torch.zeros(V, D, dtype=torch.float64)
    gen = torch.Generator().manual_seed(step)
    rows = [1, 4, 7] if step % 2 == 0 else [1, 7]
    g[rows] = torch.randn(len(rows), D, generator=gen, dtype=torch.float64)
    return g


def test_the_table_takes_rowwise_adagrad_and_the_network_adamw():
    model, table = _model()
    head = model["head"].weight
    ref = nn.Linear(D, 1).double()
    ref.load_state_dict(model["head"].state_dict())
    opt = build_optimizer("rowwise", list(model.parameters()), table, lr=0.1, weight_decay=0.01,
                          betas=(0.9, 0.98), fused=None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.01, betas=(0.9, 0.98))
    w, s = table.detach().clone(), torch.zeros(V, dtype=torch.float64)
    for step in range(4):
        g, gh = _grads(step), torch.randn(1, D, dtype=torch.float64)
        table.grad, head.grad, model["head"].bias.grad = g.clone(), gh.clone(), torch.ones(1, dtype=torch.float64)
        ref.weight.grad, ref.bias.grad = gh.clone(), torch.ones(1, dtype=torch.float64)
        opt.step()
        ref_opt.step()
        s += g.square().mean(1)
        w -= 0.1 * g / (s.sqrt() + 1e-8).unsqueeze(1)
        assert table.grad is not None and torch.equal(table.grad, g)  # left as it was for the caller
    torch.testing.assert_close(table.detach(), w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(head.detach(), ref.weight.detach(), rtol=1e-12, atol=1e-12)
    untouched = [0, 2, 3, 5, 6, 8]
    assert torch.equal(table.detach()[untouched], _model()[1].detach()[untouched])  # no decay, no move
    state = opt.state[table]
    assert set(state) == {"step", "sum_sq"} and state["sum_sq"].shape == (V,) and state["step"] == 4  # no moments
    torch.testing.assert_close(state["sum_sq"], s, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["rowwise", "lazyadam"])
def test_a_sparse_gradient_trains_the_table_as_a_dense_one(name):
    tables = []
    for sparse in (False, True):
        model, table = _model()
        opt = build_optimizer(name, list(model.parameters()), table, lr=0.1, weight_decay=0.0,
                              betas=(0.9, 0.98), fused=None)
        for step in range(3):
            g = _grads(step)
            if sparse:  # a row's gradient in two pieces, unsorted, uncoalesced: as the sharded table gives
                rows = g.abs().sum(1).nonzero().reshape(-1)
                idx, vals = torch.cat([rows, rows[1:2]]), torch.cat([g[rows], 0.75 * g[rows[1:2]]])
                vals[1] *= 0.25
                order = torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(step))
                g = torch.sparse_coo_tensor(idx[order][None], vals[order], (V, D), check_invariants=True)
                assert not g.is_coalesced()
            table.grad = g
            opt.step()
        tables.append(table.detach().clone())
    torch.testing.assert_close(tables[1], tables[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["rowwise", "lazyadam"])
def test_its_state_survives_a_state_dict_round_trip(name):
    model, table = _model()
    opt = build_optimizer(name, list(model.parameters()), table, lr=0.1, weight_decay=0.0, betas=(0.9, 0.98), fused=None)
    table.grad = _grads(0)
    opt.step()
    model2, table2 = _model()
    opt2 = build_optimizer(name, list(model2.parameters()), table2, lr=0.1, weight_decay=0.0, betas=(0.9, 0.98),
                           fused=None)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[table2].keys() == opt.state[table].keys()
    for key, value in opt.state[table].items():
        assert torch.equal(opt2.state[table2][key], value)


def test_the_table_can_have_its_own_learning_rate():
    model, table = _model()
    opt = build_optimizer("rowwise", list(model.parameters()), table, lr=0.1, weight_decay=0.0, betas=(0.9, 0.98),
                          fused=None, table_lr=0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5] and opt.param_groups[-1]["params"] == [table]
    table.grad = _grads(0)
    opt.step()
    g = _grads(0)[1]
    torch.testing.assert_close(table.detach()[1], _model()[1].detach()[1] - 0.5 * g / g.square().mean().sqrt(),
                               rtol=1e-6, atol=1e-6)


def test_the_table_takes_lazy_adam_and_the_network_adamw():
    """Lazy Adam by hand, row by row: a row the step's gradient holds moves as Adam's (rows 1 and 7, held by every
    step, exactly as torch.optim.Adam's), row 4 (even steps only) keeps its moments on the odd ones, the rest stay."""
    model, table = _model()
    head = model["head"].weight
    ref_head = nn.Parameter(head.detach().clone())
    opt = build_optimizer("lazyadam", list(model.parameters()), table, lr=0.1, weight_decay=0.01,
                          betas=(0.9, 0.98), fused=None)
    ref = nn.Parameter(table.detach().clone())
    adam = torch.optim.Adam([ref], lr=0.1, betas=(0.9, 0.98), eps=1e-8)
    adamw = torch.optim.AdamW([ref_head], lr=0.1, weight_decay=0.01, betas=(0.9, 0.98))
    w, m, v = table.detach().clone(), torch.zeros(V, D, dtype=torch.float64), torch.zeros(V, D, dtype=torch.float64)
    for step in range(4):
        g, gh = _grads(step), torch.randn(1, D, dtype=torch.float64)
        table.grad, ref.grad, head.grad, ref_head.grad = g.clone(), g.clone(), gh.clone(), gh.clone()
        opt.step()
        adam.step()
        adamw.step()
        t = step + 1
        for i in g.abs().sum(1).nonzero().reshape(-1).tolist():
            m[i] = 0.9 * m[i] + 0.1 * g[i]
            v[i] = 0.98 * v[i] + 0.02 * g[i] ** 2
            w[i] -= 0.1 * (m[i] / (1 - 0.9 ** t)) / ((v[i] / (1 - 0.98 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(table.detach(), w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(head.detach(), ref_head.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(table.detach()[[1, 7]], ref.detach()[[1, 7]], rtol=1e-10, atol=1e-12)
    assert not torch.allclose(table.detach()[4], ref.detach()[4])  # Adam moved row 4 on the odd steps too
    untouched = [0, 2, 3, 5, 6, 8]
    assert torch.equal(table.detach()[untouched], _model()[1].detach()[untouched])  # no decay, no move
    state = opt.state[table]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"] == 4
    torch.testing.assert_close(state["exp_avg"], m, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state["exp_avg_sq"], v, rtol=1e-10, atol=1e-12)


def test_lazy_adam_takes_row_0_and_the_exchange_padding_of_a_sparse_gradient():
    """The sharded exchange's sparse gradient sends its empty slots to row 0 with zero values: a real row 0 among
    them trains as in the dense gradient, and without it row 0 stays as it was (its zero rows are not held)."""
    for real in (True, False):
        tables = []
        for sparse in (False, True):
            model, table = _model()
            opt = build_optimizer("lazyadam", list(model.parameters()), table, lr=0.1, weight_decay=0.0,
                                  betas=(0.9, 0.98), fused=None)
            for step in range(3):
                g = _grads(step)
                g[0] = torch.full((D,), 0.5 * (step + 1), dtype=torch.float64) if real else 0.0
                if sparse:
                    idx = torch.tensor([0, 7, 0, 1, 0, 4, 0])
                    vals = torch.cat([g[0:1], g[[7]], torch.zeros(1, D, dtype=torch.float64), g[[1]],
                                      torch.zeros(1, D, dtype=torch.float64), g[[4]], torch.zeros(1, D, dtype=torch.float64)])
                    g = torch.sparse_coo_tensor(idx[None], vals, (V, D), check_invariants=True)
                table.grad = g
                opt.step()
            tables.append(table.detach().clone())
        torch.testing.assert_close(tables[1], tables[0], rtol=1e-12, atol=1e-12)
        assert torch.equal(tables[1][0], _model()[1].detach()[0]) != real  # row 0 moved only when it was held


def test_summed_rows_adds_repeats_and_spreads_its_padding_over_rows_of_their_own():
    """Each distinct row once with its repeats added up; the slots past them carry zeros, each to its own row (slot
    mod V), not all to row 0, where an update's index_add_ would pile up their atomics."""
    idx = torch.tensor([5, 2, 5, 0, 2, 5, 8, 5])
    vals = torch.arange(8 * D, dtype=torch.float32).reshape(8, D)
    rows, g = summed_rows(torch.sparse_coo_tensor(idx[None], vals, (V, D)), torch.float64)
    assert rows.tolist()[:4] == [0, 2, 5, 8] and rows.tolist()[4:] == [4 % V, 5 % V, 6 % V, 7 % V]
    torch.testing.assert_close(g[:4], torch.stack([vals[idx == r].sum(0) for r in (0, 2, 5, 8)]).double())
    assert g.dtype == torch.float64 and not g[4:].any()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_table_state_counts_the_state_each_optimizer_keeps_for_the_table(name):
    """TABLE_STATE (what the start-up memory check counts) against the state a step leaves: floats per element
    ([V, D] tensors) and per row ([V] tensors)."""
    model, table = _model()
    opt = build_optimizer(name, list(model.parameters()), table, lr=0.1, weight_decay=0.0, betas=(0.9, 0.98),
                          fused=None)
    table.grad = _grads(0)
    opt.step()
    state = [t for t in opt.state[table].values() if torch.is_tensor(t) and t.dim() > 0]
    assert len(state) == sum(TABLE_STATE[name][:2])  # nothing else of the table's size
    assert sum(t.shape == table.shape for t in state) == TABLE_STATE[name][0]
    assert sum(t.shape == (V,) for t in state) == TABLE_STATE[name][1]
