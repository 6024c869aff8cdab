"""The row-sharded item table over Gloo processes against the replicated one: the same rows, the
gradient DDP's reducer would give, the bytes of both lookups, the whole table gathered back; with
one table over every process and with tables replicated over groups of processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from models import RankerConfig
from pipeline.dist import gloo_worker
from pipeline.errors import ConfigError
from pipeline.module import RankerModule
import pipeline.table
from test_pipeline_gradsync import SPEC
from pipeline.table import GraphedLookup, ShardedEmbedding, add_rows, sent_bytes_fixed, shard_groups, shard_rows

V, D = 37, 5  # 37 rows: no world size here divides them


def _inputs(rank: int) -> list[torch.Tensor]:
    """A step's lookups of `rank`: a history [T] (int32, repeated ids), candidates [B], and on
    rank 1 an empty history; the same tensors in every process that asks."""
    g = torch.Generator().manual_seed(100 + rank)
    hist = torch.randint(0, V, (0 if rank == 1 else 23 + 5 * rank,), generator=g, dtype=torch.int32)
    cand = torch.randint(0, V, (4, 3), generator=g)
    return [hist, cand]


def _upstream(rank: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    return [torch.randn(*s, D, generator=g, dtype=torch.float64) for s in shapes]


def _worker(rank: int, world: int, shards: int, store: str) -> None:
    torch.set_num_threads(1)
    with gloo_worker(rank, world, store):
        mine, s = shard_groups(world, shards)[0][rank // shards], rank % shards  # this table's ranks, its shard
        full = torch.randn(V, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        table = ShardedEmbedding.over(full, shards)
        assert (table.rank, table.world, table.replicas) == (s, shards, world // shards)
        assert table.weight.shape == (shard_rows(V, s, shards), D)
        ids = _inputs(rank)
        outs = [table(i) for i in ids]
        for i, out in zip(ids, outs):
            assert out.shape == (*i.shape, D) and torch.equal(out, full[i.long()])
        loss = sum((o * u).sum() for o, u in zip(outs, _upstream(rank, [i.shape for i in ids])))
        loss.backward()
        lookup_bytes = table.sent_bytes
        table.sync_replicas()
        want = torch.zeros(V, D, dtype=torch.float64)  # the replicated table's gradient, averaged by DDP
        for r in range(world):
            for i, u in zip(_inputs(r), _upstream(r, [i.shape for i in _inputs(r)])):
                want.index_add_(0, i.reshape(-1).long(), u.reshape(-1, D))
        want /= world
        torch.testing.assert_close(table.weight.grad, want[s::shards], rtol=1e-12, atol=1e-12)
        # bytes: distinct ids to the other owners, the rows asked of this shard, the gradients back
        distinct = [[torch.unique(x.reshape(-1).long()) for x in _inputs(r)] for r in range(world)]
        ids_out = sum(int((u % shards != s).sum()) for u in distinct[rank])
        rows_in = sum(int((u % shards == s).sum()) for r in mine if r != rank for u in distinct[r])
        assert lookup_bytes == ids_out * 8 + (rows_in + ids_out) * D * 8
        t_max = [max(_inputs(r)[k].numel() for r in mine) for k in range(2)]
        assert table.gather_bytes == sum(sent_bytes_fixed(t, shards, D * 8) for t in t_max) and table.lookups == 2
        # one exchange for both lookups of those very tensors: the same rows and gradient
        table.weight.grad = None
        table.prefetch(*ids)
        outs = [table(i) for i in ids]
        assert table.lookups == 3 and all(torch.equal(o, full[i.long()]) for i, o in zip(ids, outs))
        sum((o * u).sum() for o, u in zip(outs, _upstream(rank, [i.shape for i in ids]))).backward()
        table.sync_replicas()
        torch.testing.assert_close(table.weight.grad, want[s::shards], rtol=1e-12, atol=1e-12)
        # alltoall_fixed (no host sync) at the most distinct ids any process has of one owner (an id's
        # repeats share a slot): the same rows and gradient, its bytes; the same around a captured step
        # (rows fetched into a buffer, the buffer's gradient sent back), with a dense and a sparse gradient
        slots = max(int(torch.bincount(torch.cat([i.reshape(-1).long() for i in _inputs(r)]).unique() % shards).max())
                    for r in mine)
        assert slots < max(int(torch.bincount(torch.cat([i.reshape(-1).long() for i in _inputs(r)]) % shards).max())
                           for r in mine)  # fewer than all ids: the inputs repeat ids
        table.weight.grad, sent = None, table.sent_bytes
        table.prefetch(*ids, slots=slots)
        outs = [table(i) for i in ids]
        assert all(torch.equal(o, full[i.long()]) for i, o in zip(ids, outs))
        sum((o * u).sum() for o, u in zip(outs, _upstream(rank, [i.shape for i in ids]))).backward()
        assert table.sent_bytes - sent == sent_bytes_fixed(slots, shards, D * 8)
        table.sync_replicas()
        torch.testing.assert_close(table.weight.grad, want[s::shards], rtol=1e-12, atol=1e-12)
        lookup, n = GraphedLookup(table, slots), sum(i.numel() for i in ids)
        for sparse in (False, True):
            table.weight.grad, table.sparse_grad, sent = None, sparse, table.sent_bytes
            send, slot = lookup.plan(ids)  # in a graph of its own on a GPU
            lookup.fetch(send, n)
            table.use_rows(*ids, rows=lookup.got[slot])  # in the step's graph
            outs = [table(i) for i in ids]
            assert all(torch.equal(o, full[i.long()]) for i, o in zip(ids, outs))
            loss = sum((o * u).sum() for o, u in zip(outs, _upstream(rank, [i.shape for i in ids])))
            lookup.send_back(torch.autograd.grad(loss, [lookup.got])[0])
            assert table.weight.grad.is_sparse == sparse
            assert table.sent_bytes - sent == sent_bytes_fixed(slots, shards, D * 8)
            table.sync_replicas()  # with replicas, densified for their all-reduce
            torch.testing.assert_close(table.weight.grad.to_dense(), want[s::shards], rtol=1e-12, atol=1e-12)
        # a bucket's padding (entries past each tensor's limit, a device scalar or an int) is neither looked up nor sent
        table.sparse_grad = False
        send, slot = lookup.plan(ids, limits=(torch.tensor(ids[0].numel() // 2), 5))
        lookup.fetch(send, n)
        rows = lookup.got.detach()[slot]
        real = torch.cat([ids[0][: ids[0].numel() // 2].long(), ids[1].reshape(-1)[:5]])
        kept = torch.cat([torch.arange(ids[0].numel()) < ids[0].numel() // 2, torch.arange(12) < 5])
        assert torch.equal(rows[kept], full[real]) and not rows[~kept].any()
        assert not (send[:-1] >= 0).logical_and(~torch.isin(send[:-1], real)).any()  # only real ids sent
        lookup.send_back(torch.zeros_like(lookup.got))
        assert table.lookups == 7 and not table.overflow
        # one slot short: an owner's largest distinct ids past it get zero rows (every repeat), and are counted
        table.prefetch(*ids, slots=slots - 1)
        outs = torch.cat([table(i).reshape(-1, D) for i in ids])
        flat = torch.cat([i.reshape(-1).long() for i in ids])
        lost = torch.cat([u[u % shards == o][slots - 1:] for u in [flat.unique()] for o in range(shards)])
        hit = torch.isin(flat, lost)
        assert int(table.overflow) == lost.numel() and torch.equal((outs == 0).all(1), hit)
        with torch.no_grad():
            assert torch.equal(outs[~hit], full[flat][~hit])
        # model.embedding_grad sparse through the all-to-all: the same gradient as a sparse tensor
        table.sparse_grad, table.weight.grad = True, None
        table.prefetch(*ids)
        sum((table(i) * u).sum() for i, u in zip(ids, _upstream(rank, [i.shape for i in ids]))).backward()
        assert table.weight.grad.is_sparse
        table.sync_replicas()
        torch.testing.assert_close(table.weight.grad.to_dense(), want[s::shards], rtol=1e-12, atol=1e-12)
        table.sparse_grad = False
        gathered = table.gather(table.weight.detach())
        assert (gathered is None) == (s != 0)
        if s == 0:
            assert torch.equal(gathered, full)
        per_row = table.gather(full[s::shards, 0].contiguous())  # a state of one number per row (rowwise)
        assert s != 0 or torch.equal(per_row, full[:, 0])


@pytest.mark.parametrize("world, shards", [(2, 2), (3, 3), (4, 2)])
@pytest.mark.slow
def test_the_sharded_table_looks_up_and_trains_like_the_replicated_one(world, shards, tmp_path):
    """Every process in one table's shards, and (4, 2) two tables of two shards each."""
    mp.start_processes(_worker, args=(world, shards, str(tmp_path / "store")), nprocs=world, start_method="spawn")


