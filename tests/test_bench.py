"""The benchmark harness (experiments.bench) end to end on the CPU: rows, formulas, lengths, failures,
targets and the written report. No timing is asserted (benchmarks, not timed tests)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from experiments.bench import layouts, measure, runner, targets
from experiments.bench.cli import main
from experiments.bench.base import Prepared, Provider, RunConfig
from experiments.bench.measure import tensor_bytes
from experiments.bench.suites import attention_flops, dense_attention_flops, get_suite, make_lengths, Shape

ROW_FIELDS = {
    "kind", "suite", "op", "shape_id", "shape", "tokens", "provider", "mode", "status", "flops", "tflops",
    "bytes_moved", "gbps", "ours_speedup", "ours_mem_ratio", "wall_s",
}


def _kernels_ready() -> bool:
    try:
        from kernels import jagged_dense_attention, jagged_flash_attention  # noqa: F401
    except Exception:
        return False
    return True


def test_flop_formulas_hand_computed():
    lengths = torch.tensor([3, 0, 5])
    # forward 4*H*D*sum(L^2) = 4*2*4*(9 + 0 + 25) = 1088; backward 2.5x more: 1088 * 3.5
    assert attention_flops(lengths, H=2, D=4, mode="fwd") == 1088
    assert attention_flops(lengths, H=2, D=4, mode="fwd_bwd") == 1088 * 3.5
    # target attention: 4*H*D*Tq*sum(L) = 4*2*4*2*8 = 512
    assert dense_attention_flops(lengths, Tq=2, H=2, D=4, mode="fwd") == 512


def test_lengths_mean_clip_and_seed():
    lengths = make_lengths(20000, 1000, 0.25, seed=3)
    assert lengths.dtype == torch.int64 and lengths.shape == (20000,)
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= 500
    assert abs(float(lengths.float().mean()) - 250) < 0.02 * 250
    dense = make_lengths(5000, 100, 0.75, seed=3)  # drawn in [1, 150], clipped to 100
    assert int(dense.max()) == 100 and float((dense == 100).float().mean()) > 0.3
    assert torch.equal(make_lengths(64, 128, 0.3, seed=5), make_lengths(64, 128, 0.3, seed=5))
    assert not torch.equal(make_lengths(64, 128, 0.3, seed=5), make_lengths(64, 128, 0.3, seed=6))


def test_paper_suite_has_peers_and_grid():
    shapes = get_suite("attention", "paper")
    ids = [s.id for s in shapes]
    assert ids[0] == "B1024-N1024-H2-D64-d0.25" and len(ids) == len(set(ids))
    grid = [s for s in shapes if "grid" in s.tags]
    assert len(grid) == 20 and all(s.B * s.N == 2**20 for s in grid)
    assert "B2048-N4096-H1-D64-d0.25" in ids and "B4096-N128-H4-D32-d0.3" in ids
    assert len(get_suite("attention", "paper", max_shapes=3)) == 3


def test_the_suites_are_the_shapes_they_always_were():
    """suites.csv holds the shapes the suites were built from in code: same shapes, tags and order."""
    import hashlib

    from experiments.bench.suites import KINDS, SUITE_NAMES

    suites = {k: {s: [x.as_dict() for x in get_suite(k, s)] for s in SUITE_NAMES} for k in KINDS}
    assert sum(len(v) for d in suites.values() for v in d.values()) == 67
    digest = hashlib.sha256(json.dumps(suites, sort_keys=True).encode()).hexdigest()
    assert digest == "f0f5e2fab2d0433c1ffe51ef00ea867cf49a1ec679f0c16ae56c32396b306a41"


def test_padded_reference_matches_project_reference(monkeypatch):
    monkeypatch.setattr(layouts, "SMALL_REF_TOKENS", 0)
    monkeypatch.setattr(layouts, "REF_CHUNK_BYTES", 1)  # one sequence per chunk
    j = layouts.make_jagged(Shape(5, 24, 2, 16, 0.5, Tq=3), torch.device("cpu"), torch.float32)
    ours = layouts.reference_self_attention(j)
    ref = torch.cat([
        torch.softmax(q.transpose(0, 1) @ k.transpose(0, 1).transpose(1, 2) / 4.0, -1) @ v.transpose(0, 1)
        for q, k, v in zip(*(t.split(j.lengths.tolist()) for t in (j.q, j.k, j.v)))
    ], dim=1).transpose(0, 1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    dense = layouts.reference_dense_attention(j)
    assert dense.shape == (5, 3, 2, 16) and torch.isfinite(dense).all()


def test_tensor_bytes_counts_shared_storage_once():
    x = torch.zeros(10, 4)
    assert tensor_bytes([x, x.view(40), x[2:]]) == 160
    assert tensor_bytes([x, torch.zeros(3)]) == 172


def _bad_output(j, cfg):
    q = j.q.detach().requires_grad_()
    return Prepared(lambda: q * 2.0, [q], [q], lambda o: o)


def _raises(j, cfg):
    raise ValueError("broken provider")


def test_failing_provider_is_a_row_not_a_crash(monkeypatch):
    extra = [Provider("wrong_output", _bad_output), Provider("raises", _raises)]
    monkeypatch.setattr(runner, "ATTENTION_PROVIDERS", runner.ATTENTION_PROVIDERS[:3] + extra)
    cfg = RunConfig(torch.device("cpu"), torch.float32, warmup_ms=0, rep_ms=1, ours_backend="torch", max_shapes=1)
    rows = runner.run_kind("attention", "smoke", cfg)
    by = {(r["provider"], r["mode"]): r for r in rows}
    for mode in ("fwd", "fwd_bwd"):
        assert by[("wrong_output", mode)]["status"] == "FAILED" and by[("wrong_output", mode)].get("ms") is None
        assert by[("wrong_output", mode)]["rel_err"] > 0.1
        assert by[("raises", mode)]["status"] == "error: ValueError"
        assert by[("dense_torch", mode)]["status"] == "ok" and by[("dense_torch", mode)]["ms"] > 0


@pytest.mark.slow  # every kind of the smoke suite end to end
def test_smoke_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "results"
    argv = ["all", "--suite", "smoke", "--device", "cpu", "--out", str(out), "--warmup", "0", "--rep", "1",
            "--max-shapes", "1", "--commit", "abc1234test"]
    assert main(argv) == 0
    doc = json.loads((out / "bench-all-smoke.json").read_text())
    assert doc["schema"] == "jagged-bench/1" and doc["stamp"]["commit"] == "abc1234test"
    assert doc["stamp"]["torch"] == torch.__version__ and doc["ceilings"]["copy_gbps"] > 0
    rows = doc["rows"]
    assert {r["kind"] for r in rows} == {"attention", "dense_attention", "ops"}
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
    by = {(r["kind"], r.get("op"), r["provider"], r["mode"]): r for r in rows}
    ready = _kernels_ready()
    for kind, peers in (("attention", ("dense_torch", "sdpa_padded_mask", "njt_sdpa")),
                        ("dense_attention", ("dense_torch", "sdpa_padded_mask"))):
        for mode in ("fwd", "fwd_bwd"):
            for p in peers:
                r = by[(kind, None, p, mode)]
                assert r["status"] == "ok" and r["ms"] > 0 and r["rel_err"] < 2e-2 and r["flops"] > 0
                assert r["peak_bytes"] is None  # no memory on the CPU
            assert by[(kind, None, "varlen_attn", mode)]["status"].startswith("unavailable")
            ours = by[(kind, None, "jagged", mode)]
            if ready:
                assert ours["status"] == "ok" and ours["ours_speedup"] == pytest.approx(1.0)
                assert math.isclose(by[(kind, None, "dense_torch", mode)]["ours_speedup"],
                                    by[(kind, None, "dense_torch", mode)]["ms"] / ours["ms"])
            else:
                assert ours["status"].startswith("error")
    assert by[("ops", "jagged_to_padded", "torch_padded", "fwd")]["status"] == "ok"
    assert by[("ops", "jagged_to_padded", "torch_padded", "fwd")]["gbps"] > 0
    assert by[("ops", "jagged_dense_bmm", "torch_padded", "fwd")]["tflops"] > 0
    md = (out / "report.md").read_text()
    assert "abc1234test" in md and f"torch {torch.__version__}" in md and "## Targets" in md
    assert "### Jagged self-attention: suite `smoke`" in md
    from PIL import Image

    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {"attention-vs-N.png", "attention-vs-density.png",
                                      "dense-attention-vs-Tq.png", "ops-bandwidth.png"}
    for p in pngs:
        assert "abc1234test" in Image.open(p).text["Description"]
    report = json.loads((out / "report.json").read_text())  # the targets as data, beside the markdown
    assert report["stamp"]["commit"] == "abc1234test" and report["files"] == ["bench-all-smoke.json"]
    assert {t["target"] for t in report["targets"]} == {t["target"] for t in targets.evaluate(rows, doc["ceilings"])}
    (out / "report.md").unlink()
    assert main(["report", "--out", str(out)]) == 0  # the report alone rebuilds from the JSON
    rebuilt = (out / "report.md").read_text()
    assert "abc1234test" in rebuilt
    src, gz = out / "bench-all-smoke.json", out / "bench-all-smoke.json.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    src.unlink()
    assert main(["report", "--out", str(out)]) == 0  # a gzipped result file (the committed ones are) reads as itself
    assert (out / "report.md").read_text() == rebuilt.replace(src.name, gz.name)
    src.write_bytes(gzip.decompress(gz.read_bytes()))
    gz.unlink()
    later = json.loads((out / "bench-all-smoke.json").read_text())  # a second file: the ops again
    later["stamp"].update(commit="def5678later", launch_table="cpu.json: 3 entries")
    later["rows"] = [r for r in later["rows"] if r["kind"] == "ops"]
    (out / "bench-ops-smoke.json").write_text(json.dumps(later))
    assert main(["report", "--out", str(out)]) == 0
    for p in pngs:  # plots of merged rows name both files' commits and launch tables, not the newest only
        text = Image.open(p).text["Description"]
        assert "abc1234test + def5678later" in text and "none (hand rules) + cpu.json: 3 entries" in text, text
    later["rows"] = json.loads((out / "bench-all-smoke.json").read_text())["rows"]  # now every row
    (out / "bench-ops-smoke.json").write_text(json.dumps(later))
    assert main(["report", "--out", str(out)]) == 0
    text = Image.open(out / "ops-bandwidth.png").text["Description"]
    assert "def5678later" in text and "abc1234test" not in text  # the first file gives no row any more


def test_merged_results_drop_a_deadline_placeholder_another_file_measured():
    from experiments.bench import report

    skipped = dict(_row("*", "*", None, None), status="skipped (deadline)")
    other = dict(skipped, shape_id="B8-N128-H2-D64-d0.25")
    first = {"rows": [_row("jagged", "fwd", 2.0, 100, shape_id=other["shape_id"]), skipped]}
    second = {"rows": [_row("jagged", "fwd", 1.0, 100), _row("varlen_attn", "fwd", 1.5, 100), other]}
    merged = report.merge_rows([first, second])
    assert sorted((r["shape_id"], r["provider"], r["ms"]) for r in merged) == [
        ("B8-N128-H2-D64-d0.25", "jagged", 2.0), ("B8-N64-H2-D64-d0.25", "jagged", 1.0),
        ("B8-N64-H2-D64-d0.25", "varlen_attn", 1.5)]
    assert report.merge_rows([first]) == first["rows"]  # a shape no file measured keeps its placeholder
    # each merged row is set against the copy bandwidth of its own run, not the newest file's
    op_row = dict(_row("jagged", "fwd", 1.0, 100, kind="ops"), op="jagged_softmax", gbps=700.0,
                  shape={"density": 0.1, "tags": ["large"]})
    older, newer = {"ceilings": {"copy_gbps": 1000.0}, "rows": [op_row]}, {"ceilings": {"copy_gbps": 2000.0}, "rows": []}
    merged = report.merge_rows([older, newer])
    res = {t["target"]: t for t in targets.evaluate(merged, newer["ceilings"])}
    softmax = res["ops jagged_softmax: >= 70% of the measured copy bandwidth on large inputs"]
    assert softmax["status"] == "PASS" and softmax["detail"].startswith("worst 70% at") and "(copy 1000 GB/s)" in softmax["detail"]


def _row(provider, mode, ms, peak, shape_id="B8-N64-H2-D64-d0.25", suite="paper", kind="attention"):
    return {"kind": kind, "suite": suite, "op": None, "shape_id": shape_id, "shape": {"density": 0.25, "tags": []},
            "provider": provider, "mode": mode, "status": "ok", "ms": ms, "peak_bytes": peak}


def test_targets_are_never_relaxed():
    rows = [_row("jagged", m, 1.0, 100) for m in ("fwd", "fwd_bwd")]
    rows += [_row("varlen_attn", "fwd", 1.0, 100), _row("varlen_attn", "fwd_bwd", 0.999, 120)]
    res = {t["target"]: t for t in targets.evaluate(rows)}
    every_bwd = res["attention fwd_bwd: ours at least as fast as varlen_attn on every shape"]
    every_fwd = res["attention fwd: ours at least as fast as varlen_attn on every shape"]
    assert every_bwd["status"] == "MISS" and every_fwd["status"] == "PASS"  # equal time passes, 0.1% slower misses
    mem = res["peak memory: ours <= the fastest peer's on every row (every kind, fwd and fwd_bwd)"]
    assert mem["status"] == "PASS"  # equal memory passes
    geo = res["attention fwd_bwd: geomean speedup over varlen_attn >= 1.5x over paper + recsys"]
    assert geo["status"] == "INCOMPLETE"  # recsys not measured
    head = [_row(p, "fwd_bwd", ms, pk, shape_id=targets.HEADLINE) for p, ms, pk in
            (("jagged", 1.0, 100), ("dense_torch", 9.0, 2200), ("sdpa_padded_mask", 3.0, 210))]
    res = {t["target"]: t for t in targets.evaluate(head)}
    dense = next(v for k, v in res.items() if "fwd_bwd vs dense_torch" in k)
    sdpa = next(v for k, v in res.items() if "fwd_bwd vs sdpa_padded_mask" in k)
    assert dense["status"] == "PASS"
    assert sdpa["status"] == "MISS"  # 100 MiB is 52.4% less than 210, not 53%


def test_memory_is_judged_against_the_fastest_peer_of_each_row():
    """A slower peer's smaller footprint does not count; the fastest peer's does, one byte over misses."""
    rows = [_row("jagged", "fwd", 1.0, 100), _row("flex_packed", "fwd", 5.0, 50), _row("varlen_attn", "fwd", 0.9, 100)]
    mem = {t["target"]: t for t in targets.evaluate(rows)}["peak memory: ours <= the fastest peer's on every row "
                                                             "(every kind, fwd and fwd_bwd)"]
    assert mem["status"] == "PASS"
    rows[2] = _row("varlen_attn", "fwd", 0.9, 99)
    mem = {t["target"]: t for t in targets.evaluate(rows)}["peak memory: ours <= the fastest peer's on every row "
                                                             "(every kind, fwd and fwd_bwd)"]
    assert mem["status"] == "MISS" and "vs varlen_attn" in mem["detail"]
    rows[0] = dict(rows[0], status="OOM", ms=None, peak_bytes=None)  # ours without a time: over, as before
    mem = {t["target"]: t for t in targets.evaluate(rows)}["peak memory: ours <= the fastest peer's on every row "
                                                             "(every kind, fwd and fwd_bwd)"]
    assert mem["status"] == "MISS" and "(ours: no time)" in mem["detail"]


def test_target_attention_is_judged_against_sdpa_and_varlen_at_every_tq():
    rows = []
    for tq in (1, 16, 64):
        sid = f"{targets.HEADLINE}-Tq{tq}"
        rows += [_row("jagged", "fwd_bwd", 1.0, 10, shape_id=sid, kind="dense_attention"),
                 _row("sdpa_padded_mask", "fwd_bwd", 3.0, 20, shape_id=sid, kind="dense_attention"),
                 _row("varlen_attn", "fwd_bwd", 1.5 if tq != 16 else 1.49, 20, shape_id=sid, kind="dense_attention")]
    res = {t["target"]: t for t in targets.evaluate(rows)}
    sdpa = next(v for k, v in res.items() if k.startswith("dense_attention fwd_bwd: >= 3x faster than sdpa_padded_mask"))
    varlen = next(v for k, v in res.items() if k.startswith("dense_attention fwd_bwd: >= 1.5x faster than varlen_attn"))
    assert sdpa["status"] == "PASS" and varlen["status"] == "MISS" and "Tq=16 1.49x" in varlen["detail"]
    by_kernels = {k: v for k, v in res.items() if k.endswith(targets.BY_KERNELS)}
    assert {v["status"] for v in by_kernels.values()} == {"N/A"}  # no --graph-ms
    assert sum(k.startswith("dense_attention") for k in by_kernels) == 2
    for r in rows:  # host-bound calls: ours' kernels take a third of its call, the peers' all of theirs
        r["gpu_ms"] = r["ms"] / 3 if r["provider"] == "jagged" else r["ms"]
    res = {t["target"]: t for t in targets.evaluate(rows)}
    varlen_k = next(v for k, v in res.items() if k.startswith("dense_attention fwd_bwd: >= 1.5x faster than varlen_attn")
                    and k.endswith("CUDA-graph replay)"))
    assert varlen_k["status"] == "PASS" and "Tq=16 4.47x" in varlen_k["detail"]


def test_self_attention_and_bmm_targets_also_judged_by_the_kernels_alone():
    """Each call-time target has a twin by the kernels' time; neither relaxes the other, and a
    shape ours has no kernel time for is a miss, not a pass."""
    rows = [_row("jagged", "fwd_bwd", 1.0, 10, shape_id="A"), _row("varlen_attn", "fwd_bwd", 0.9, 10, shape_id="A"),
            _row("jagged", "fwd_bwd", 1.0, 10, shape_id="B", suite="recsys"),
            _row("varlen_attn", "fwd_bwd", 2.0, 10, shape_id="B", suite="recsys")]
    for r, g in zip(rows, (0.5, 0.9, 0.5, 1.2)):
        r["gpu_ms"] = g
    res = {t["target"]: t for t in targets.evaluate(rows)}
    every = "attention fwd_bwd: ours at least as fast as varlen_attn on every shape"
    assert res[every]["status"] == "MISS" and res[every + targets.BY_KERNELS]["status"] == "PASS"
    geo = "attention fwd_bwd: geomean speedup over varlen_attn >= 1.5x over paper + recsys"
    assert res[geo]["status"] == "MISS" and res[geo + targets.BY_KERNELS]["detail"].startswith("2.078x over 2 shapes")
    rows[0]["gpu_ms"] = None  # ours without a kernel time where the peer has one
    res = {t["target"]: t for t in targets.evaluate(rows)}
    assert res[every + targets.BY_KERNELS]["status"] == "MISS" and "paper/A ours failed" in res[every + targets.BY_KERNELS]["detail"]
    bmm = [dict(_row(p, "fwd", ms, 1, shape_id=f"S{d}", kind="ops"), op="jagged_jagged_bmm", gpu_ms=g,
                shape={"density": d, "tags": []})
           for d in (0.1, 0.5) for p, ms, g in (("jagged", 0.1 if d < 0.5 else 0.15, 0.05), ("torch_padded", 0.12, 0.06))]
    res = {t["target"]: t for t in targets.evaluate(bmm)}
    name = "ops jagged_jagged_bmm: >= padded torch.bmm at every density, faster below 0.5"
    assert res[name]["status"] == "MISS" and res[name]["detail"].endswith("short at paper/S0.5")
    assert res[name + targets.BY_KERNELS]["status"] == "PASS"


def test_floor_table_sets_the_kernels_alone_beside_the_call():
    from experiments.bench import floors

    shape = {"B": 2, "N": 8, "H": 1, "D": 4, "Tq": 1}
    row = {"kind": "dense_attention", "suite": "paper", "shape_id": "S", "provider": "jagged", "status": "ok",
           "shape": shape, "tokens": 10, "mode": "fwd_bwd", "flops": 560, "ms": 0.003, "gpu_ms": 0.0012}
    ceilings = {"copy_gbps": 1.0, "matmul_tflops": 1.0}  # floor: 592 bytes at 1 GB/s = 0.000592 ms
    lines = floors.floor_table([row, dict(row, shape_id="T", gpu_ms=None)], ceilings, "bf16")
    assert "| dense_attention | paper | S | fwd+bwd | 0.003 | 0.000592 | bytes | 5.07x | 0.0012 | 2.03x |" in lines
    assert "| dense_attention | paper | T | fwd+bwd | 0.003 | 0.000592 | bytes | 5.07x | - | - |" in lines


def test_attention_floor_is_the_larger_of_bytes_and_flops_per_pass():
    """Target attention B2 Tq1 H1 D4 over 10 keys in bf16: forward bytes 2*(2*8 + 2*40) + 4*2 = 200,
    backward 2*(4*8 + 4*40) + 8 = 392; FLOPs forward 4*1*4*1*10 = 160, backward 400."""
    from experiments.bench import floors

    shape = {"B": 2, "N": 8, "H": 1, "D": 4, "Tq": 1}
    assert floors.pass_bytes("dense_attention", shape, 10, 2) == (200, 392)
    row = {"kind": "dense_attention", "shape": shape, "tokens": 10, "mode": "fwd_bwd", "flops": 160 * 3.5}
    # copy 1 GB/s: bytes take 200e-9 s + 392e-9 s; matmul 1e-4 TFLOP/s (1e8 FLOP/s): 1.6e-6 s + 4e-6 s
    ms, bound = floors.floor_ms(row, {"copy_gbps": 1.0, "matmul_tflops": 1e-4}, 2)
    assert ms == pytest.approx((1.6e-6 + 4e-6) * 1e3) and bound == "FLOPs"
    ms, bound = floors.floor_ms(row, {"copy_gbps": 1.0, "matmul_tflops": 1.0}, 2)
    assert ms == pytest.approx((200 + 392) * 1e-9 * 1e3) and bound == "bytes"
    assert floors.floor_ms(dict(row, mode="fwd", flops=160), {"copy_gbps": 1.0, "matmul_tflops": 1.0}, 2)[0] \
        == pytest.approx(200e-9 * 1e3)
    assert floors.floor_ms(row, {}, 2) is None and floors.floor_ms(dict(row, kind="ops"), {"copy_gbps": 1.0,
                                                                                           "matmul_tflops": 1.0}, 2) is None


def test_kernel_time_beside_call_time(monkeypatch):
    """--graph-ms: each row also timed as a CUDA-graph replay; the report sets ours against each peer
    both ways (a speedup by call but not by kernels is host time), and a call that cannot be
    captured keeps its call time with gpu_ms None and the reason."""
    from experiments.bench import report
    from experiments.bench.base import RunConfig

    rows = [dict(_row("jagged", "fwd_bwd", 0.81, 1), gpu_ms=0.30), dict(_row("varlen_attn", "fwd_bwd", 0.76, 1), gpu_ms=0.45),
            dict(_row("njt_sdpa", "fwd_bwd", 9.9, 1), gpu_ms=None), _row("jagged", "fwd", 0.1, 1)]
    lines = report.graph_table(rows)
    assert "| attention | paper | B8-N64-H2-D64-d0.25 | fwd_bwd | varlen_attn | 0.81 / 0.3 | 0.76 / 0.45 | 0.94x | 1.50x |" \
        in lines
    assert not any("njt_sdpa" in ln for ln in lines) and report.graph_table(rows[3:]) == []

    def uncapturable(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "graph_ms", uncapturable)
    got = runner._graph_time(lambda: None, RunConfig(device=torch.device("cpu"), graph_ms=True), [])
    assert got["gpu_ms"] is None and got["gpu_ms_error"].startswith("RuntimeError: operation not permitted")
    assert measure.graph_ms(lambda: None, torch.device("cpu"), 10.0) is None  # no graphs off CUDA
    # every row's graphs are let go, timed or not: cached graph pools filled the H200 in a paper run
    freed = []
    monkeypatch.setattr(runner, "free_memory", freed.append)
    monkeypatch.setattr(runner, "graph_ms", lambda *a, **k: 0.25)
    assert runner._graph_time(lambda: None, RunConfig(device=torch.device("cpu"), graph_ms=True), [])["gpu_ms"] == 0.25
    monkeypatch.setattr(runner, "graph_ms", uncapturable)
    runner._graph_time(lambda: None, RunConfig(device=torch.device("cpu"), graph_ms=True), [])
    assert freed == [torch.device("cpu")] * 2
    # a failed capture keeps its pool for the rest of the process: calls that cannot be captured
    # (a host sync) or that could exhaust memory are never tried
    assert runner.too_large_to_capture(1 << 30, 100 << 30) is None and runner.too_large_to_capture(None, 0) is None
    assert runner.too_large_to_capture(40 << 30, 99 << 30).startswith("not captured: one call needs 40.0 GiB, 99.0 GiB")
    prep = Prepared(lambda: torch.ones(3), [], [], lambda o: o)
    row = runner._time_mode(prep, "fwd", RunConfig(device=torch.device("cpu"), graph_ms=True, warmup_ms=0, rep_ms=1),
                            no_graph="not captured: a host sync")
    assert row["status"] == "ok" and row["gpu_ms"] is None and row["gpu_ms_error"] == "not captured: a host sync"
    njt = next(p for p in runner.ATTENTION_PROVIDERS if p.name == "njt_sdpa")
    assert njt.no_graph and all(p.no_graph is None for p in runner.ATTENTION_PROVIDERS if p is not njt)


def test_compare_two_runs_of_ours(tmp_path, capsys):
    """experiments.bench.compare: per row new / base of ours, a row slower than the noise is a MISS, and so
    is a lower geometric mean over varlen_attn; another GPU's file is refused."""
    from experiments.bench import compare

    stamp = {"gpu": "GPU X", "gpu_slug": "x", "torch": "2.11", "triton": "3.6", "cuda": "13", "commit": "a",
             "date": "d"}

    def doc(ours_ms, varlen_ms, table):
        rows = [dict(_row("jagged", "fwd_bwd", ms, 1, shape_id=f"S{i}"), ours_speedup=1.0) for i, ms in enumerate(ours_ms)]
        rows += [dict(_row("varlen_attn", "fwd_bwd", v, 1, shape_id=f"S{i}"), ours_speedup=v / o)
                 for i, (o, v) in enumerate(zip(ours_ms, varlen_ms))]
        return {"stamp": dict(stamp, launch_table=table), "rows": rows}

    paths = {}
    for name, d in {"base": doc([1.0, 2.0], [1.5, 3.0], "none (hand rules)"),
                    "same": doc([1.04, 1.9], [1.5, 3.0], "x.json: 9 entries"),
                    "slow": doc([1.2, 1.5], [1.5, 3.0], "x.json: 9 entries")}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(d))
    assert compare.main([str(paths["base"]), str(paths["same"]), "--out", str(tmp_path / "c.md")]) == 0
    md = (tmp_path / "c.md").read_text()
    # a gzipped result file (the committed pairs are) reads as the file itself
    gz = tmp_path / "same.json.gz"
    gz.write_bytes(gzip.compress(paths["same"].read_bytes()))
    assert compare.main([str(paths["base"]), str(gz), "--out", str(tmp_path / "c-gz.md")]) == 0
    assert (tmp_path / "c-gz.md").read_text() == md.replace("same.json", "same.json.gz")
    assert "launch table none (hand rules)" in md and "launch table x.json: 9 entries" in md
    assert "| 0 of 2 rows slower" in md and "(paper; 2 shapes timed in both) | base 1.500x, new 1.509x " \
        "(by the kernels' time: base -, new -) | PASS |" in md
    # a shape one run did not reach stays out of both geomeans (a deadline cut one run short)
    longer = doc([1.0, 2.0, 1.0], [1.5, 3.0, 9.0], "none (hand rules)")
    lines, ok = compare.compare(dict(longer, _file="b"), compare._load(str(paths["same"])), 0.05)
    assert ok and "(paper; 2 shapes timed in both) | base 1.500x, new 1.509x" in lines[-1]
    lines, ok = compare.compare(compare._load(str(paths["base"])), compare._load(str(paths["slow"])), 0.05)
    assert not ok and "| attention | paper |  | S0 | fwd_bwd | 1 | 1.2 | 1.200 **slower** | - |" in lines
    # where both runs timed the kernels alone, a row is judged by them: host time moves, kernels do not
    def with_kernels(d, kernel_ms):
        for r, k in zip((r for r in d["rows"] if r["provider"] == "jagged"), kernel_ms):
            r["gpu_ms"] = k
        return d

    kb = compare._load(str(paths["base"]))
    lines, ok = compare.compare(with_kernels(kb, [0.5, 1.0]),
                                with_kernels(compare._load(str(paths["slow"])), [0.5, 1.2]), 0.05)
    assert not ok and "| attention | paper |  | S0 | fwd_bwd | 1 | 1.2 | 1.200 | 1.000 |" in lines  # host noise
    assert "| attention | paper |  | S1 | fwd_bwd | 2 | 1.5 | 0.750 | 1.200 **slower** |" in lines
    assert any("| 1 of 2 rows slower (2 judged by the kernels' time, geometric mean new / base 1.095" in x
               for x in lines)
    ops_only = compare._load(str(paths["base"]))  # no attention row: the geomean verdict does not apply
    for r in ops_only["rows"]:
        r["kind"] = "ops"
    lines, ok = compare.compare(ops_only, ops_only, 0.05)
    assert ok and lines[-1].endswith("(-; 0 shapes timed in both) | base -, new - (by the kernels' time: base -, new -) | N/A |")
    # several runs a side (comma-separated): each row's times are their median, every run's geomean is printed
    paths["same2"] = tmp_path / "same2.json"
    paths["same2"].write_text(json.dumps(doc([1.2, 1.9], [1.5, 3.0], "x.json: 9 entries")))
    assert compare.main([str(paths["base"]), f"{paths['same']},{paths['same2']},{paths['same']}",
                         "--out", str(tmp_path / "c3.md")]) == 0
    md3 = (tmp_path / "c3.md").read_text()
    assert f"- new: 3 runs ({tmp_path.name}/same.json, {tmp_path.name}/same2.json, {tmp_path.name}/same.json)" in md3
    assert "| attention | paper |  | S0 | fwd_bwd | 1 | 1.04 | 1.040 | - |" in md3  # median of 1.04, 1.2, 1.04
    assert "Each run's geomean over varlen_attn by call: base 1.500x; new 1.509x, 1.405x, 1.509x" in md3
    assert compare.main([str(paths["base"]), f"{paths['same']},{paths['base']}"]) == 2  # hand and table mixed
    assert "must share their GPU and launch table" in capsys.readouterr().err
    other = json.loads(paths["same"].read_text())
    other["stamp"]["gpu_slug"] = "y"
    paths["same"].write_text(json.dumps(other))
    assert compare.main([str(paths["base"]), str(paths["same"])]) == 2
    assert "different GPUs" in capsys.readouterr().err


