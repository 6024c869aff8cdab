"""The launch-config cost model's CPU machinery: launch tables and `tuned()`, the launchers under a table, the
config sweep in the interpreter (Parquet, resume), and the cost model on a synthetic dataset
whose best config per shape is known. Nothing here times anything that is asserted."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch

from kernels import _launch_configs as lc
from kernels import (S2Shards, jagged_dense_attention, jagged_dense_bmm, jagged_flash_attention, jagged_jagged_bmm,
                     jagged_softmax, offsets_from_lengths, padded_to_jagged)
from kernels._flash_attention_triton import _FWD_KW, _fwd_kw, fwd_config
from experiments.tuning import costmodel, sweep, table, warmup
from experiments.tuning import families as sweep_families
from kernels.launch_table import CONFIG_DIR, LaunchTable, table_path, write_table

F32 = "float32"


@pytest.fixture(autouse=True)
def _no_table(monkeypatch):
    """Every test starts (and ends) with no table, whatever the machine has."""
    monkeypatch.setenv("JFA_LAUNCH_TABLE", "off")
    lc.use_table("env")
    yield
    lc.use_table("env")


def _entry(family, config, **shape):
    return {"family": family, "shape": shape, "config": config}


# ---- the table ----------------------------------------------------------------------------


def test_lookup_exact_nearest_none(tmp_path):
    base = dict(H=2, D=64, dtype="bfloat16", causal=0)
    entries = [_entry("flash_fwd", {"BLOCK_M": 32}, B=1024, N=1024, L=256, **base),
               _entry("flash_fwd", {"BLOCK_M": 128}, B=64, N=8192, L=4000, **base),
               _entry("flash_fwd", {"BLOCK_M": 16}, B=1024, N=1024, L=256, **dict(base, D=128))]
    path = write_table(tmp_path / "t.json", entries, {"gpu": "test"})
    t = LaunchTable.load(path)
    assert len(t) == 3
    exact = dict(B=1024, N=1024, L=256, **base)
    assert t.lookup("flash_fwd", exact)["config"] == {"BLOCK_M": 32}
    near_long = dict(B=128, N=4096, L=2048, **base)  # log-closer to the second entry
    assert t.lookup("flash_fwd", near_long)["config"] == {"BLOCK_M": 128}
    near_short = dict(B=2048, N=512, L=200, **base)
    assert t.lookup("flash_fwd", near_short)["config"] == {"BLOCK_M": 32}
    assert t.lookup("flash_fwd", dict(exact, D=96)) is None  # D must match
    assert t.lookup("flash_fwd", dict(exact, dtype="float16")) is None  # so must the dtype
    assert t.lookup("flash_bwd", exact) is None  # no entry of the family


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_committed_table_is_one_the_launchers_can_use(path):
    """A table in kernels/configs/ is read by the launchers of its GPU: it loads, names the GPU its
    file is named for, and every entry sets exactly its family's tunable keys to launchable values."""
    from experiments.tuning.families import FLAGS, TUNABLE
    from kernels.launch_table import device_slug

    t = LaunchTable.load(path)
    assert device_slug(t.meta["gpu"]) == path.stem and len(t) > 0
    for e in t.exact.values():
        assert e["source"] in ("measured", "predicted", "hand"), e
        assert set(e["config"]) == set(TUNABLE[e["family"]]), e
        for k, v in e["config"].items():
            if k in FLAGS:
                assert v in (0, 1), (k, v)
            elif k == "num_stages":
                assert 1 <= v <= 4, (k, v)
            else:  # tiles, warps, splits
                assert v >= 1 and v & (v - 1) == 0, (k, v)
        assert set(e["shape"]) == set(lc.FAMILIES[e["family"]]), e


def test_table_path_and_bad_files(tmp_path, monkeypatch):
    assert table_path("NVIDIA H100 80GB HBM3") is None  # JFA_LAUNCH_TABLE=off (fixture)
    monkeypatch.delenv("JFA_LAUNCH_TABLE")
    assert table_path(None) is None and table_path("CPU (x86_64)") is None
    monkeypatch.setenv("JFA_LAUNCH_TABLE", str(tmp_path / "x.json"))
    assert table_path("anything") == tmp_path / "x.json"
    lc.use_table("env")
    with pytest.raises(ValueError, match="does not exist"):
        lc.tuned("flash_fwd", (1, 1, 1, 1, 16, F32, 0), {"BLOCK_M": 16})
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="not a jfa-launch-table"):
        LaunchTable.load(tmp_path / "bad.json")


def test_tuned_without_table_is_the_hand_rule_itself():
    default = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    assert not lc.active()
    assert lc.tuned("flash_fwd", (1024, 1024, 256, 2, 64, torch.bfloat16, 0), default) is default
    # the launcher's cached launch dict is exactly the hand rule's, keyed as before
    kw = _fwd_kw(16, torch.bfloat16, False, True, ())
    assert {k: kw[k] for k in fwd_config(16, torch.bfloat16, True)} == fwd_config(16, torch.bfloat16, True)
    assert (16, torch.bfloat16, False, True, (), False) in _FWD_KW  # no window


def test_tuned_with_table_replaces_known_keys_only(tmp_path, monkeypatch):
    entries = [_entry("flash_fwd", {"BLOCK_M": 32, "BLOCK_N": 16, "bogus": 1},
                      B=1024, N=1024, L=256, H=2, D=64, dtype="bfloat16", causal=0)]
    path = write_table(tmp_path / "t.json", entries, {"gpu": "test"})
    monkeypatch.setenv("JFA_LAUNCH_TABLE", str(path))
    lc.use_table("env")
    default = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    got = lc.tuned("flash_fwd", (1024, 1024, 256, 2, 64, torch.bfloat16, 0), default)
    assert got == {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 3}
    assert default["BLOCK_M"] == 64  # the hand-rule dict is never mutated
    assert lc.tuned("flash_fwd", (512, 2048, 300, 2, 64, torch.bfloat16, 0), default)["BLOCK_M"] == 32  # nearest
    assert lc.tuned("flash_fwd", (1024, 1024, 256, 2, 128, torch.bfloat16, 0), default) is default  # other D
    with lc.forced("flash_fwd", {"BLOCK_M": 128}):
        assert lc.tuned("flash_fwd", (1, 1, 1, 1, 64, torch.bfloat16, 0), default)["BLOCK_M"] == 128
    with pytest.raises(ValueError, match="unknown kernel family"):
        with lc.forced("nope", {}):
            pass


def test_a_hand_entry_means_the_hand_rule_of_the_shape_at_hand(tmp_path, monkeypatch):
    """An entry of source 'hand' gives every shape it is looked up for (exactly or as the nearest)
    that shape's own hand rule, not the config the rule gave the entry's shape."""
    shape = dict(B=256, N=4096, L=416, H=4, D=128, Tq=16, dtype="bfloat16")
    entries = [dict(_entry("dense_fwd", {"BLOCK_M": 16, "BLOCK_N": 64}, **shape), source="hand"),
               dict(_entry("dense_bwd", {"BLOCK_M": 16, "BLOCK_N": 64}, **shape), source="predicted")]
    monkeypatch.setenv("JFA_LAUNCH_TABLE", str(write_table(tmp_path / "t.json", entries, {"gpu": "test"})))
    lc.use_table("env")
    rule_tq32 = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    near = (512, 4096, 512, 1, 128, 32, torch.bfloat16)  # no exact entry: the Tq 16 one is the nearest
    assert lc.tuned("dense_fwd", near, rule_tq32) is rule_tq32
    assert lc.tuned("dense_fwd", (256, 4096, 416, 4, 128, 16, torch.bfloat16), rule_tq32) is rule_tq32
    assert lc.tuned("dense_bwd", near, rule_tq32)["BLOCK_M"] == 16  # a predicted pick is laid over the rule


