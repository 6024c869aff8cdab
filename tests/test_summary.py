"""experiments.summary: REPORT.md from committed result files only (JSON: report.json, the kernel
benchmarks' result files, profiles, reproductions)."""

from __future__ import annotations

import json

import yaml

from experiments import summary
from experiments.bench.targets import HEADLINE

MIB = 2**20


def _bench(root, slug: str, date: str, peers: dict[str, tuple[float, float]]) -> None:
    """A kernel benchmark result file of GPU `slug`: ours (1 ms, 1 MiB) and each peer's (ms, MiB) at the
    headline shape, fwd+bwd."""
    rows = [{"kind": "attention", "suite": "paper", "shape_id": HEADLINE, "op": None, "provider": p, "mode": "fwd_bwd",
             "status": "ok", "ms": ms, "peak_bytes": mib * MIB, "shape": {}}
            for p, (ms, mib) in {"jagged": (1.0, 1.0), **peers}.items()]
    doc = {"schema": "jagged-bench/1", "stamp": {"gpu_slug": slug, "gpu": f"GPU {slug}", "date": date},
           "ceilings": {}, "config": {}, "rows": rows}
    (root / "kernels" / slug).mkdir(parents=True, exist_ok=True)
    (root / "kernels" / slug / f"bench-{slug}.json").write_text(json.dumps(doc))


def _report(root, name: str, rows: list[dict], budget: dict | None = None, targets=(), **facts) -> None:
    folder = root / "ablations" / name / "x"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({
        "name": name, "device": ["GPU X"], "commit": ["abc1234"], "budget": budget or {},
        "command": f"python -m experiments sweep experiments/ablations/{name}.yaml", "written": "2026-01-01T00:00:00",
        "targets": [list(t) for t in targets], "rows": rows, **facts}))


def _current(name: str) -> dict:
    return yaml.safe_load((summary.ABLATIONS / f"{name}.yaml").read_text())["set"]


BATCH_ROWS = [{"status": "OK", "batch_size": "512", "attention": "jagged", "perf/train_examples_per_s": 3000.0,
               "mem/train_peak_allocated_mb": 1000.0},
              {"status": "OK", "batch_size": "512", "attention": "sdpa", "perf/train_examples_per_s": 1000.0,
               "mem/train_peak_allocated_mb": 2500.0},
              {"status": "OOM", "batch_size": "512", "attention": "dense", "perf/train_examples_per_s": None,
               "mem/train_peak_allocated_mb": None}]
TARGET = ("batch_size=512: jagged vs sdpa", "train ex/s ratio 3.00x", ">= 2.5x", "PASS")
LINK = "ablations/batch_size/x/report.md"


def _results(tmp_path, budget: dict):
    _bench(tmp_path, "x", "2026-01-01", {"dense_torch": (50.0, 25.0), "sdpa_padded_mask": (2.5, 3.0)})
    _report(tmp_path, "batch_size", BATCH_ROWS, budget, [TARGET])  # no accelerator column: targets as written
    (tmp_path / "training" / "x").mkdir(parents=True)
    (tmp_path / "training" / "x" / "profile_x.json").write_text(json.dumps({"device": "GPU X", "commit": "abc1234", "results": [
        {"attention": "jagged", "batch_size": 512, "graph_step_ms": 10.0, "gpu_ms": 10.0, "attn_ms": 1.0},
        {"attention": "sdpa", "batch_size": 512, "graph_step_ms": 30.0, "gpu_ms": 30.0, "attn_ms": 8.0}]}))
    return tmp_path