def test_force_runs_the_bench_under_a_forced_launch_config_and_stamps_it(tmp_path, monkeypatch, capsys):
    """--force FAMILY:KEY=VALUE: every launch of the family takes the keys during the run (the
    launch-config A/B through the bench itself), the result file says so; bad specs exit 2."""
    from kernels import _launch_configs

    seen = []

    def fake_run_kind(kind, suite, cfg, on_shape):
        seen.append({f: dict(c) for f, c in _launch_configs._forced.items()})
        return []

    monkeypatch.setattr(runner, "run_kind", fake_run_kind)
    out = tmp_path / "r.json"
    argv = ["dense_attention", "--suite", "smoke", "--device", "cpu", "--out", str(out), "--warmup", "0", "--rep", "1",
            "--no-report", "--force", "dense_bwd:SPLIT_DQ=0,M_KV=32", "--force", "softmax_fwd:SMALL_N=16"]
    assert main(argv) == 0
    assert seen == [{"dense_bwd": {"SPLIT_DQ": 0, "M_KV": 32}, "softmax_fwd": {"SMALL_N": 16}}]
    assert _launch_configs._forced == {}  # given back after the run
    doc = json.loads(out.read_text())
    assert doc["config"]["force"] == {"dense_bwd": {"SPLIT_DQ": 0, "M_KV": 32}, "softmax_fwd": {"SMALL_N": 16}}
    assert doc["stamp"]["launch_table"].endswith("+ forced dense_bwd SPLIT_DQ=0,M_KV=32; softmax_fwd SMALL_N=16")
    for bad, words in (("nope:X=1", "unknown kernel family 'nope'"), ("dense_bwd:SPLIT=1", "'SPLIT=1' is not KEY=integer"),
                       ("dense_bwd:SPLIT_DQ=yes", "is not KEY=integer"), ("dense_bwd", "no KEY=VALUE")):
        with pytest.raises(SystemExit) as exc:
            main(["dense_attention", "--device", "cpu", "--force", bad])
        assert exc.value.code == 2 and words in capsys.readouterr().err


