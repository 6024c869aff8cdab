"""experiments.summary: REPORT.md from committed result files only."""

from __future__ import annotations

import json

from experiments import summary

KERNELS = """# Kernel benchmarks on GPU X

## Targets

| target | status | measured |
|---|---|---|
| headline S fwd_bwd vs dense_torch: >= 9x faster and 22x less memory | **PASS** | speed 50x |
| headline S fwd_bwd vs sdpa_padded_mask: >= 3x faster and 53% less memory | **MISS** | speed 2.5x |
"""

REPORT = """# Ablation `batch_size`

- device: `GPU X`; torch `2.11`
- git commit: `abc1234`
- budget and overrides of every run: `{budget}`

## Targets

| point | measured | target | result |
|---|---|---|---|
| batch_size=512: jagged vs sdpa | train ex/s ratio 3.00x | >= 2.5x | PASS |
"""


def _results(tmp_path, budget: dict):
    (tmp_path / "kernels-x.md").write_text(KERNELS)
    (tmp_path / "batch_size").mkdir()
    (tmp_path / "batch_size" / "report.md").write_text(REPORT.format(budget=json.dumps(budget)))
    (tmp_path / "batch_size" / "runs.csv").write_text(
        "status,batch_size,attention,perf/train_examples_per_s,mem/train_peak_allocated_mb\n"
        "OK,512,jagged,3000,1000\nOK,512,sdpa,1000,2500\nOOM,512,dense,,\n")
    (tmp_path / "profile_x.json").write_text(json.dumps({"device": "GPU X", "commit": "abc1234", "results": [
        {"attention": "jagged", "batch_size": 512, "graph_step_ms": 10.0, "gpu_ms": 10.0, "attn_ms": 1.0},
        {"attention": "sdpa", "batch_size": 512, "graph_step_ms": 30.0, "gpu_ms": 30.0, "attn_ms": 8.0}]}))
    return tmp_path


def test_summary_quotes_sources_marks_missing_and_stale(tmp_path):
    current = __import__("yaml").safe_load((summary.ABLATIONS / "batch_size.yaml").read_text())["set"]
    text = summary.build(_results(tmp_path, current))
    assert "fwd+bwd PASS: speed 50x" in text and "fwd+bwd MISS: speed 2.5x" in text
    assert "| 512 | 3,000 | 1,000 | 3.00x | 1,000 | 2,500 | 0.40x |" in text
    assert "| [batch_size](batch_size/report.md) | batch_size=512: jagged vs sdpa: >= 2.5x | train ex/s ratio 3.00x | PASS |" in text
    assert "| [batch_size](batch_size/report.md) | GPU X | `abc1234` | 2 OK, 1 OOM | current |" in text
    for name in ("seq_len", "sparsity", "compile", "auc_parity", "history_value", "model", "reproduce"):
        assert f"| {name} | NOT RUN |" in text
    assert "| profile | GPU X | abc1234 | batch 512 |" in text
    (tmp_path / "reproduce").mkdir()
    (tmp_path / "reproduce" / "r.md").write_text("# x\n\n- device: GPU X (both); torch\n\n**Result: NOT REPRODUCED** (why)\n")
    assert "| [reproduce](reproduce/r.md) | GPU X | - | one run | NOT REPRODUCED |" in summary.build(tmp_path)
    # 20 ms saved: 7 in attention, 13 outside; attention free would make jagged at most 10/9 faster
    assert "Of the 20.0 ms saved per step, 7.0 ms are in attention and 13.0 ms outside it" in text
    assert "at most 1.11x faster" in text


def test_a_report_from_another_budget_is_marked_stale(tmp_path):
    current = __import__("yaml").safe_load((summary.ABLATIONS / "batch_size.yaml").read_text())["set"]
    text = summary.build(_results(tmp_path, {**current, "trainer.max_steps": 100}))
    assert "stale: trainer.max_steps: ran 100, file 300" in text
    assert "[batch_size](batch_size/report.md) (stale budget)" in text
    # a key the file no longer sets is stale too, unless the sweep's command gave it with --set
    gone = REPORT.format(budget=json.dumps({**current, "trainer.limit_train_batches": 1000, "data.num_workers": 4}))
    assert summary.budget_state("batch_size", gone) == ("stale: trainer.limit_train_batches: ran 1000, file: not set; "
                                                        "data.num_workers: ran 4, file: not set")
    given = gone + "- MLflow: command `python -m experiments sweep x.yaml --set data.num_workers=4`\n"
    assert summary.budget_state("batch_size", given) == "stale: trainer.limit_train_batches: ran 1000, file: not set"