def test_table_shards_must_divide_the_world_size():
    assert shard_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="table_shards 3 does not divide the world size 4"):
        shard_groups(4, 3)


def test_one_process_holds_the_whole_table():
    full = torch.randn(V, D)
    table = ShardedEmbedding(full.clone(), V, 0, 1)
    ids = torch.tensor([3, 3, 36, 0])
    assert torch.equal(table(ids), full[ids]) and torch.equal(table.gather(table.weight), full)


def test_every_process_draws_its_rows_of_the_same_table(monkeypatch):
    """The item table's initial rows are the same whichever process draws which rows (blocks of 7
    rows here), and drawing them leaves the global RNG alone: a ranker whose table is left on the
    meta device (a shard's) has every other weight of the ranker that draws it whole."""
    import models.layers
    from models import Ranker, RankerConfig

    monkeypatch.setattr(models.layers, "_ITEM_DRAW_ROWS", 7)
    whole = models.layers.draw_item_rows(5, 30, D)
    for world in (1, 2, 3, 4):
        shards = [models.layers.draw_item_rows(5, 30, D, r, world) for r in range(world)]
        assert [s.shape[0] for s in shards] == [shard_rows(30, r, world) for r in range(world)]
        for r, s in enumerate(shards):
            assert torch.equal(s, whole[r::world])
    assert not torch.equal(whole, models.layers.draw_item_rows(6, 30, D))
    assert whole.std().item() == pytest.approx(models.layers.ITEM_INIT_SCALE * D**-0.5, rel=0.2)
    kw = dict(vocab_size=30, n_actions=3, n_dense=2)
    torch.manual_seed(1)
    drawn = Ranker(RankerConfig(embed_dim=8, num_layers=1, mlp_dims=[8]), **kw)
    torch.manual_seed(1)
    meta = Ranker(RankerConfig(embed_dim=8, num_layers=1, mlp_dims=[8]), item_device="meta", **kw)
    assert meta.embed.item.weight.is_meta
    assert torch.equal(drawn.embed.item.weight, models.layers.draw_item_rows(torch.initial_seed(), 30, 8))
    for (name, a), (_, b) in zip(drawn.state_dict().items(), meta.state_dict().items()):
        assert name == "embed.item.weight" or torch.equal(a, b), name