def test_every_bench_and_tuning_verb_answers_help_without_the_heavy_imports():
    """`python -m experiments <verb> --help` for the harness and tuning verbs: exit status 0, and
    neither the kernels (Triton) nor scikit-learn, matplotlib, MLflow, Lightning or polars imported."""
    import os
    import subprocess
    import sys

    verbs = ("bench", "bench-compare", "bench-s2", "gpu-check", "config-sweep", "costmodel")
    heavy = ("sklearn", "matplotlib", "mlflow", "lightning", "pytorch_lightning", "polars", "triton", "kernels")
    code = ("import sys\nfrom experiments.__main__ import main\n"
            f"for verb in {verbs!r}:\n"
            "    try:\n        main([verb, '--help'])\n        sys.exit(f'{verb}: --help did not exit')\n"
            "    except SystemExit as e:\n        assert e.code == 0, (verb, e.code)\n"
            f"    print(verb, sorted(m for m in {heavy!r} if m in sys.modules))\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in verbs]
    assert said == [f"{verb} []" for verb in verbs], proc.stdout[-2000:]


def _packed_sdpa(q, k, v, *, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, return_lse):
    """cuDNN's sdpa_torch on packed tokens, done in torch: what the provider must call it with."""
    assert return_lse and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert max_seqlen_kv == int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max()) and cu_seqlens_q.dtype == torch.int32
    out = torch.cat([torch.softmax(qs.transpose(0, 1) @ ks.permute(1, 2, 0) * q.shape[-1] ** -0.5, -1) @ vs.transpose(0, 1)
                     for qs, ks, vs in zip(q.tensor_split(cu_seqlens_q[1:-1].tolist()),
                                           *(t.tensor_split(cu_seqlens_kv[1:-1].tolist()) for t in (k, v)))], dim=1)
    return out.transpose(0, 1), None


