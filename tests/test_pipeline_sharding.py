"""The distributed batch sampler: every row once per epoch, the same global batches as one
process with a world-size-times larger batch, balanced tokens, resumable; and its report."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from experiments.balance import main as balance_main
from pipeline.batches import EpochBatchSampler, balance_ranks
from test_pipeline_data import tiny_data_dir


def _lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Power-law history lengths truncated at 64, with empty histories, like the data's."""
    return np.minimum((rng.pareto(1.2, n) * 8).astype(np.int64), 64)


def _ranks(num_rows, batch_size, world, lengths, **kw) -> list[EpochBatchSampler]:
    return [EpochBatchSampler(num_rows, batch_size, lengths=lengths, rank=r, world_size=world, **kw)
            for r in range(world)]


@pytest.mark.parametrize("seed, world, shuffle", list(itertools.product(range(4), (1, 2, 3, 4, 8), (True, False))))
def test_every_row_once_per_epoch_in_the_global_batches_of_one_process(seed, world, shuffle):
    rng = np.random.default_rng([seed, world])
    batch_size = int(rng.integers(1, 40))
    num_rows = int(rng.integers(world * batch_size, 12 * world * batch_size + 7))
    lengths = _lengths(rng, num_rows)
    drop_last = shuffle  # training drops the partial global batch, evaluation keeps it
    ranks = _ranks(num_rows, batch_size, world, lengths, shuffle=shuffle, drop_last=drop_last, seed=seed)
    one = EpochBatchSampler(num_rows, world * batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed)
    for epoch in (0, 5):
        per_rank = [s.batches(epoch) for s in ranks]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(ranks[0]) == len(one)
        for g, want in enumerate(one.batches(epoch)):  # the global batch is the one-process batch
            parts = [b[g] for b in per_rank]
            assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(want))
            if len(want) == world * batch_size:
                assert all(len(p) == batch_size for p in parts)
            else:  # the last, partial batch of an evaluation split
                assert all(len(p) <= -(-len(want) // world) for p in parts)
            loads = [int(lengths[p].sum()) for p in parts]
            assert max(loads) - min(loads) <= max(lengths[want].max(), 0), (loads, lengths[want])
        rows = np.concatenate([idx for b in per_rank for idx in b])
        assert len(rows) == len(np.unique(rows))  # no row twice, none padded in
        expected = num_rows if not drop_last else len(one) * world * batch_size
        assert len(rows) == expected
    if world == 1:  # one process: exactly the batches it always had (sorted slices of the permutation)
        order = np.random.default_rng([seed, 3]).permutation(num_rows) if shuffle else np.arange(num_rows)
        before = [order[b * batch_size:(b + 1) * batch_size] for b in range(len(one))]
        before = [np.sort(idx) if shuffle else idx for idx in before]
        assert [b.tolist() for b in ranks[0].batches(3)] == [b.tolist() for b in before]


def test_the_order_is_a_function_of_seed_epoch_rank_and_world_size():
    lengths = _lengths(np.random.default_rng(0), 1000)

    def batches(seed, epoch, rank, world):
        s = EpochBatchSampler(1000, 25, shuffle=True, drop_last=True, seed=seed, lengths=lengths, rank=rank,
                              world_size=world)
        s.set_epoch(epoch)
        return [b.tolist() for b in s]

    first = batches(0, 0, 1, 2)
    assert first == batches(0, 0, 1, 2)
    assert all(first != batches(*other) for other in [(1, 0, 1, 2), (0, 1, 1, 2), (0, 0, 0, 2), (0, 0, 1, 4)])


def test_a_resumed_rank_skips_the_batches_it_trained():
    lengths = _lengths(np.random.default_rng(1), 700)
    for rank in range(3):
        s = EpochBatchSampler(700, 20, shuffle=True, drop_last=True, seed=2, lengths=lengths, rank=rank, world_size=3)
        s.set_epoch(4)
        full = [b.tolist() for b in s]
        s.skip_next(5)
        assert [b.tolist() for b in s] == full[5:]
        assert [b.tolist() for b in s] == full  # the skip is for one epoch start only


def test_token_counts_are_those_of_the_yielded_batches():
    lengths = _lengths(np.random.default_rng(2), 500)
    s = EpochBatchSampler(500, 16, shuffle=True, drop_last=True, seed=0, lengths=lengths, rank=1, world_size=2)
    assert s.batch_sums(lengths, 2).tolist() == [int(lengths[b].sum()) for b in s.batches(2)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balance_on_long_tailed_lengths_is_within_a_token_or_two(world):
    rng = np.random.default_rng(world)
    lengths = np.minimum((rng.pareto(1.0, (50, world * 512)) * 90).astype(np.int64), 1024)  # [G, n]
    ranks = balance_ranks(lengths, world)
    loads = np.stack([np.where(ranks == r, lengths, 0).sum(axis=1) for r in range(world)], axis=1)  # [G, W]
    assert (np.stack([(ranks == r).sum(axis=1) for r in range(world)], axis=1) == 512).all()
    assert (loads.max(axis=1) - loads.min(axis=1)).max() <= 2
    assert np.array_equal(balance_ranks(lengths, world), ranks)  # deterministic


def test_a_sharded_sampler_needs_the_lengths_and_a_valid_rank():
    with pytest.raises(ValueError, match="length of every row"):
        EpochBatchSampler(10, 2, shuffle=True, drop_last=True, world_size=2)
    with pytest.raises(ValueError, match="rank 2"):
        EpochBatchSampler(10, 2, shuffle=True, drop_last=True, lengths=np.ones(10, np.int64), rank=2, world_size=2)


def test_the_balance_report_on_tiny_data(tmp_path_factory, tmp_path, capsys):
    data = tiny_data_dir(tmp_path_factory)
    out = tmp_path / "balance.md"
    balance_main(["--data", str(data), "--batch-size", "32", "--max-seq-len", "32", "--world-sizes", "2", "4",
                  "--out", str(out)])
    text = out.read_text()
    assert text in capsys.readouterr().out  # printed too
    rows = [ln.split("|") for ln in text.splitlines() if ln.startswith("| 2 ") or ln.startswith("| 4 ")]
    assert [r[3].strip() for r in rows] == ["balanced", "by rows"] * 2
    for r in rows:
        if r[3].strip() == "balanced":
            assert 1.0 <= float(r[4]) <= 1.01
    assert "python -m experiments balance --data" in text
