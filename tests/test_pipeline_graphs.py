"""The CUDA-graph training step: bucket capacities, padding that changes no result, and (on a
GPU) graph replays that give the eager step's loss and gradients."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import ATTENTIONS, Ranker, RankerConfig
from pipeline.cuda_graphs import GraphedTrainStep, StaticBatch, loss_and_grads, model_inputs, token_capacities

VOCAB, N_ACTIONS, N_DENSE = 53, 3, 4


def _padding(counts, caps) -> int:
    return sum(min(c for c in caps if c >= t) - t for t in counts)


@pytest.mark.parametrize("buckets", [1, 2, 3, 5])
def test_capacities_cover_every_count_with_least_padding(buckets):
    rng = np.random.default_rng(buckets)
    counts = rng.integers(900, 4000, size=60)
    caps = token_capacities(counts, buckets, round_to=128)
    assert caps == sorted(caps) and len(caps) <= buckets and all(c % 128 == 0 for c in caps)
    assert max(caps) >= counts.max()
    rounded = sorted({int(-(-c // 128) * 128) for c in counts})
    best = min(_padding(counts, [*extra, rounded[-1]])  # brute force over the candidate capacities
               for r in range(buckets) for extra in itertools.combinations(rounded[:-1], r))
    assert _padding(counts, caps) == best
    assert token_capacities(counts, 1, round_to=128) == [rounded[-1]]


def test_capacities_reject_nothing_to_cover():
    with pytest.raises(ValueError):
        token_capacities(np.zeros(0), 2)


def _batch(lengths: list[int], max_seq_len: int) -> dict:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    T = int(offsets[-1])
    return {"hist_item": torch.randint(0, VOCAB, (T,), dtype=torch.int32),
            "hist_action": torch.randint(0, N_ACTIONS, (T,), dtype=torch.int8),
            "hist_age": torch.rand(T) * 300, "offsets": offsets, "max_seq_len": max_seq_len,
            "cand_item": torch.randint(0, VOCAB, (len(lengths),), dtype=torch.int32),
            "dense": torch.randn(len(lengths), N_DENSE), "label": torch.randint(0, 2, (len(lengths),)).float(),
            "n_tokens": T}


def _loss_fn(model):
    def loss(inputs, label):
        return F.binary_cross_entropy_with_logits(model(**inputs)[: label.shape[0]], label)
    return loss


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_padding_rows_and_the_extra_example_change_no_result(attention):
    """The bucket's padded batch gives the unpadded batch's loss and every gradient (float64),
    whatever the padding rows hold, including rows far past max_seq_len."""
    cfg = RankerConfig(attention=attention, embed_dim=32, num_heads=2, num_layers=2, pool_heads=2, mlp_dims=[16])
    model = Ranker(cfg, vocab_size=VOCAB, n_actions=N_ACTIONS, n_dense=N_DENSE).double()
    params = list(model.parameters())
    lengths, max_seq_len = [0, 5, 11, 1, 16, 3], 12  # one history longer than max_seq_len
    batch = _batch(lengths, max_seq_len)
    batch = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in batch.items()}
    loss_fn = _loss_fn(model)
    ref_loss, ref_grads = loss_and_grads(loss_fn, model_inputs(batch), batch["label"], params, None)
    static = StaticBatch(batch["n_tokens"] + 40, len(lengths), N_DENSE, max_seq_len, torch.device("cpu"))
    static.hist_age, static.dense, static.label = static.hist_age.double(), static.dense.double(), static.label.double()
    static.hist_item.random_(0, VOCAB)  # rows left by "earlier batches": any valid ids
    static.hist_age.uniform_(0, 1000)
    static.fill(batch)
    assert int(static.offsets[-1]) == static.capacity and static.inputs()["cand_item"].shape[0] == len(lengths) + 1
    loss, grads = loss_and_grads(loss_fn, static.inputs(), static.label, params, None)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for (name, _), g, ref in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12, msg=f"grad {name}")


def test_a_batch_that_does_not_fit_is_refused():
    static = StaticBatch(16, 3, N_DENSE, 8, torch.device("cpu"))
    assert not static.fits(_batch([9, 9, 0], 8)) and static.fits(_batch([8, 8, 0], 8))
    with pytest.raises(ValueError, match="does not fit"):
        static.fill(_batch([9, 9, 0], 8))
    with pytest.raises(ValueError, match="does not fit"):
        static.fill(_batch([1, 1], 8))  # another batch size


def test_token_counts_are_those_of_the_training_batches(tmp_path_factory):
    from pipeline.data import RankerData
    from test_pipeline_data import tiny_data_dir

    dm = RankerData(str(tiny_data_dir(tmp_path_factory)), batch_size=48, max_seq_len=20, num_workers=0)
    counts, by_owner = dm.train_token_counts([0, 1]), dm.train_owner_counts([0, 1], owners=3)
    loader = dm.train_dataloader()
    seen, owned = [], []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        for b in loader:  # alltoall_fixed's slots: a batch's distinct ids (histories as cut, candidates) per shard
            seen.append(b["n_tokens"])
            owned.append(torch.cat([b["hist_item"], b["cand_item"]]).long().unique().remainder(3).bincount(minlength=3).tolist())
    assert counts.tolist() == seen and by_owner.tolist() == owned
    assert dm.train_owner_counts([0, 1], owners=3, steps=5).tolist() == owned[:5]
    assert sum(map(sum, owned)) < sum(seen) + 48 * len(seen)  # ids repeat within a batch: fewer distinct


# ---- on the GPU: graph replays against the eager step ------------------------------------------


def _cuda_model(attention: str) -> Ranker:
    cfg = RankerConfig(attention=attention, embed_dim=64, num_heads=2, num_layers=2, pool_heads=2, mlp_dims=[32])
    return Ranker(cfg, vocab_size=VOCAB, n_actions=N_ACTIONS, n_dense=N_DENSE).cuda()


def _on_cuda(batch: dict) -> dict:
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_graph_replays_give_the_eager_loss_and_gradients(attention, amp, caplog):
    model = _cuda_model(attention)
    params = list(model.parameters())
    steps = GraphedTrainStep(_loss_fn(model), params, [300, 520], 6, N_DENSE, 64, torch.device("cuda"), amp)
    steps.capture()
    assert all(p.grad is g for p, g in zip(params, steps.grads))
    tol = dict(rtol=1e-5, atol=1e-6) if amp is None else dict(rtol=2e-2, atol=2e-3)
    # a batch in each bucket, twice (the buffers keep old rows), then one that fits no bucket
    for lengths in ([40, 0, 64, 70, 10, 33], [64, 64, 100, 64, 64, 64], [3, 7, 64, 1, 0, 9],
                    [100, 100, 100, 100, 100, 100]):
        batch = _on_cuda(_batch(lengths, 64))
        with caplog.at_level(logging.WARNING, logger="pipeline.cuda_graphs"):
            loss = steps(batch)
        got = [g.clone() for g in steps.grads]
        ref_loss, ref_grads = loss_and_grads(_loss_fn(model), model_inputs(batch), batch["label"], params, amp)
        torch.testing.assert_close(loss, ref_loss, **tol)
        for g, ref in zip(got, ref_grads):
            torch.testing.assert_close(g, ref, **tol)
    assert steps.replays == [2, 1] and steps.fallbacks == 1
    assert "fits no CUDA-graph bucket" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["jagged", "sdpa"])
def test_graph_replays_around_the_sharded_tables_exchange_give_the_eager_loss_and_gradients(attention, monkeypatch):
    """One process over NCCL: the lookup's plan graph, its eager exchange and the step's graph give
    the loss and gradients (the table's too) of the eager step with a plain lookup."""
    import socket

    import torch.distributed as dist

    from pipeline.table import GraphedLookup, ShardedEmbedding

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = _cuda_model(attention)
        table = model.embed.item = ShardedEmbedding(model.embed.item.weight.detach().clone(), VOCAB, 0, 1)

        def loss_fn(inputs, label):
            inputs = dict(inputs)
            table.use_rows(inputs["hist_item"], inputs["cand_item"], rows=inputs.pop("item_rows"))
            return F.binary_cross_entropy_with_logits(model(**inputs)[: label.shape[0]], label)

        params = [p for p in model.parameters() if p is not table.weight]
        lookup = GraphedLookup(table, slots=VOCAB)
        steps = GraphedTrainStep(loss_fn, params, [300, 520], 6, N_DENSE, 64, torch.device("cuda"), None, lookup)
        steps.capture()
        for lengths in ([40, 0, 64, 70, 10, 33], [64, 64, 100, 64, 64, 64], [3, 7, 64, 1, 0, 9]):
            batch = _on_cuda(_batch(lengths, 64))
            loss = steps(batch)
            got = [g.clone() for g in steps.grads] + [table.weight.grad.clone()]
            ref_loss, ref_grads = loss_and_grads(_loss_fn(model), model_inputs(batch), batch["label"],
                                                 params + [table.weight], None)  # world 1: a plain lookup
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            for g, ref in zip(got, ref_grads):
                torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
        assert steps.replays == [2, 1] and int(table.overflow) == 0 and table.lookups >= 3
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["jagged", "sdpa"])
def test_graph_replays_give_the_eager_sparse_table_gradient_of_each_bucket(attention):
    """model.embedding_grad sparse: the item table's gradient has the size of its bucket's ids, a
    buffer of each graph's own (bound after its replay); the dense ones are shared."""
    cfg = RankerConfig(attention=attention, embed_dim=64, num_heads=2, num_layers=2, pool_heads=2, mlp_dims=[32])
    model = Ranker(cfg, vocab_size=VOCAB, n_actions=N_ACTIONS, n_dense=N_DENSE, sparse_item_grad=True).cuda()
    params, table = list(model.parameters()), model.embed.item.weight
    steps = GraphedTrainStep(_loss_fn(model), params, [300, 520], 6, N_DENSE, 64, torch.device("cuda"), None)
    steps.capture()
    for lengths in ([40, 0, 64, 70, 10, 33], [64, 64, 100, 64, 64, 64], [3, 7, 64, 1, 0, 9],
                    [100, 100, 100, 100, 100, 100]):  # each bucket, the first again, then one that fits none
        batch = _on_cuda(_batch(lengths, 64))
        loss = steps(batch)
        assert table.grad.is_sparse and all(not p.grad.is_sparse for p in params if p is not table)
        got = [p.grad.to_dense().clone() for p in params]
        ref_loss, ref_grads = loss_and_grads(_loss_fn(model), model_inputs(batch), batch["label"], params, None)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for g, ref in zip(got, ref_grads):
            torch.testing.assert_close(g, ref.to_dense(), rtol=1e-5, atol=1e-6)
    assert steps.replays == [2, 1] and steps.fallbacks == 1


def test_a_steps_gradients_go_into_the_shared_buffers_and_a_sparse_one_stays_its_own():
    """GraphedTrainStep._take (CPU): the dense gradients copied into the .grad buffers (none to copy
    for the buffers themselves), the sparse ones (a bucket's size) returned by parameter index."""
    steps = GraphedTrainStep.__new__(GraphedTrainStep)
    dense, table = torch.zeros(3), torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.ones(2, 4), (5, 4))
    steps.grads = (dense, table)
    assert steps._take(steps.grads) == {1: table}  # the largest bucket's: no copy
    other = torch.sparse_coo_tensor(torch.tensor([[0, 2, 4]]), torch.ones(3, 4), (5, 4))
    assert steps._take((torch.arange(3.0), other)) == {1: other}
    assert torch.equal(dense, torch.arange(3.0)) and steps.grads[1] is table