# ---- the launchers under a table that picks other (valid) configs ---------------------------

OTHER = {  # every family: a config unlike the interpreter's hand rule
    "flash_fwd": {"BLOCK_M": 32, "BLOCK_N": 16},
    "flash_bwd": {"BLOCK_N1": 16, "BLOCK_M1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16},
    "dense_fwd": {"BLOCK_M": 16, "BLOCK_N": 32},
    "dense_bwd": {"BLOCK_M": 16, "BLOCK_N": 32, "M_KV": 16, "N_KV": 32, "SPLIT_DQ": 1},
    "softmax_fwd": {"BLOCK_N": 32, "SMALL_N": 16, "BLOCK_H": 16},
    "softmax_bwd": {"BLOCK_N": 16, "SMALL_N": 16, "BLOCK_H": 16},
    "jagged_dense_bmm": {"BLOCK_T": 16, "BLOCK_M": 16, "BLOCK_K": 16, "num_stages": 1},
    "jagged_jagged_bmm": {"BLOCK_T": 16, "BLOCK_M": 16, "BLOCK_K": 16, "num_stages": 1},
    "padded_to_jagged": {"BLOCK_N": 16},
    "s2_fwd": {"BLOCK_M": 32, "BLOCK_N": 16},
    "s2_bwd": {"BLOCK_M": 32, "M_KV": 16, "N_KV": 32},
}


def _table_for_all(tmp_path, D):
    shapes = {"flash_fwd": dict(H=2, D=D, causal=0), "flash_bwd": dict(H=2, D=D, causal=0),
              "dense_fwd": dict(H=2, D=D, Tq=3), "dense_bwd": dict(H=2, D=D, Tq=3),
              "softmax_fwd": dict(H=3), "softmax_bwd": dict(H=3),
              "jagged_dense_bmm": dict(K=D, M=D), "jagged_jagged_bmm": dict(K=D, M=D),
              "padded_to_jagged": dict(D=D), "s2_fwd": dict(H=2, D=D, causal=0), "s2_bwd": dict(H=2, D=D, causal=0)}
    entries = [_entry(f, OTHER[f], B=4, N=32, L=16, dtype=F32, **shapes[f]) for f in OTHER]
    return write_table(tmp_path / "all.json", entries, {"gpu": "test"})


def _close(a, b, tol=1e-4):
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), float((a.float() - b.float()).abs().max())


def test_launchers_correct_with_a_table_of_other_configs(tmp_path, monkeypatch):
    D, N = 16, 40
    lengths = torch.tensor([0, 37, 5, 17])  # 37 > 32 (one BLOCK), a 0 and short ones
    off = offsets_from_lengths(lengths)
    T = int(lengths.sum())
    monkeypatch.setenv("JFA_LAUNCH_TABLE", str(_table_for_all(tmp_path, D)))
    lc.use_table("env")
    assert lc.active()
    used: dict[str, list[dict]] = {}
    real_tuned = lc.tuned

    def spy(family, features, default):
        cfg = real_tuned(family, features, default)
        used.setdefault(family, []).append(cfg)
        return cfg

    monkeypatch.setattr(lc, "tuned", spy)

    def both(fn, *xs):  # (triton out, grads), (torch out, grads)
        res = []
        for backend in ("triton", "torch"):
            leaves = [x.detach().clone().requires_grad_(True) for x in xs]
            out = fn(*leaves, backend=backend)
            out.backward(torch.ones_like(out) if out.dim() < 2 else torch.randn_like(out, generator=g0()))
            res.append((out.detach(), [x.grad for x in leaves]))
        (o1, g1), (o2, g2) = res
        _close(o1, o2)
        for a, b in zip(g1, g2):
            _close(a, b)

    def g0():
        return torch.Generator().manual_seed(7)

    q, k, v = (torch.randn(T, 2, D) for _ in range(3))
    both(lambda q, k, v, backend: jagged_flash_attention(q, k, v, off, N, backend=backend), q, k, v)
    both(lambda q, k, v, backend: jagged_flash_attention(q, k, v, off, N, backend=backend,
                                                         shards=S2Shards(16, 1, 2)), q, k, v)
    qd = torch.randn(4, 3, 2, D)
    both(lambda q, k, v, backend: jagged_dense_attention(q, k, v, off, N, backend=backend), qd, k, v)
    x = torch.randn(T, 3)
    both(lambda x, backend: jagged_softmax(x, off, N, backend=backend), x)
    a, dense, c = torch.randn(T, D), torch.randn(4, D, D), torch.randn(T, D)
    both(lambda a, d, backend: jagged_dense_bmm(a, off, d, N, backend=backend), a, dense)
    both(lambda a, c, backend: jagged_jagged_bmm(a, c, off, N, backend=backend), a, c)
    padded = torch.randn(4, N, D)
    _close(padded_to_jagged(padded, off, backend="triton"), padded_to_jagged(padded, off, backend="torch"))
    for family, pick in OTHER.items():  # every launcher ran with the table's config
        assert any(all(cfg[k] == v for k, v in pick.items()) for cfg in used.get(family, [])), family


def test_no_table_is_bit_identical_to_the_hand_config():
    from kernels._flash_attention_triton import flash_attention_fwd

    lengths = torch.tensor([3, 29, 0, 11])
    off, T = offsets_from_lengths(lengths), int(lengths.sum())
    q, k, v = (torch.randn(T, 1, 16) for _ in range(3))
    plain = flash_attention_fwd(q, k, v, off, 32, False, 0.25)[0]
    with lc.forced("flash_fwd", fwd_config(16, torch.float32, True)):
        hand = flash_attention_fwd(q, k, v, off, 32, False, 0.25)[0]
    assert torch.equal(plain, hand)


# ---- the sweep ----------------------------------------------------------------------------