def test_summary_quotes_sources_marks_missing_and_stale(tmp_path):
    text = summary.build(_results(tmp_path, _current("batch_size")))
    assert "fwd+bwd PASS: speed 50.00x" in text and "fwd+bwd MISS: speed 2.50x" in text
    assert "| 512 | 3,000 | 1,000 | 3.00x | 1,000 | 2,500 | 0.40x |" in text
    assert f"| [batch_size]({LINK}) | batch_size=512: jagged vs sdpa: >= 2.5x | train ex/s ratio 3.00x | PASS |" in text
    assert f"| [batch_size]({LINK}) | GPU X | `abc1234` | 2 OK, 1 OOM | current |" in text
    for name in ("seq_len", "sparsity", "compile", "auc_parity", "history_value", "model", "reproduce"):
        assert f"| {name} | NOT RUN |" in text
    assert "| profile | GPU X | abc1234 | batch 512 |" in text
    (tmp_path / "training" / "x" / "reproduce.json").write_text(json.dumps({"device": "GPU X", "result": "NOT REPRODUCED"}))
    assert "| [reproduce](training/x/reproduce.json) | GPU X | - | one run | NOT REPRODUCED |" in summary.build(tmp_path)
    # 20 ms saved: 7 in attention, 13 outside; attention free would make jagged at most 10/9 faster
    assert "Of the 20.0 ms saved per step, 7.0 ms are in attention and 13.0 ms outside it" in text
    assert "at most 1.11x faster" in text


def test_loop_traces_count_as_profiles(tmp_path):
    """`make profile` (the training loop's trace, one folder per layout) is read like the one-step profiles."""
    for attention, busy, attn in (("jagged", 10.0, 1.0), ("sdpa", 30.0, 8.0)):
        folder = tmp_path / "training" / "x" / "profile-paper" / attention
        folder.mkdir(parents=True)
        (folder / "loop_summary.json").write_text(json.dumps({
            "attention": attention, "device_name": "GPU X", "commit": "abc1234", "batch_size": 512,
            "wall_ms_per_step": busy + 1, "device_busy_ms_per_step": busy, "attention_ms_per_step": attn}))
    text = summary.build(tmp_path)
    assert "| training/x/profile-paper | GPU X | 512 | jagged | - | 10.00 | 1.00 | 10% |" in text
    assert "Of the 20.0 ms saved per step, 7.0 ms are in attention and 13.0 ms outside it" in text


def test_a_report_from_another_budget_is_marked_stale(tmp_path):
    current = _current("batch_size")
    text = summary.build(_results(tmp_path, {**current, "trainer.max_steps": 100}))
    assert "stale: trainer.max_steps: ran 100, file 300" in text
    assert f"[batch_size]({LINK}) (stale)" in text
    # a key the file no longer sets is stale too, unless the sweep's command gave it with --set
    gone = {"budget": {**current, "trainer.limit_train_batches": 1000, "data.num_workers": 4}, "command": "x"}
    assert summary.budget_state("batch_size", gone) == ("stale: trainer.limit_train_batches: ran 1000, file: not set; "
                                                        "data.num_workers: ran 4, file: not set")
    given = {**gone, "command": "python -m experiments sweep x.yaml --set data.num_workers=4"}
    assert summary.budget_state("batch_size", given) == "stale: trainer.limit_train_batches: ran 1000, file: not set"


def test_a_report_of_data_from_other_generator_settings_is_stale():
    from data_gen.config import resolve_config

    world = resolve_config("paper", {}).to_dict()  # batch_size.yaml's dataset: {preset: paper}
    doc = {"budget": _current("batch_size"), "command": "x", "data": world}
    assert summary.budget_state("batch_size", doc) == "current"
    old = {**world, "cand_motif": 0.1, "w_item": 1.0}  # the paper preset's world before it changed
    assert summary.budget_state("batch_size", {**doc, "data": old}) == "stale: data: 2 generator settings (cand_motif, w_item)"
    old |= {"alpha": 0.5, "noise": 9.0, "bias": 3.0}
    assert summary.budget_state("batch_size", {**doc, "data": old}) == ("stale: data: 5 generator settings (alpha, noise, "
                                                                       "cand_motif, bias, ...)")