def test_main_writes_the_file_and_rejects_a_missing_folder(tmp_path, capsys):
    assert summary.main(["--results", str(tmp_path / "nope")]) == 2
    assert "no results folder" in capsys.readouterr().err
    assert summary.main(["--results", str(tmp_path)]) == 0
    assert (tmp_path / "REPORT.md").read_text().startswith("# Jagged Flash Attention")


def test_a_report_that_names_a_renamed_key_reads_under_the_new_name():
    """history_value's report was written when model.ranker.attention was model.ranker.backend:
    the same budget is current; a different value of the renamed key is still stale."""
    current = __import__("yaml").safe_load((summary.ABLATIONS / "history_value.yaml").read_text())["set"]
    assert current["model.ranker.attention"] == "jagged"
    old = {("model.ranker.backend" if k == "model.ranker.attention" else k): v for k, v in current.items()}
    assert summary.budget_state("history_value", REPORT.format(budget=json.dumps(old))) == "current"
    other = REPORT.format(budget=json.dumps({**old, "model.ranker.backend": "sdpa"}))
    assert summary.budget_state("history_value", other) == "stale: model.ranker.attention: ran 'sdpa', file 'jagged'"


def test_targets_are_judged_as_the_ablation_file_states_them_now(tmp_path):
    """A target changed in the file since the report was written: the summary judges the committed
    runs against the file's targets with the report's own function, and says so."""
    current = __import__("yaml").safe_load((summary.ABLATIONS / "batch_size.yaml").read_text())["set"]
    _results(tmp_path, current)
    old = REPORT.format(budget=json.dumps(current)).replace(">= 2.5x", ">= 2.0x")
    (tmp_path / "batch_size" / "report.md").write_text(old)
    (tmp_path / "batch_size" / "runs.csv").write_text(
        "status,batch_size,attention,tag.accelerator,perf/train_examples_per_s,mem/train_peak_allocated_mb\n"
        "OK,512,jagged,cuda,2200,1000\nOK,512,sdpa,cuda,1000,2500\nOOM,512,dense,cuda,,\n")
    text = summary.build(tmp_path)
    tag = "[batch_size](batch_size/report.md) (targets as the file states them now)"
    assert f"| {tag} | batch_size=512: jagged vs sdpa: >= 2.5x | train ex/s ratio 2.20x | MISS |" in text
    assert f"| {tag} | batch_size=512: jagged vs sdpa: <= 0.5x | peak memory ratio 0.40x | PASS |" in text
    assert f"| {tag} | batch_size=2048: jagged vs sdpa: - | - | NOT MEASURED (missing) |" in text
    assert ">= 2.0x" not in text


def test_a_partial_kernels_run_adds_to_a_full_one_instead_of_hiding_it(tmp_path):
    """Each kernel target comes from the newest report that measured it: a later run of one kind
    (its other targets N/A) replaces only the rows it measured, and each row names its file."""
    (tmp_path / "kernels-a.md").write_text(KERNELS)
    (tmp_path / "kernels-b.md").write_text(KERNELS.replace("**PASS** | speed 50x", "**N/A** | not run").replace(
        "**MISS** | speed 2.5x", "**PASS** | speed 3.5x"))
    rows = {r[0].split(" vs ")[1].split(":")[0]: r for r in summary.kernel_targets(tmp_path)}
    assert rows["dense_torch"][1:] == ["PASS", "speed 50x", "kernels-a.md"]
    assert rows["sdpa_padded_mask"][1:] == ["PASS", "speed 3.5x", "kernels-b.md"]
    text = summary.build(tmp_path)
    assert "[kernels-a.md](kernels-a.md) | headline S fwd_bwd vs dense_torch" in text
    assert "[kernels-b.md](kernels-b.md) | headline S fwd_bwd vs sdpa_padded_mask" in text