@pytest.mark.slow  # a sweep end to end (Triton interpreter)
def test_sweep_tiny_writes_parquet_and_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.parquet"
    argv = ["--grid", "tiny", "--device", "cpu", "--families", "flash_fwd,softmax_fwd", "--out", str(out),
            "--warmup-ms", "0", "--rep-ms", "1", "--commit", "abc123"]
    assert sweep.main(argv) == 0
    df = pl.read_parquet(out)
    from experiments.tuning.families import grid, space

    expected = sum(len(space(f, s, "tiny")) for f in ("flash_fwd", "softmax_fwd") for s in grid(f, "tiny"))
    assert df.height == expected >= 6
    assert set(df["status"]) == {"ok"}
    assert df["is_hand"].sum() == len(grid("flash_fwd", "tiny")) + len(grid("softmax_fwd", "tiny"))
    assert (df["ms"] > 0).all() and df["energy_j"].is_nan().all()  # no NVML on the CPU
    assert set(df["commit"]) == {"abc123"} and df["torch"][0] == torch.__version__ and df["gpu_slug"][0] == "cpu"
    assert (df["rel_err"] <= 1e-3).all()  # every config computed the hand config's output
    capsys.readouterr()
    assert sweep.main(argv) == 0
    assert "0 new rows" in capsys.readouterr().out
    assert pl.read_parquet(out).height == expected
    # resumed where the energy counter exists: the shapes timed without it get their energy readings
    monkeypatch.setattr(sweep, "EnergyMeter", _CountingMeter)
    assert sweep.main([*argv, "--energy-s", "0.001"]) == 0
    df = pl.read_parquet(out)
    assert df.height == expected and "0 new rows" in capsys.readouterr().out
    counted = df.filter(pl.col("energy_src") == "counter")
    assert counted.height >= len(grid("flash_fwd", "tiny")) + len(grid("softmax_fwd", "tiny"))  # >= 1 a shape
    assert (counted["energy_j"] == 0.5 / counted["energy_calls"]).all() and (counted["energy_window_s"] >= 0.001).all()
    # another GPU's rows are never resumed into this one's sweep
    pl.read_parquet(out).with_columns(gpu_slug=pl.lit("h200")).write_parquet(out)
    assert sweep.main(argv) == 2
    assert "holds rows timed on h200, not on this" in capsys.readouterr().err
    assert pl.read_parquet(out).height == expected  # the file untouched


@pytest.mark.slow  # spawns warm-up processes (torch imported in each)
def test_warm_up_workers_compile_what_the_timing_pass_then_times(tmp_path, capsys):
    """--compile-workers: spawned processes run each config once over its shapes before the timing
    pass; the rows are the same, and their compile_s is the worker's first call (the timing
    pass's own first call kept as cached_call_s). A spent budget leaves the rest to the timing pass."""
    out = tmp_path / "s.parquet"
    argv = ["--grid", "tiny", "--device", "cpu", "--families", "softmax_fwd,jagged_jagged_bmm", "--out", str(out),
            "--warmup-ms", "0", "--rep-ms", "1", "--commit", "abc123", "--compile-workers", "2"]
    assert sweep.main(argv) == 0
    from experiments.tuning.families import grid, space

    calls = sum(len(space(f, s, "tiny")) for f in ("softmax_fwd", "jagged_jagged_bmm") for s in grid(f, "tiny"))
    said = capsys.readouterr().out
    assert f"{calls} calls, 2 processes" in said and f"{calls} calls compiled and ran" in said
    df = pl.read_parquet(out)
    assert df.height == calls and set(df["status"]) == {"ok"} and (df["rel_err"] <= 1e-3).all()
    assert (df["compile_s"] > 0).all() and (df["cached_call_s"] > 0).all()
    # resumed with nothing left: no warm-up at all
    assert sweep.main(argv) == 0
    assert "warming" not in capsys.readouterr().out
    # a budget spent before any config compiled: every row is still timed, compiled by the timing pass
    out.unlink()
    assert sweep.main([*argv, "--compile-budget-s", "1e-6"]) == 0
    assert "warm-up budget spent" in capsys.readouterr().out
    df = pl.read_parquet(out)
    assert df.height == calls and set(df["status"]) == {"ok"}
    assert df["cached_call_s"].is_nan().sum() >= 1  # compiled while timing, where no worker got to it


def test_warm_up_counts_each_config_once_over_the_shapes_left():
    from experiments.tuning.sweep import config_id
    from experiments.tuning.warmup import warm_up_todo
    from experiments.tuning.families import grid, space

    order = [("softmax_fwd", s) for s in grid("softmax_fwd", "tiny")]
    first = order[0][1]
    done = {("softmax_fwd", first.id, config_id(c)) for c in space("softmax_fwd", first, "tiny")}
    todo = warm_up_todo(order, done, "tiny")["softmax_fwd"]
    assert sorted(todo) == sorted({config_id(c) for c in space("softmax_fwd", order[1][1], "tiny")})
    assert all(shapes == [order[1][1]] for _, shapes in todo.values())  # the timed shape left out


