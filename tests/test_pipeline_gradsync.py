"""Gradients and metrics across processes: the embedding-gradient modes, the all-reduce done by
hand (the CUDA-graph step's, run here without graphs), and evaluation metrics over two Gloo
processes, each against one process on the same global batch / the same predictions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from models import Ranker, RankerConfig
from pipeline.batches import EpochBatchSampler
from pipeline.dist import gloo_worker
from pipeline.split_cache import load_split
from pipeline.errors import ConfigError
from pipeline.gradsync import EMBEDDING_GRADS, GradSync, allreduce_mean
from pipeline.metrics import ranking_metrics
from pipeline.module import RankerModule
from pipeline.optim import build_optimizer
from test_pipeline_data import tiny_data_dir

WORLD, BATCH, MAX_SEQ_LEN = 2, 24, 16
CFG = RankerConfig(attention="jagged", embed_dim=32, num_heads=2, num_layers=1, pool_heads=2, mlp_dims=[16])
SPEC = {"vocab_size": 20_000, "n_actions": 4, "n_dense": 4, "train_ctr": 0.2}


def _ranker(mode: str) -> Ranker:
    torch.manual_seed(7)  # the same weights in every process and mode
    return Ranker(CFG, vocab_size=SPEC["vocab_size"], n_actions=SPEC["n_actions"], n_dense=SPEC["n_dense"],
                  sparse_item_grad=mode != "dense").double()


def _loss(model: Ranker, batch: dict) -> torch.Tensor:
    keys = ("hist_item", "hist_action", "hist_age", "offsets", "max_seq_len", "cand_item", "dense")
    inputs = {k: batch[k].double() if k in ("hist_age", "dense") else batch[k] for k in keys}
    return F.binary_cross_entropy_with_logits(model(**inputs), batch["label"].double())


def _grads(model: Ranker) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone() for n, p in model.named_parameters()}


def _batches(data_dir: str, rank: int, world: int) -> list[dict]:
    """The first two training batches of `rank` (world > 1: its shares of the global batches)."""
    split = load_split(data_dir, "train", SPEC["n_dense"], cache=False)
    sampler = EpochBatchSampler(split.num_rows, BATCH * WORLD // world, shuffle=True, drop_last=True, seed=3,
                                lengths=split.lengths(MAX_SEQ_LEN), rank=rank, world_size=world)
    return [split.gather(idx, MAX_SEQ_LEN) for idx in sampler.batches(0)[:2]]


def _worker(rank: int, store: str, data_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_worker(rank, WORLD, store):
        batch = _batches(data_dir, rank, WORLD)[0]
        result = {"grads": {}, "sent": {}}
        for mode in EMBEDDING_GRADS:
            model = _ranker(mode)
            _loss(model, batch).backward()
            params = list(model.parameters())
            sync = GradSync(mode, model.embed.item.weight, params, manual_table=True, bucket_bytes=64 * 2**10)
            sync(all_grads=True)  # what a CUDA-graph step runs after its replay
            result["grads"][mode], result["sent"][mode] = _grads(model), sync.sent_bytes
        rng = np.random.default_rng(11)  # the same predictions in every process; each updates its part
        logits, labels = torch.tensor(rng.normal(size=301)), torch.tensor(rng.integers(0, 2, 301)).double()
        part = slice(0, 180) if rank == 0 else slice(180, 301)  # uneven shares, as the sampler may give
        metrics = ranking_metrics(SPEC["train_ctr"])
        for m in metrics.values():
            m.update(logits[part][:100], labels[part][:100])
            m.update(logits[part][100:], labels[part][100:])
        result["metrics"] = {k: float(m.compute()) for k, m in metrics.items()}
        torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    store = str(out / "rendezvous")  # not a TCP port: another test's processes could take it first
    mp.start_processes(_worker, args=(store, str(tiny), str(out)), nprocs=WORLD, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
def test_every_mode_averages_to_the_one_process_gradient_of_the_global_batch(tiny, two_ranks):
    model = _ranker("dense")
    _loss(model, _batches(str(tiny), 0, 1)[0]).backward()  # one process, the whole global batch
    want = _grads(model)
    for case in EMBEDDING_GRADS:
        for rank, result in enumerate(two_ranks):
            got = result["grads"][case]
            for name, g in want.items():
                torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12, msg=f"{case} rank {rank} {name}")
    sent = two_ranks[0]["sent"]
    assert sent["dense"] == sent["densify"] and 0 < sent["sparse"] < sent["dense"]


@pytest.mark.slow
def test_metrics_over_both_ranks_are_the_one_process_metrics(two_ranks):
    rng = np.random.default_rng(11)
    logits, labels = torch.tensor(rng.normal(size=301)), torch.tensor(rng.integers(0, 2, 301)).double()
    metrics = ranking_metrics(SPEC["train_ctr"])
    for m in metrics.values():
        m.update(logits, labels)
    want = {k: float(m.compute()) for k, m in metrics.items()}
    for result in two_ranks:
        assert result["metrics"] == pytest.approx(want, rel=1e-12), json.dumps(result["metrics"])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise", "lazyadam"])
@pytest.mark.slow
def test_the_modes_train_the_same_weights_in_one_process(tiny, optimizer):
    batches = _batches(str(tiny), 0, 1)
    weights = {}
    for mode in EMBEDDING_GRADS:
        model = _ranker(mode)
        table = model.embed.item.weight
        opt = build_optimizer(optimizer, list(model.parameters()), table, lr=0.05, weight_decay=0.01,
                              betas=(0.9, 0.98), fused=None)
        sync = GradSync(mode, table, list(model.parameters()), manual_table=False)
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            _loss(model, batch).backward()
            sync(all_grads=False)
            assert table.grad.is_sparse == (mode == "sparse")
            opt.step()
        weights[mode] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for mode in ("sparse", "densify"):
        for name, w in weights["dense"].items():
            torch.testing.assert_close(weights[mode][name], w, rtol=1e-10, atol=1e-12, msg=f"{mode} {name}")


@pytest.mark.parametrize("kwargs, message", [
    ({"embedding_grad": "sparse"}, "needs model.optimizer sgd, adagrad, rowwise or lazyadam"),
    ({"optimizer": "lamb"}, "model.optimizer must be one of"),
    ({"table_lr": 0.01}, "model.table_lr must be > 0 and set only with a model.optimizer other than adamw"),
    ({"table_lr": 0.0, "optimizer": "rowwise"}, "got 0.0 with rowwise"),
])
def test_gradient_settings_that_cannot_work_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RankerModule(RankerConfig(), data_spec=SPEC, **kwargs)


@pytest.mark.parametrize("grad", ["sparse", "densify"])
def test_a_sparse_table_gradient_takes_cuda_graphs(grad):
    """Each bucket replays one size of sparse gradient (its padded ids): tests/test_pipeline_graphs.py."""
    module = RankerModule(RankerConfig(), data_spec=SPEC, embedding_grad=grad, optimizer="rowwise", cuda_graphs=True)
    assert module.cuda_graphs and module.model.embed.item.sparse


def test_the_item_table_is_left_to_gradsync_only_when_it_must_be():
    ignored = {m: RankerModule(RankerConfig(), data_spec=SPEC, embedding_grad=m, optimizer="sgd")
               ._ddp_params_and_buffers_to_ignore for m in EMBEDDING_GRADS}
    buffers = {"train_loss_epoch", "_bad_step", "model.embed.age_edges"}  # never broadcast by DDP
    assert set(ignored["dense"]) == buffers
    assert set(ignored["sparse"]) == set(ignored["densify"]) == buffers | {"model.embed.item.weight"}
    graphs = RankerModule(RankerConfig(), data_spec=SPEC, cuda_graphs=True)._ddp_params_and_buffers_to_ignore
    assert "model.embed.item.weight" in graphs


def _all_reduce_then(rank: int, store: str, fail: bool) -> None:
    with gloo_worker(rank, WORLD, store):
        t = torch.full((1000,), float(rank))
        allreduce_mean([t], WORLD)
        if fail and rank == 1:
            raise RuntimeError(f"rank 1 saw {t[0].item()}")


@pytest.mark.slow
def test_a_gloo_worker_exits_zero_on_success_and_reports_its_error(tmp_path):
    mp.start_processes(_all_reduce_then, args=(str(tmp_path / "ok"), False), nprocs=WORLD, start_method="spawn")
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 saw 0.5"):
        mp.start_processes(_all_reduce_then, args=(str(tmp_path / "fail"), True), nprocs=WORLD, start_method="spawn")


@pytest.mark.slow
def test_the_bench_measures_the_bytes_it_predicts(tmp_path):
    from experiments.ddp_bench import main as bench_main

    bench_main(["--worlds", "2", "--presets", "tiny", "--fractions", "0.05", "1.0", "--steps", "1", "--warmup", "0",
                "--out", str(tmp_path)])
    out = tmp_path / "ddp" / "cpu"  # <results root>/ddp/<device>/
    rows = json.loads((out / "ddp-bench.json").read_text())
    assert {(r["kind"], r["mode"]) for r in rows} == {(k, m) for k in ("preset", "sweep") for m in EMBEDDING_GRADS}
    for r in rows:  # Gloo's TCP sends are the ring algorithms' bytes
        assert r["sent_measured"] == pytest.approx(r["sent_predicted"], rel=0.02), r
    text = (out / "ddp-bench.md").read_text()
    assert "| 2 | 0.94 |" in text and (out / "ddp-bench-crossover.png").stat().st_size > 0


class _CaptureOOMOnRank0:
    """GraphedTrainStep's stand-in: rank 0 runs out of memory capturing, the others capture."""

    def __init__(self, *args, **kwargs):
        pass

    def capture(self) -> None:
        if torch.distributed.get_rank() == 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _prepare_graphs(rank: int, store: str, out: str) -> None:
    from types import SimpleNamespace

    import pipeline.module

    pipeline.module.GraphedTrainStep = _CaptureOOMOnRank0
    with gloo_worker(rank, WORLD, store):
        module = RankerModule(RankerConfig(), data_spec=SPEC, cuda_graphs=True)
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(batch_size=4, max_seq_len=8),
                                          precision="32-true", loggers=[])
        module._prepare_step(np.array([5, 7]), [256])
        Path(out, f"rank{rank}").write_text("eager" if module._graphs is None else "graphs")


@pytest.mark.slow
def test_one_process_that_cannot_capture_its_graphs_takes_every_process_to_eager_steps(tmp_path):
    """A replayed step and an eager one make other collectives: mixed, the processes would hang."""
    mp.start_processes(_prepare_graphs, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    assert [Path(tmp_path, f"rank{r}").read_text() for r in range(WORLD)] == ["eager"] * WORLD