def _set_up(layout: str, device: torch.device, stage: str = "fit") -> RankerModule:
    from types import SimpleNamespace

    torch.manual_seed(3)
    module = RankerModule(RankerConfig(embed_dim=8, num_layers=1, mlp_dims=[8]), data_spec=SPEC, table_layout=layout)
    module._trainer = SimpleNamespace(datamodule=None, strategy=SimpleNamespace(root_device=device))
    module.setup(stage)
    return module


def test_a_cuda_run_draws_the_replicated_table_on_its_device_as_the_sharded_one(monkeypatch):
    """Both layouts draw the item table from the seed on the run's device (CUDA's generator draws
    other numbers than the CPU's): at one seed they start from one table. Training only: a test or
    a validation keeps the rows it has."""
    calls = []

    def draw(seed, vocab, dim, rank=0, world=1, device="cpu"):
        calls.append((seed, vocab, dim, rank, world, str(device)))
        return torch.full((shard_rows(vocab, rank, world), dim), 7.0)

    monkeypatch.setattr(pipeline.module, "draw_item_rows", draw)
    for stage in ("test", "validate"):
        assert not (_set_up("replicated", torch.device("cuda", 0), stage).model.embed.item.weight == 7).any()
    assert not (_set_up("replicated", torch.device("cpu")).model.embed.item.weight == 7).any() and not calls
    for layout in ("replicated", "sharded"):
        module = _set_up(layout, torch.device("cuda", 0))
        assert calls.pop() == (module.model.embed.item_seed, SPEC["vocab_size"], 8, 0, 1, "cuda:0")
        assert (module.model.embed.item.weight == 7).all()


@pytest.mark.gpu
def test_on_cuda_the_replicated_and_the_sharded_table_start_alike():
    cuda = torch.device("cuda", torch.cuda.current_device())
    replicated, sharded = _set_up("replicated", cuda), _set_up("sharded", cuda)
    assert torch.equal(replicated.model.embed.item.weight.cpu(), sharded.model.embed.item.weight.cpu())
    assert not torch.equal(replicated.model.embed.item.weight.cpu(), _set_up("replicated", torch.device("cpu"))
                           .model.embed.item.weight)


@pytest.mark.parametrize("elements", [1, D, 3 * D + 2, 10**6])
def test_rows_add_into_the_gradient_in_blocks_as_in_one(monkeypatch, elements):
    """A shard's gradient too large for one index_add_ on CUDA takes the rows block by block."""
    monkeypatch.setattr(pipeline.table, "_INDEXED_ELEMENTS", elements)
    index = torch.tensor([36, 0, 5, 5, 17, 36, 1])
    rows = torch.randn(index.numel(), D, dtype=torch.float64)
    want = torch.zeros(V, D, dtype=torch.float64).index_add_(0, index, rows)
    assert torch.equal(add_rows(torch.zeros(V, D, dtype=torch.float64), index, rows), want)


def test_cuda_graphs_take_the_sharded_table_only_with_the_fixed_capacity_exchange():
    sharded = {"table_layout": "sharded", "cuda_graphs": True}
    RankerModule(RankerConfig(), data_spec=SPEC, table_exchange="alltoall_fixed", **sharded)  # rows exchanged outside
    with pytest.raises(ConfigError, match="cuda_graphs only with table_exchange alltoall_fixed"):
        RankerModule(RankerConfig(), data_spec=SPEC, **sharded)