def test_graph_timing_needs_cuda(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sweep.parse_args(["--device", "cpu"]).timing == "call"
    with pytest.raises(SystemExit):
        sweep.parse_args(["--timing", "graph", "--device", "cpu"])
    assert "--timing graph replays CUDA graphs" in capsys.readouterr().err


def test_warm_up_worker_reports_each_calls_failure():
    """A warm-up call that fails comes back with its error (the warm-up counts and prints them) and
    does not stop the worker's other calls; a poisoned worker's calls are marked not run."""
    from experiments.tuning.families import grid, space

    shapes = grid("flash_fwd", "tiny")
    good = space("flash_fwd", shapes[0], "tiny")[0]
    bad = dict(good, BLOCK_M=24)  # not a power of two: Triton refuses it
    rows = [*warmup.warm_config(("flash_fwd", bad, shapes, "cpu", 0)),
            *warmup.warm_config(("flash_fwd", good, shapes, "cpu", 0))]
    assert [r[3] is None for r in rows] == [True, True, False, False]
    assert all("power of 2" in r[4] for r in rows[:2]) and rows[2][4] == rows[3][4] == ""


def test_sweep_rejects_a_negative_worker_count(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit):
        sweep.parse_args(["--compile-workers", "-1", "--device", "cpu"])
    assert "--compile-workers must be 0 or more" in capsys.readouterr().err


@pytest.mark.slow  # two sweeps end to end
def test_rows_of_other_kernel_code_are_set_aside_and_timed_again(tmp_path, capsys):
    """A kernel edited (or another torch/triton) since a sweep makes its timings stale: a resume
    times every config again and keeps the old rows in a .stale.parquet beside the sweep."""
    from experiments.bench.stamp import kernel_code

    out = tmp_path / "s.parquet"
    argv = ["--grid", "tiny", "--device", "cpu", "--families", "softmax_fwd", "--out", str(out),
            "--warmup-ms", "0", "--rep-ms", "1", "--commit", "abc123"]
    assert sweep.main(argv) == 0
    df = pl.read_parquet(out)
    assert set(df["kernel_code"]) == {kernel_code()} and len(kernel_code()) == 12
    n = df.height
    df.with_columns(kernel_code=pl.when(pl.col("shape_id") == df["shape_id"][0]).then(pl.lit("old"))
                    .otherwise(pl.col("kernel_code"))).write_parquet(out)
    stale_n = df.filter(pl.col("shape_id") == df["shape_id"][0]).height
    capsys.readouterr()
    assert sweep.main(argv) == 0
    said = capsys.readouterr().out
    assert f"{stale_n} of {n} rows were timed with other kernel code" in said and f"{stale_n} new rows" in said
    again = pl.read_parquet(out)
    assert again.height == n and set(again["kernel_code"]) == {kernel_code()}
    archived = pl.read_parquet(tmp_path / "s.stale.parquet")
    assert archived.height == stale_n and set(archived["kernel_code"]) == {"old"}
    # rows of another timing (a sweep that timed whole calls, or from before the column) are stale too
    again.with_columns(timing=pl.when(pl.col("shape_id") == df["shape_id"][0]).then(pl.lit("graph"))
                       .otherwise(pl.lit(None))).write_parquet(out)
    capsys.readouterr()
    assert sweep.main(argv) == 0
    said = capsys.readouterr().out
    assert f"{stale_n} of {n} rows were timed with other kernel code than today's ({kernel_code()}) or not by call" in said
    again = pl.read_parquet(out)  # the graph-timed rows timed again; rows without the column timed calls: kept
    assert again.height == n and set(again.filter(pl.col("shape_id") == df["shape_id"][0])["timing"]) == {"call"}
    assert again.filter(pl.col("shape_id") != df["shape_id"][0])["timing"].is_null().all()


@pytest.mark.slow  # two sweeps end to end
def test_a_sweep_of_some_families_keeps_the_other_families_rows_and_stamps(tmp_path, capsys):
    """Only the swept families' rows are judged stale: another family's rows of another kernel code
    stay, with their stamps (the cost model fits each family on its own rows)."""
    from experiments.bench.stamp import kernel_code

    out = tmp_path / "s.parquet"
    base = ["--grid", "tiny", "--device", "cpu", "--out", str(out), "--warmup-ms", "0", "--rep-ms", "1"]
    assert sweep.main([*base, "--families", "softmax_fwd,padded_to_jagged", "--commit", "old1"]) == 0
    df = pl.read_parquet(out).with_columns(kernel_code=pl.lit("old"))
    df.write_parquet(out)
    n_p2j = df.filter(pl.col("family") == "padded_to_jagged").height
    capsys.readouterr()
    assert sweep.main([*base, "--families", "softmax_fwd", "--commit", "new1"]) == 0
    said = capsys.readouterr().out
    n_soft = df.height - n_p2j
    assert f"{n_soft} of {df.height} rows were timed with other kernel code" in said
    again = pl.read_parquet(out)
    kept = again.filter(pl.col("family") == "padded_to_jagged")
    assert kept.height == n_p2j and set(kept["kernel_code"]) == {"old"} and set(kept["commit"]) == {"old1"}
    soft = again.filter(pl.col("family") == "softmax_fwd")
    assert soft.height == n_soft and set(soft["kernel_code"]) == {kernel_code()} and set(soft["commit"]) == {"new1"}
    assert pl.read_parquet(tmp_path / "s.stale.parquet")["family"].unique().to_list() == ["softmax_fwd"]


def test_no_launch_key_value_is_carried_by_the_hand_config_alone():
    """Every value the hand config has on a key is also swept with other values of the other keys,
    so a model cannot learn the hand rule's wins or losses as that value's effect."""
    from experiments.tuning.families import FAMILIES, grid, hand_config, space

    for level in ("small", "medium"):
        for f in FAMILIES:
            for s in grid(f, level):
                hand, configs = hand_config(f, s), space(f, s, level)
                others = [c for c in configs if c != hand]
                if not others:
                    continue
                for k, v in hand.items():
                    assert any(c[k] == v for c in others), (level, f, s.id, k, v)
    # the hand value is swept with the others: dense_fwd's hand stages (2 on a GPU at D 64, 1 in the
    # interpreter) on every valid tile the space's 3 stages run at N 4096
    s = next(s for s in grid("dense_fwd", "medium") if s.N == 4096 and s.Tq == 64)
    tiles = lambda st: {(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"])  # noqa: E731
                        for c in space("dense_fwd", s, "medium") if c["num_stages"] == st}
    hand_stages = hand_config("dense_fwd", s)["num_stages"]
    assert hand_stages != 3 and tiles(hand_stages) == tiles(3) and len(tiles(3)) > 1


def test_every_autotune_candidate_is_swept():
    """The autotune baseline is the best of its candidate list by the sweep's own times: every
    candidate valid for a shape of the small or medium grid is in that shape's space."""
    from experiments.tuning.families import AUTOTUNE, grid, space, valid

    for family, candidates in AUTOTUNE.items():
        for level in ("small", "medium"):
            for s in grid(family, level):
                swept = space(family, s, level)
                for c in candidates:
                    assert not valid(family, c, s) or c in swept, (family, level, s.id, c)


class _CountingMeter:
    """An energy counter that gains 0.5 J between two readings."""

    def __init__(self, index=None):
        self.available, self.j = True, 0.0

    def read_j(self):
        self.j += 0.5
        return self.j


def _tiny_shape_args():
    from experiments.tuning.families import grid, hand_config, space

    s = grid("flash_fwd", "tiny")[0]
    args = SimpleNamespace(warmup_ms=0, rep_ms=1, grid="tiny", seed=0, energy_s=0.001, timing="call")
    stamp = {k: "x" for k in sweep.STAMP_COLS}
    return s, space("flash_fwd", s, "tiny"), hand_config("flash_fwd", s), args, stamp


def test_a_shape_cut_by_the_deadline_gets_no_energy_pass_until_complete():
    """Energy is read only once every config of a shape is timed: a cut shape's fastest config may
    be one not yet timed, and the readings would miss it."""
    s, todo, hand, args, stamp = _tiny_shape_args()
    assert len(todo) >= 2
    calls = iter([False] + [True] * 10)  # the deadline passes after the first config
    rows, sticky = sweep.sweep_shape("flash_fwd", s, todo, hand, torch.device("cpu"), stamp,
                                     _CountingMeter(), args, lambda: next(calls))
    assert len(rows) == 1 and not sticky and all(r["energy_src"] == "none" for r in rows)
    assert sweep.needs_energy(rows)
    rest, _ = sweep.sweep_shape("flash_fwd", s, todo[1:], hand, torch.device("cpu"), stamp,
                                _CountingMeter(), args, lambda: False, prior=rows)
    every = rows + rest
    assert len(every) == len(todo) and not sweep.needs_energy(every)
    assert {id(r) for r in sweep.energy_rows(every)} <= {id(r) for r in every if r["energy_src"] == "counter"}


def test_resumed_rows_take_todays_hand_rule_and_only_counter_energy():
    s, todo, hand, args, stamp = _tiny_shape_args()
    cols = dict(family="flash_fwd", shape_id=s.id, B=s.B, N=s.N, fill=s.fill, H=s.H, D=s.D, Tq=s.Tq, dtype=s.dtype)
    rows = [dict(cols, config_id=sweep.config_id(c), is_hand=not (c == hand), energy_j=1.0,
                 energy_src="none" if c == hand else "counter") for c in todo]
    sweep.refresh(rows)
    assert [r["is_hand"] for r in rows] == [c == hand for c in todo]
    assert [math.isnan(r["energy_j"]) for r in rows] == [c == hand for c in todo]


def test_energy_pass_reads_the_counter_for_the_configs_near_the_fastest(tmp_path):
    """Energy per call = counter difference / calls over a window of back-to-back calls, for the (at
    most 3) fastest ok configs within 5% of the fastest and the hand rule's; the others keep no
    energy, and the cost model reads energy only from counter rows (not sampled power x time)."""
    class Meter:  # a board whose every call of fn costs 2 J
        available = True
        j = 100.0

        def read_j(self):
            return self.j

    meter = Meter()

    def fn():
        meter.j += 2.0

    cfg = lambda bm: json.dumps({"BLOCK_M": bm, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})  # noqa: E731
    rows = [dict(status="ok", ms=1.00, is_hand=False, config=cfg(16)), dict(status="ok", ms=1.04, is_hand=False, config=cfg(32)),
            dict(status="ok", ms=1.50, is_hand=False, config=cfg(64)), dict(status="ok", ms=2.00, is_hand=True, config=cfg(128)),
            dict(status="error", ms=math.nan, is_hand=False, config=cfg(256))]
    sweep.measure_energy("flash_fwd", fn, rows, torch.device("cpu"), meter, SimpleNamespace(energy_s=0.01))
    assert [r.get("energy_src") for r in rows] == ["counter", "counter", None, "counter", None]
    many = [dict(status="ok", ms=1.0 + i / 100, is_hand=False, config=cfg(16)) for i in range(5)]
    sweep.measure_energy("flash_fwd", fn, many, torch.device("cpu"), meter, SimpleNamespace(energy_s=0.001))
    assert [r.get("energy_src") for r in many] == ["counter"] * sweep.ENERGY_MAX_CONFIGS + [None] * 2  # the fastest
    measured = [r for r in rows if "energy_j" in r]
    assert all(r["energy_window_s"] >= 0.01 and r["energy_calls"] >= 1 for r in measured)  # 10 ms of calls each
    assert all(r["energy_j"] == pytest.approx(2.0) for r in measured)
    meter.available = False  # no NVML: nothing measured
    fresh = [dict(status="ok", ms=1.0, is_hand=True, config=cfg(16))]
    sweep.measure_energy("flash_fwd", fn, fresh, torch.device("cpu"), meter, SimpleNamespace(energy_s=0.01))
    assert "energy_j" not in fresh[0]
    data = tmp_path / "s.parquet"
    pl.DataFrame({"config": [cfg(16), cfg(32)], "energy_j": [2.0, 3.0], "energy_src": ["counter", "none"]}).write_parquet(data)
    assert [r["energy_j"] for r in costmodel.load(data)][0] == 2.0 and math.isnan(costmodel.load(data)[1]["energy_j"])


def test_medium_grid_extends_small_with_its_config_space():
    """medium = small's shapes plus more, with small's configs and more: a resumed small sweep keeps its rows."""
    from experiments.tuning.families import FAMILIES, grid, space

    for f in FAMILIES:
        small, medium = grid(f, "small"), grid(f, "medium")
        assert medium[:len(small)] == small and len(medium) > len(small)
        assert len({s.id for s in medium}) == len(medium)  # no shape twice
        for s in small:
            medium_space = space(f, s, "medium")
            assert all(c in medium_space for c in space(f, s, "small"))


@pytest.mark.slow
def test_the_elementwise_ops_are_a_sweep_family_timed_through_their_module_dict(tmp_path, capsys):
    """The elementwise forward launcher reads its module's dict, not the launch table: the sweep puts
    each config in that dict for the call (and restores it), every config computes the hand
    config's output, and the export leaves the family out of the table."""
    from kernels import _elementwise_triton
    from experiments.tuning.families import FAMILIES, MODULE_DICTS, grid, launching, space

    assert set(FAMILIES) - set(MODULE_DICTS) == set(lc.FAMILIES)
    before = dict(_elementwise_triton.FWD_CONFIG)
    with launching("elementwise_mul", {"BLOCK_N": 16, "num_warps": 8}):
        assert _elementwise_triton.FWD_CONFIG == {**before, "BLOCK_N": 16, "num_warps": 8}
    assert _elementwise_triton.FWD_CONFIG == before
    out, fams = tmp_path / "s.parquet", ("elementwise_add", "elementwise_mul")
    assert sweep.main(["--grid", "tiny", "--device", "cpu", "--families", ",".join(fams), "--out", str(out),
                       "--warmup-ms", "0", "--rep-ms", "1"]) == 0
    df = pl.read_parquet(out)
    assert df.height == sum(len(space(f, s, "tiny")) for f in fams for s in grid(f, "tiny")) > 4
    assert set(df["status"]) == {"ok"} and (df["rel_err"] <= 1e-3).all() and df["is_hand"].sum() == 4
    assert _elementwise_triton.FWD_CONFIG == before
    assert table.export_entries(costmodel.load(out), {}) == []
    assert "elementwise_add: its launcher reads kernels/_elementwise_triton.py's dict" in capsys.readouterr().out


def test_shape_grids_are_the_ones_the_committed_sweeps_timed():
    """The grids (shapes.csv and the full products) give exactly the shapes, in the order, that the
    sweeps in experiments/results were timed on: a count and a digest of every level's shape ids."""
    import hashlib

    from experiments.tuning.families import LEVELS, grid

    kinds = {"attn": "flash_fwd", "dense": "dense_fwd", "softmax": "softmax_fwd", "ops": "padded_to_jagged",
             "s2": "s2_fwd"}
    lines = [f"{level} {kind} {s.id}" for level in LEVELS for kind, f in kinds.items() for s in grid(f, level)]
    assert len(lines) == 525
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] == "2d04ccb7eb4a82fd"


def test_sweep_bad_cli_exits_2():
    for argv in (["--families", "nope", "--device", "cpu"], ["--grid", "huge"], ["--deadline-s", "0", "--device", "cpu"]):
        with pytest.raises(SystemExit) as e:
            sweep.parse_args(argv)
        assert e.value.code == 2


# ---- the cost model on a synthetic dataset ---------------------------------------------------

BM, BN, WARPS = (32, 64, 128), (16, 32, 64), (4, 8)


def _best_bm(L):
    return 32 if L < 90 else 64 if L < 350 else 128


def synthetic_rows(seed=0) -> list[dict]:
    """flash_fwd rows: time = f(shape) * g(config, shape) * noise(2%), where the best BLOCK_M
    follows the mean length L, the best BLOCK_N is BLOCK_M / 2 and 8 warps win only at
    BLOCK_M = 128 (by 3%). Energy = time * power; 4 warps draw 15% less power (so the frugal pick may
    differ from the fastest)."""
    rng = random.Random(seed)
    rows = []
    for N in (64, 128, 256, 512, 1024, 2048, 4096):
        for fill in (0.3, 0.6):
            B = (1 << 18) // N
            L = fill * N
            s = dict(family="flash_fwd", B=B, N=N, fill=fill, H=2, D=64, Tq=0, K=0, M=0, dtype="bfloat16",
                     T=int(L * B), L=L, gpu="synthetic", gpu_slug="synthetic", torch="t", triton="t",
                     cuda="none", commit="c0", grid="synthetic")
            s["shape_id"] = f"B{B}-N{N}-f{fill}"
            base = 1e-4 * B * L * L / 64
            opt = _best_bm(L)
            for bm in BM:
                for bn in BN:
                    if bm % bn:
                        continue
                    for w in WARPS:
                        g = 1 + 0.35 * abs(math.log2(bm / opt)) + 0.15 * abs(math.log2(bn / (bm // 2)))
                        g *= 1.0 if (w == 8) == (bm == 128) else 1.03
                        ms = base * g * (1 + rng.uniform(-0.02, 0.02))
                        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": 3}
                        power = 300.0 * (0.85 if w == 4 else 1.0)
                        rows.append(dict(s, config_id=sweep.config_id(cfg), config=json.dumps(cfg), cfg=cfg,
                                         status="ok", ms=ms, energy_j=power * ms / 1e3, compile_s=0.5,
                                         bench_s=0.1, is_hand=False))
    return rows


@pytest.mark.slow
def test_costmodel_picks_the_best_config_on_held_out_shapes(capsys):
    rows = synthetic_rows()
    hand = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}  # a fixed rule, right for no shape
    res = costmodel.evaluate(rows, folds=7, hand_fn=lambda fam, s: hand)
    ev = res["flash_fwd"]
    s = ev["summary"]
    print(capsys.readouterr().out)  # shown with -s: the synthetic eval's line
    assert ev["n_shapes"] == 14 and len(ev["shapes"]) == 14
    assert ev["r2_log_ms"] > 0.9
    assert s["model"]["median"] <= 1.05 and s["model"]["worst"] <= 1.15 and s["meets_target"]
    assert s["model"]["geomean"] < s["hand"]["geomean"]  # the fixed rule loses on average
    assert s["hand"]["worst"] > 1.15  # ... and badly somewhere, so the bounds above can fail
    assert s["autotune"]["n"] == 14 and s["autotune_cost_s_per_shape"] > 0
    # the exported table's rule: the model's pick, the hand config only where predicted no slower
    # than it (this fixed rule is right for no shape, so nowhere here)
    assert all(x["table_config"] == x["model_config"] and x["table"] == x["model"] for x in ev["shapes"])
    assert s["table"]["n"] == 14 and s["model"]["geomean"] <= s["table"]["geomean"] < s["hand"]["geomean"]
    # at BLOCK_M = 128 the 4-warp config is within 5% of the fastest and draws less power
    saved = [x for x in ev["shapes"] if x["frugal_energy_j"] < 0.9 * x["fastest_energy_j"]]
    assert len(saved) >= 3 and all(x["frugal_ms"] <= 1.05 * x["best_ms"] for x in saved)
    assert any(x["model_frugal_energy_j"] < x["model_energy_j"] for x in saved)  # the model's frugal pick too


def _rows_turning_over_at_a_total_size(seed=0) -> list[dict]:
    """softmax_bwd rows on 45 shapes (B, N, H crossed, so B and N vary apart): 8 warps are 1.2x
    faster than 4 exactly where T*H (rows x columns) is 2^23 or more, a size reached by many
    short sequences or few long ones; the 512-row tile wins from N 1024 on (by 1.1x)."""
    rng = random.Random(seed)
    rows = []
    for N, B, H in itertools.product((256, 512, 1024, 2048, 4096), (128, 512, 2048), (32, 64, 128)):
        L = 0.25 * N
        s = dict(family="softmax_bwd", B=B, N=N, fill=0.25, H=H, D=0, Tq=0, K=0, M=0, dtype="bfloat16",
                 T=int(B * L), L=L, gpu="synthetic", gpu_slug="synthetic", torch="t", triton="t",
                 cuda="none", commit="c0", grid="synthetic", shape_id=f"B{B}-N{N}-H{H}")
        wide = s["T"] * H >= 1 << 23
        for bn, w in itertools.product((256, 512), (4, 8)):
            cfg = {"BLOCK_N": bn, "SMALL_N": 32, "BLOCK_H": 64, "num_warps": w, "STREAM_N": 256}
            g = (1.0 if (w == 8) == wide else 1.2) * (1.0 if (bn == 512) == (N >= 1024) else 1.1)
            rows.append(dict(s, config_id=sweep.config_id(cfg), config=json.dumps(cfg), cfg=cfg, status="ok",
                             ms=1e-6 * s["T"] * H * g * (1 + rng.uniform(-0.01, 0.01)), energy_j=None,
                             compile_s=0.5, bench_s=0.1, is_hand=False))
    return rows


@pytest.mark.slow  # two 5-fold evaluations, about 9 s
def test_the_element_count_feature_lets_the_forest_follow_a_total_size(monkeypatch):
    """A boundary on B*L*H is a diagonal in the log shape features, which a forest's one-feature
    splits can only staircase; with log2(T*H*D) as a feature the held-out picks find it."""
    rows = _rows_turning_over_at_a_total_size()
    hand = rows[0]["cfg"]
    with_it = costmodel.summarize(costmodel.eval_family("softmax_bwd", rows, folds=5, hand_fn=lambda f, s: hand))
    assert with_it["model"]["n"] == 45 and with_it["model"]["worst"] <= 1.05
    full, i = costmodel.features, costmodel.feature_names("softmax_bwd").index("log2 T*H*D")

    def without_the_element_count(fam, shape, cfg):
        f = full(fam, shape, cfg)
        return f[:i] + f[i + 1:]

    monkeypatch.setattr(costmodel, "features", without_the_element_count)
    without = costmodel.summarize(costmodel.eval_family("softmax_bwd", rows, folds=5, hand_fn=lambda f, s: hand))
    assert without["model"]["worst"] > 1.15  # the staircase misses near the boundary


@pytest.mark.parametrize("family", sweep_families.WITH_PROGRAMS)
def test_the_program_count_feature_is_the_launchers_grid(family):
    """The cost model's `log2 programs` is the grid the launcher runs for the config (column
    blocks narrower or wider than H, H not a power of two)."""
    from kernels import _softmax_triton

    for B, H, block_h in itertools.product((1, 96, 320), (1, 24, 64, 128, 200), (16, 64, 128)):
        cfg = {"BLOCK_N": 256, "SMALL_N": 32, "STREAM_N": 64, "BLOCK_H": block_h, "num_warps": 4}
        with lc.forced(family, cfg):
            (grid,), _ = _softmax_triton._launch(H, B, family, 4096, B * 100, torch.bfloat16)
        assert sweep_families.programs(family, B, H, cfg) == grid
        shape = dict(B=B, N=4096, L=100.0, H=H, D=0, Tq=0, T=B * 100.0, dtype="bfloat16", fill=0.1)
        row = dict(zip(costmodel.feature_names(family), costmodel.features(family, shape, cfg)))
        assert row["log2 programs"] == pytest.approx(math.log2(grid))
    with pytest.raises(ValueError, match="no program count"):
        sweep_families.programs("flash_fwd", 4, 2, {})
    assert "log2 programs" not in costmodel.feature_names("flash_fwd")


def test_log_model_splits_a_shapes_best_from_each_configs_slowdown():
    """LogModel: the power law fits each shape's best log time, the forest each row's log ratio to
    it; the same config ranking on shapes 1000x apart in scale is learned once, not per scale."""
    rng = np.random.default_rng(0)
    shapes = [(b, n) for b in (1.0, 3.0, 5.0, 7.0, 9.0) for n in (2.0, 4.0, 6.0, 8.0)]
    X, y, groups = [], [], []
    for i, (b, n) in enumerate(shapes):
        best = 0.7 * b + 0.5 * n  # log2-scale shape features -> log time of the best config
        for tile in (4.0, 5.0, 6.0, 7.0):
            slow = 0.3 * abs(tile - (5.0 if n < 5 else 6.0))  # tile 5 wins on short rows, 6 on long
            X.append([b, n, *[0.0] * (costmodel.N_SHAPE_FEATURES - 2), tile])
            y.append(best + slow + rng.normal(0, 0.01))
            groups.append(i)
    X, y = np.array(X), np.array(y)
    m = costmodel.LogModel().fit(X, y, groups)
    best_of = {g: min(v for v, h in zip(y, groups) if h == g) for g in set(groups)}
    assert np.allclose(m.lin.predict(X[:, :costmodel.N_SHAPE_FEATURES]), [best_of[g] for g in groups], atol=0.05)
    assert np.allclose(m.forest.predict(X), y - np.array([best_of[g] for g in groups]), atol=0.05)
    # an unseen shape between the swept ones: its best tile, and its scale from the power law
    for n, win in ((3.0, 5.0), (7.0, 6.0)):
        q = np.array([[8.0, n, *[0.0] * (costmodel.N_SHAPE_FEATURES - 2), t] for t in (4.0, 5.0, 6.0, 7.0)])
        p = m.predict(q)
        assert q[int(np.argmin(p)), -1] == win
        assert abs(p.min() - (0.7 * 8.0 + 0.5 * n)) < 0.1


FIXED_HAND = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}  # best where L is near 64


@pytest.fixture(scope="module")
def fitted() -> tuple[list[dict], dict]:
    """The synthetic sweep and its models, fitted once for the export tests (read-only)."""
    rows = synthetic_rows()
    return rows, costmodel.fit(rows)


def test_export_table_covers_unseen_shapes(tmp_path, fitted):
    rows, models = fitted
    path = table.export(rows, models, str(tmp_path / "<gpu>.json"), hand_fn=lambda fam, s: FIXED_HAND)
    assert path.name == "synthetic.json"
    t = LaunchTable.load(path)
    swept = [e["source"] for e in t.exact.values() if "best_ms" in e]
    unseen = [e["source"] for e in t.exact.values() if "pred_ms" in e]
    assert len(swept) == 14 and set(swept) == {"measured", "hand"}
    assert len(unseen) > 14 and set(unseen) == {"predicted", "hand"}
    long = dict(B=32, N=8192, L=4096, H=2, D=64, dtype="bfloat16", causal=0)  # never swept
    assert t.lookup("flash_fwd", long)["config"]["BLOCK_M"] == 128
    short = dict(B=4096, N=64, L=20, H=2, D=64, dtype="bfloat16", causal=0)
    assert t.lookup("flash_fwd", short)["config"]["BLOCK_M"] == 32


def test_export_keeps_the_hand_rule_unless_another_config_clearly_beats_it(fitted):
    rows, models = fitted
    entries = table.export_entries(rows, models, hand_fn=lambda fam, s: FIXED_HAND)
    hand_id = sweep.config_id(FIXED_HAND)
    for e in entries:
        if e["source"] == "hand":  # kept: the hand rule within the margin of the best (measured or predicted)
            assert e["config"] == FIXED_HAND
            if "hand_ms" in e:
                assert e["hand_ms"] <= costmodel.SWITCH_MEASURED * e["best_ms"]
            else:
                assert e["pred_hand_ms"] <= costmodel.SWITCH_PREDICTED * e["pred_ms"]
        elif e["source"] == "measured":  # switched: the best beats the hand rule's own time clearly
            assert e["hand_ms"] > costmodel.SWITCH_MEASURED * e["best_ms"] and sweep.config_id(e["config"]) != hand_id
        else:
            assert e["pred_hand_ms"] > costmodel.SWITCH_PREDICTED * e["pred_ms"]
    by_source = {src: [e for e in entries if e["source"] == src] for src in ("measured", "predicted", "hand")}
    assert all(by_source.values()), {k: len(v) for k, v in by_source.items()}  # every case occurs here
    near = [e for e in by_source["hand"] if "hand_ms" in e]  # swept shapes where the hand config is (nearly) best
    assert near and all(90 <= e["shape"]["L"] < 350 for e in near)  # where _best_bm is 64
    # a rule right for no shape is replaced wherever the sweep measured a clear gain
    bad = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 3}
    entries = table.export_entries(rows, models, unseen=False, hand_fn=lambda fam, s: bad)
    assert [e["source"] for e in entries].count("measured") == 14


def test_export_keeps_the_hand_rule_where_a_pick_would_launch_fewer_programs_than_the_sweep():
    """The forest does not extrapolate below the program counts it was fitted on: an unswept shape
    whose predicted pick would launch fewer programs than any swept row (here B 32 at N 8192: 32
    programs, the sweep's fewest 128) keeps its hand rule, marked beyond_sweep."""
    rows = _rows_turning_over_at_a_total_size()
    hand = {"BLOCK_N": 256, "SMALL_N": 32, "BLOCK_H": 64, "num_warps": 4, "STREAM_N": 256}  # slow at N >= 1024
    fewest = min(sweep_families.programs("softmax_bwd", r["B"], r["H"], r["cfg"]) for r in rows)
    models = costmodel.fit(rows)
    assert models["softmax_bwd"].fewest_programs == fewest == 128
    entries = table.export_entries(rows, models, hand_fn=lambda fam, s: hand)

    def launched(e):
        return sweep_families.programs("softmax_bwd", e["shape"]["B"], e["shape"]["H"], e["config"])

    beyond = [e for e in entries if e.get("beyond_sweep")]
    predicted = [e for e in entries if e["source"] == "predicted"]
    assert beyond and all(e["source"] == "hand" and e["config"] == hand and launched(e) < fewest for e in beyond)
    assert predicted and all(launched(e) >= fewest for e in predicted)


def test_export_leaves_out_a_family_swept_on_too_few_shapes(tmp_path, capsys, fitted):
    """Two swept shapes are not a model: the family gets no entry (not even its measured ones, which
    the nearest-entry lookup would hand to every other shape), so its hand rule stays in force."""
    rows, models = fitted
    rows = rows + [dict(r, family="flash_bwd") for r in rows if r["N"] in (256, 512) and r["fill"] == 0.3]
    path = table.export(rows, models, str(tmp_path / "t.json"))
    t = LaunchTable.load(path)
    assert {e["family"] for e in t.exact.values()} == {"flash_fwd"}
    assert t.lookup("flash_bwd", dict(B=512, N=512, L=154, H=2, D=64, dtype="bfloat16", causal=0)) is None
    assert "flash_bwd: 2 swept shape(s), under 3: not in the table" in capsys.readouterr().out
    assert json.loads(path.read_text())["commit"] == "c0"


def test_summary_says_not_judged_where_no_shape_is_held_out():
    ev = {"shapes": []}
    assert costmodel.summarize(ev)["verdict"] == "not judged" and not costmodel.summarize(ev)["meets_target"]
    ev = {"shapes": [{"shape_id": "a", "model": 1.2, "hand": 1.0, "autotune": 1.0, "autotune_cost_s": 1.0}]}
    assert costmodel.summarize(ev)["verdict"] == "missed"
    ev["shapes"][0]["model"] = 1.01
    assert costmodel.summarize(ev)["verdict"] == "met"


def test_costmodel_bad_cli_exits_2(tmp_path):
    with pytest.raises(SystemExit) as e:
        costmodel.parse_args(["eval", "--data", str(tmp_path / "missing.parquet")])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        costmodel.parse_args(["predict", "--data", "x"])
    assert e.value.code == 2


@pytest.mark.slow
def test_judge_on_new_counts_only_the_shapes_outside_the_small_grid(monkeypatch):
    """Where the hand rules were retuned on the small grid's shapes, --judge-on new leaves those out
    of the slowdowns (they still train the model); a family whose rules were not keeps them all."""
    from experiments.tuning import families as sweep_families

    rows = synthetic_rows()
    small_ids = {r["shape_id"] for r in rows if r["N"] <= 256}  # stand-ins for the small grid's shapes
    monkeypatch.setattr(sweep_families, "grid", lambda family, level: [SimpleNamespace(id=i) for i in small_ids])
    hand = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    everything = costmodel.evaluate(rows, folds=7, hand_fn=lambda fam, s: hand)["flash_fwd"]
    monkeypatch.setattr(sweep_families, "RETUNED_ON_SMALL", ("softmax_fwd",))
    judged = costmodel.judged_shapes("new")
    assert all(judged("flash_fwd", i) for i in small_ids) and not any(judged("softmax_fwd", i) for i in small_ids)
    monkeypatch.setattr(sweep_families, "RETUNED_ON_SMALL", ("flash_fwd",))
    new = costmodel.evaluate(rows, folds=7, hand_fn=lambda fam, s: hand, judge_on="new")["flash_fwd"]
    assert len(everything["shapes"]) == 14 and everything["summary"]["model"]["n"] == 14
    assert {s["shape_id"] for s in new["shapes"]} == {r["shape_id"] for r in rows} - small_ids
    assert new["summary"]["model"]["n"] == 14 - len(small_ids) and new["n_shapes"] == 14  # all shapes trained
    assert costmodel.parse_args(["eval", "--data", __file__, "--judge-on", "new"]).judge_on == "new"


@pytest.mark.slow
def test_default_evaluation_holds_out_one_shape_at_a_time():
    """folds 0 (the default): one fold per shape, each shape judged by a model fitted on all the
    others; its verdicts can differ from 5 folds', which hold out several shapes at once."""
    rows = synthetic_rows()
    hand = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    loso = costmodel.eval_family("flash_fwd", [r for r in rows if r["family"] == "flash_fwd"],
                                 hand_fn=lambda fam, s: hand)
    shapes = {r["shape_id"] for r in rows if r["family"] == "flash_fwd"}
    assert {s["shape_id"] for s in loso["shapes"]} == shapes and len(loso["predictions"]) == sum(
        r["status"] == "ok" for r in rows if r["family"] == "flash_fwd")
    assert costmodel.parse_args(["eval", "--data", __file__]).folds == 0
    for bad in ("1", "-2"):
        with pytest.raises(SystemExit) as e:
            costmodel.parse_args(["eval", "--data", __file__, "--folds", bad])
        assert e.value.code == 2


@pytest.mark.slow  # the report end to end: every fold's forests and four plots
def test_report_writes_markdown_and_plots_with_energy_only_from_the_counter(tmp_path):
    """The report on the synthetic sweep: the markdown names every family and plot; the energy plot
    and columns come only from rows read off the energy counter."""
    from experiments.tuning.costmodel_report import write_report

    rows = synthetic_rows()
    counted = write_report([dict(r, energy_src="counter") for r in rows], str(tmp_path / "a" / "<gpu>"), folds=7)
    assert [Path(p).name for p in counted] == ["costmodel.md", "costmodel-pred.png", "costmodel-slowdown.png",
                                               "costmodel-importance.png", "costmodel-energy.png"]
    assert {Path(p).parent for p in counted} == {tmp_path / "a" / "synthetic"}  # <gpu>: the rows' GPU
    md = Path(counted[0]).read_text()
    assert "| flash_fwd | 14 |" in md and f"Energy: {len(rows)} rows" in md
    assert "7 folds" in md and "model, 5 folds" in md  # the verdicts' folds and the 5-fold column beside
    assert all(f"]({Path(p).name})" in md for p in counted[1:])
    sampled = write_report([dict(r, energy_j=math.nan) for r in rows], str(tmp_path / "b"), folds=7)
    assert len(sampled) == 4 and "costmodel-energy" not in " ".join(sampled)
    assert "no row has a reading of the board's energy counter" in Path(sampled[0]).read_text()


def test_nvml_board_is_torchs_device_by_uuid_never_another_visible_index(monkeypatch):
    """NVML numbers every board of the host; torch's index counts the visible ones only."""
    from experiments.tuning.sweep import nvml_handle

    class NV:
        def nvmlDeviceGetHandleByUUID(self, uuid):
            return ("uuid", uuid)

        def nvmlDeviceGetHandleByIndex(self, i):
            return ("index", i)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="58a3-7f"))
    assert nvml_handle(NV(), 0) == ("uuid", b"GPU-58a3-7f")

    def no_cuda(i):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert nvml_handle(NV(), 0) is None  # board 0 of NVML is not torch's device 0 here
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_handle(NV(), 0) == ("index", 0)