def test_main_writes_the_file_only_when_it_changes_and_rejects_a_missing_folder(tmp_path, capsys):
    assert summary.main(["--results", str(tmp_path / "nope")]) == 2
    assert "no results folder" in capsys.readouterr().err
    assert summary.main(["--results", str(tmp_path)]) == 0
    out = tmp_path / "REPORT.md"
    assert out.read_text().startswith("# Jagged Flash Attention")
    before = out.stat().st_mtime_ns
    assert summary.main(["--results", str(tmp_path)]) == 0  # nothing changed: not rewritten
    assert out.stat().st_mtime_ns == before and "up to date" in capsys.readouterr().out


def test_targets_are_judged_as_the_ablation_file_states_them_now(tmp_path):
    """A target changed in the file since the report was written: the summary judges the report's
    rows against the file's targets with the report's own function, and says so."""
    _results(tmp_path, _current("batch_size"))
    rows = [{**r, "tag.accelerator": "cuda"} for r in BATCH_ROWS]
    rows[0]["perf/train_examples_per_s"] = 2200.0
    _report(tmp_path, "batch_size", rows, _current("batch_size"),
            [("batch_size=512: jagged vs sdpa", "train ex/s ratio 2.20x", ">= 2.0x", "PASS")])
    text = summary.build(tmp_path)
    tag = f"[batch_size]({LINK}) (targets as the file states them now)"
    assert f"| {tag} | batch_size=512: jagged vs sdpa: >= 2.5x | train ex/s ratio 2.20x | MISS |" in text
    assert f"| {tag} | batch_size=512: jagged vs sdpa: <= 0.5x | peak memory ratio 0.40x | PASS |" in text
    assert f"| {tag} | batch_size=2048: jagged vs sdpa: - | - | NOT MEASURED (missing) |" in text
    assert ">= 2.0x" not in text


def test_a_partial_kernels_run_adds_to_a_full_one_instead_of_hiding_it(tmp_path):
    """Each kernel target comes from the last GPU's results that measured it: one that ran a part (its
    other targets N/A) replaces only the rows it measured, and each row names its report."""
    _bench(tmp_path, "a", "2026-01-01", {"dense_torch": (50.0, 25.0), "sdpa_padded_mask": (2.5, 3.0)})
    _bench(tmp_path, "b", "2026-01-02", {"sdpa_padded_mask": (3.5, 3.0)})
    rows = {r[0].split(" vs ")[1].split(":")[0]: r for r in summary.kernel_targets(tmp_path) if r[0].startswith("headline")
            and "fwd_bwd" in r[0]}
    assert rows["dense_torch"][1:] == ["PASS", "speed 50.00x (1 vs 50 ms), memory 25.00x less (ours 1 MiB, dense_torch "
                                       "25 MiB)", "kernels/a/report.md"]
    assert rows["sdpa_padded_mask"][1:] == ["PASS", "speed 3.50x (1 vs 3.5 ms), memory 3.00x less (ours 1 MiB, "
                                            "sdpa_padded_mask 3 MiB)", "kernels/b/report.md"]
    text = summary.build(tmp_path)
    assert f"[kernels/a/report.md](kernels/a/report.md) | headline {HEADLINE} fwd_bwd vs dense_torch" in text
    assert f"[kernels/b/report.md](kernels/b/report.md) | headline {HEADLINE} fwd_bwd vs sdpa_padded_mask" in text


def test_the_seeds_other_systems_are_listed_once_they_have_run(tmp_path):
    results = _results(tmp_path, _current("batch_size"))
    assert "| s2 | NOT RUN" not in summary.build(results) and "[alure]" not in summary.build(results)
    _report(results, "alure", [{"status": "OK", "variant": "short"}])
    assert "| [alure](ablations/alure/x/report.md) | GPU X | `abc1234` |" in summary.build(results)