@pytest.mark.parametrize("kind", ["attention", "dense_attention"])
def test_cudnn_varlen_is_called_on_packed_tokens_and_skipped_where_it_cannot_run(monkeypatch, kind):
    """The cuDNN peer's arguments (cu_seqlens, max lengths, its differentiable path), checked
    against the reference with a stand-in for the wheel; without the wheel or CUDA: a reason."""
    import sys
    import types

    from experiments.bench import providers

    j = layouts.make_jagged(Shape(5, 24, 2, 16, 0.5, Tq=3), torch.device("cpu"), torch.float32)
    cpu = RunConfig(device=torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "cudnn", None)
    assert providers.cudnn_skip(j, cpu) == "unavailable (nvidia-cudnn-frontend is not installed)"
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(sdpa_torch=_packed_sdpa))
    assert providers.cudnn_skip(j, cpu) == "unavailable (CUDA only)"
    table = providers.DENSE_ATTENTION_PROVIDERS if kind == "dense_attention" else providers.ATTENTION_PROVIDERS
    (peer,) = [p for p in table if p.name == "cudnn_varlen"]
    prep = peer.prepare(j, cpu)
    ref = layouts.reference_dense_attention(j) if kind == "dense_attention" else layouts.reference_self_attention(j)
    torch.testing.assert_close(prep.to_ref(prep.fwd()), ref.to(torch.float32), rtol=1e-5, atol=1e-5)