def test_rows_of_an_older_sweep_get_the_keys_added_since_as_their_kernel_ran():
    """The committed H200 sweep predates softmax's STREAM_N and jagged_jagged_bmm's T_SPLITS: its
    rows load with the values those kernels ran with then (streamed tiles of BLOCK_N rows, no
    split), so every row has every key its family has today and the model can be fitted."""
    from pathlib import Path

    from experiments.tuning.costmodel import load
    from experiments.tuning.families import TUNABLE, complete

    assert complete("softmax_fwd", {"BLOCK_N": 512, "SMALL_N": 64}) == {"BLOCK_N": 512, "SMALL_N": 64, "STREAM_N": 512}
    assert complete("jagged_jagged_bmm", {"BLOCK_K": 64})["T_SPLITS"] == 1
    recorded = {"BLOCK_N": 256, "STREAM_N": 64}
    assert complete("softmax_bwd", recorded) is recorded  # a key the row has is kept
    rows = load(Path(__file__).resolve().parents[1] / "experiments" / "results" / "tuning" / "h200" / "sweep.parquet")
    assert {r["family"] for r in rows} >= {"softmax_fwd", "jagged_jagged_bmm"}
    for r in rows:
        assert set(TUNABLE[r["family"]]) <= set(r["cfg"]), (r["family"], r["cfg"])


def test_kernel_code_follows_the_code_not_its_comments_or_docstrings():
    """A sweep's rows stay current through comment and docstring edits of kernels/, not through a
    change of what runs (nor of torch or triton)."""
    from experiments.bench.stamp import code_text, kernel_code

    src = 'def f(x):\n    """Doc."""\n    y = x + 1  # one\n\n    return y  # "#" in a comment\n'
    edited = 'def f(x):\n    """Another doc,\n    two lines."""\n    # a new comment line\n    y = x + 1\n    return y\n'
    assert code_text(src) == code_text(edited) == "def f(x):\n    y = x + 1\n    return y"
    assert code_text(src) != code_text(src.replace("x + 1", "x + 2"))
    assert code_text('s = "# not a comment"  # a comment\n') == 's = "# not a comment"'
    assert len(kernel_code()) == 12 and kernel_code() == kernel_code()
    assert kernel_code("2.11.0", "3.6.0") != kernel_code("2.12.0", "3.6.0") != kernel_code("2.12.0", "3.5.0")