def test_the_seeds_other_systems_are_listed_once_they_have_run(tmp_path):
    current = __import__("yaml").safe_load((summary.ABLATIONS / "batch_size.yaml").read_text())["set"]
    results = _results(tmp_path, current)
    assert "| s2 | NOT RUN" not in summary.build(results) and "[alure]" not in summary.build(results)
    (results / "alure").mkdir()
    (results / "alure" / "report.md").write_text(REPORT.replace("`batch_size`", "`alure`").format(budget="{}"))
    assert "| [alure](alure/report.md) | GPU X | `abc1234` |" in summary.build(results)


def test_jagged_is_judged_against_each_peer_at_its_fastest_step(tmp_path):
    """The compile ablation gives every layout its fastest step; a peer that compiles faster than
    it runs eagerly is judged at its compiled speed, and the 2.5x target can fail there."""
    (tmp_path / "compile").mkdir()
    (tmp_path / "compile" / "runs.csv").write_text(
        "status,step,attention,perf/train_examples_per_s,mem/train_peak_allocated_mb\n"
        "OK,eager,jagged,3000,1000\nOK,graphs,jagged,5000,900\nOK,eager,sdpa,1500,2000\n"
        "OK,compiled,sdpa,2500,1900\nOOM,compiled,dense,,\nOK,eager,dense,500,9000\n")
    text = summary.build(tmp_path)
    assert "| sdpa | compiled | 2,500 | 1,900 | 2.00x |" in text and "| jagged | graphs | 5,000 | 900 | 1.00x |" in text
    assert ("| [compile](compile/report.md) | jagged (graphs) vs sdpa at its fastest step (compiled): >= 2.5x | "
            "train ex/s ratio 2.00x (5,000 vs 2,500) | MISS |") in text
    assert "jagged (graphs) vs dense at its fastest step (eager): >= 2.5x | train ex/s ratio 10.00x" in text


def test_history_and_architecture_sections_read_their_reports(tmp_path):
    assert "No history_value results" in summary.build(tmp_path) and "No model ablation yet" in summary.build(tmp_path)
    (tmp_path / "history_value").mkdir()
    (tmp_path / "history_value" / "report.md").write_text(
        "# Ablation `history_value`\n\n## Test AUC against the oracle (the planted label model, meta.json)\n\n"
        "Oracle: full history 0.8600, no history 0.6000.\n\n"
        "| max_seq_len | model test AUC | oracle AUC from the last max_seq_len items |\n|---|---|---|\n"
        "| 64 | 0.7000 | 0.7500 |\n| 1024 | 0.7300 | 0.8500 |\n| 4096 | 0.7250 | 0.8600 |\n| 8192 | - | 0.8600 |\n\n## Plots\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "runs.csv").write_text(
        "variant,status,test/auc\nbaseline,OK,0.75\nlayers_0,OK,0.76\ndim_256,FAILED,\n")
    text = summary.build(tmp_path)
    assert "| 1024 | 0.7300 | +0.0300 | 0.8500 | +0.1000 |" in text and "| 8192 | - | - | 0.8600 | +0.0000 |" in text
    assert "highest at max_seq_len 1024 (0.7300), +0.0300 over 64; at 4096 it is -0.0050 against that" in text
    assert "(the oracle's own gain there: +0.0100)" in text
    assert "| layers_0 | OK | 0.7600 | +0.0100 |" in text and "| dim_256 | FAILED | - | - |" in text


def test_the_points_column_counts_failed_runs_whatever_their_reason(tmp_path):
    current = __import__("yaml").safe_load((summary.ABLATIONS / "batch_size.yaml").read_text())["set"]
    root = _results(tmp_path, current)
    (root / "batch_size" / "runs.csv").write_text(
        "status,batch_size,attention\nOK,512,jagged\nFAILED: exit 1,512,sdpa\nFAILED: killed,512,dense\n")
    (row,) = [r for r in summary.ablation_status(root) if r["name"] == "batch_size"]
    assert row["points"] == "1 OK, 2 FAILED"