def test_jagged_is_judged_against_each_peer_at_its_fastest_step(tmp_path):
    """The compile ablation gives every layout its fastest step; a peer that compiles faster than
    it runs eagerly is judged at its compiled speed, and the 2.5x target can fail there."""
    _report(tmp_path, "compile", [
        {"status": s, "step": step, "attention": a, "perf/train_examples_per_s": x, "mem/train_peak_allocated_mb": m}
        for s, step, a, x, m in (("OK", "eager", "jagged", 3000.0, 1000.0), ("OK", "graphs", "jagged", 5000.0, 900.0),
                                 ("OK", "eager", "sdpa", 1500.0, 2000.0), ("OK", "compiled", "sdpa", 2500.0, 1900.0),
                                 ("OOM", "compiled", "dense", None, None), ("OK", "eager", "dense", 500.0, 9000.0))])
    text = summary.build(tmp_path)
    assert "| sdpa | compiled | 2,500 | 1,900 | 2.00x |" in text and "| jagged | graphs | 5,000 | 900 | 1.00x |" in text
    assert ("| [compile](ablations/compile/x/report.md) | jagged (graphs) vs sdpa at its fastest step (compiled): "
            ">= 2.5x | train ex/s ratio 2.00x (5,000 vs 2,500) | MISS |") in text
    assert "jagged (graphs) vs dense at its fastest step (eager): >= 2.5x | train ex/s ratio 10.00x" in text


def test_history_and_architecture_sections_read_their_reports(tmp_path):
    assert "No history_value results" in summary.build(tmp_path) and "No model ablation yet" in summary.build(tmp_path)
    oracle = {"auc": 0.86, "auc_recent_0": 0.6, "auc_recent_64": 0.75, "auc_recent_1024": 0.85, "longest_history": 4096}
    _report(tmp_path, "history_value", [{"status": s, "max_seq_len": k, "test/auc": a} for s, k, a in (
        ("OK", "64", 0.70), ("OK", "1024", 0.72), ("OK", "1024", 0.74), ("OK", "4096", 0.725), ("OOM", "8192", None))],
            oracle=oracle)  # two seeds at 1024: their mean, 0.73
    _report(tmp_path, "model", [{"status": s, "variant": v, "test/auc": a} for v, s, a in (
        ("baseline", "OK", 0.75), ("layers_0", "OK", 0.76), ("dim_256", "FAILED", None))])
    text = summary.build(tmp_path)
    assert "| 1024 | 0.7300 | +0.0300 | 0.8500 | +0.1000 |" in text and "| 8192 | - | - | 0.8600 | +0.0000 |" in text
    assert "highest at max_seq_len 1024 (0.7300), +0.0300 over 64; at 4096 it is -0.0050 against that" in text
    assert "(the oracle's own gain there: +0.0100)" in text
    assert "| layers_0 | 1 | 0.7600 | +0.0100 |" in text and "dim_256" not in text  # finished runs only
    _report(tmp_path, "world_order", [{"status": s, "variant": v, "test/auc": a} for v, s, a in (
        ("baseline", "OK", 0.80), ("baseline", "OK", 0.82), ("no_self_attention", "OK", 0.78))])
    text = summary.build(tmp_path)  # the paper preset's world, over its seeds, in place of the model ablation
    assert "| baseline | 2 | 0.8100 | baseline |" in text and "| no_self_attention | 1 | 0.7800 | -0.0300 |" in text
    assert "layers_0" not in text
    _report(tmp_path, "order_peak", [{"status": "OK", "variant": v, "seed_everything": seed, "test/auc": a}
                                     for v, seed, a in (("baseline", "0", 0.80), ("baseline", "1", 0.84),
                                                        ("sdpa", "0", 0.79), ("sdpa", "1", 0.83), ("dense", "1", 0.83))])
    text = summary.build(tmp_path)  # each variant against the baseline's runs of the same seeds
    assert "| sdpa | 2 | 0.8100 | -0.0100 |" in text and "| dense | 1 | 0.8300 | -0.0100 |" in text


def test_the_points_column_counts_failed_runs_whatever_their_reason(tmp_path):
    root = _results(tmp_path, _current("batch_size"))
    _report(root, "batch_size", [{"status": s, "batch_size": "512", "attention": a}
                                 for s, a in (("OK", "jagged"), ("FAILED: exit 1", "sdpa"), ("FAILED: killed", "dense"))])
    (row,) = [r for r in summary.ablation_status(root) if r["name"] == "batch_size"]
    assert row["points"] == "1 OK, 2 FAILED"
