"""The report and reproduce commands on the session's smoke sweep (see test_sweep.py)."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
from mlflow.tracking import MlflowClient

from experiments import report
from experiments import reproduce, sections
from test_sweep import _uri_env, smoke_sweep, the_parent


@pytest.fixture
def smoke(tmp_path_factory):
    state = smoke_sweep(tmp_path_factory)
    mp = _uri_env(state.uri)  # the real `pipeline fit` from here on (no injected failures)
    yield state
    mp.undo()


def ok_run(uri: str):
    client = MlflowClient(uri)
    parent = the_parent(uri)
    (run,) = client.search_runs([parent.info.experiment_id],
                                f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.status = 'OK'")
    return run


@pytest.mark.slow
def test_report_files_and_artifacts(smoke, tmp_path, capsys):
    parent = the_parent(smoke.uri)
    assert report.main(["--parent", "smoke", "--out", str(tmp_path)]) == 0
    out = tmp_path / "ablations" / "smoke" / "cpu"  # <results root>/ablations/<name>/<device>/
    md = (out / "report.md").read_text()
    run = ok_run(smoke.uri)
    tags = run.data.tags
    for stated in (tags["device"], tags["torch_version"], tags["git_commit"], tags["data_digest"], parent.info.run_id):
        assert stated in md
    assert "| jagged | 16 | OK |" in md and "| jagged | 24 | OOM |" in md and "FAILED: error: data.max_seq_len" in md
    for png in ("throughput.png", "memory.png", "auc.png"):
        assert (out / png).stat().st_size > 1000, png
    frame = pl.read_csv(out / "runs.csv")
    assert frame.height == 3 and set(frame["status"]) == {"OK", "OOM", "FAILED"}
    facts = json.loads((out / "report.json").read_text())  # what experiments.summary reads
    assert facts["name"] == "smoke" and facts["device"] == [tags["device"]] and facts["commit"] == [tags["git_commit"]]
    assert [r["status"] for r in facts["rows"]] == frame["status"].to_list() and facts["parent_run"] == parent.info.run_id
    meta = MlflowClient(smoke.uri).download_artifacts(run.info.run_id, "data/meta.json", str(tmp_path))
    assert facts["data"] == json.loads(open(meta).read())["config"]  # the generator's settings, for the summary
    logged = {f.path for f in MlflowClient(smoke.uri).list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/report.json", "report/runs.csv", "report/auc.png"} <= logged
    # by id as well as by name; an unknown parent is a clear error
    assert report.main(["--parent", parent.info.run_id, "--out", str(tmp_path), "--no-log"]) == 0
    assert report.main(["--parent", "no-such-sweep", "--out", str(tmp_path)]) == 2
    assert "no sweep parent run" in capsys.readouterr().err
    # a child run's id: refused, naming the parent to report instead
    assert report.main(["--parent", run.info.run_id, "--out", str(tmp_path), "--no-log"]) == 2
    assert f"is not a parent run: it is one run of the parent {parent.info.run_id}" in capsys.readouterr().err


def test_ratios_and_oracle_section():
    df = pl.DataFrame({
        "max_seq_len": ["256", "256", "256", "4096", "4096"],
        "attention": ["jagged", "sdpa", "dense", "jagged", "dense"],
        "status": ["OK", "OK", "OK", "OK", "OOM"],
        sections.THROUGHPUT: [300.0, 100.0, 50.0, 80.0, None],
        "mem/train_peak_allocated_mb": [10.0, 30.0, 40.0, 20.0, None],
        "test/auc": [0.7, 0.7, 0.7, 0.75, None],
    })
    rat = sections.ratios(df, ["max_seq_len", "attention"], "attention", "jagged", "mem/train_peak_allocated_mb")
    assert rat["jagged / sdpa"]["throughput"] == [3.0] and rat["jagged / sdpa"]["memory"] == [3.0]
    assert rat["jagged / dense"]["x"] == ["256", "4096"] and rat["jagged / dense"]["throughput"] == [6.0, None]
    assert rat["jagged / dense"]["note"] == ["", "dense OOM"]
    assert "| jagged / dense | 4096 | -x | -x | dense OOM |" in sections.ratio_section(rat, "max_seq_len")
    sdpa_shared = df.with_columns(parallel=pl.Series(["1", "2", "1", "1", "1"]))
    shared = sections.ratios(sdpa_shared, ["max_seq_len", "attention"], "attention", "jagged", "mem/train_peak_allocated_mb")
    assert shared["jagged / sdpa"]["note"] == ["sdpa shared the GPU: not comparable"]
    assert shared["jagged / dense"]["note"] == ["", "dense OOM"]
    alone = sections.ratios(df.filter(pl.col("attention") == "jagged"), ["max_seq_len", "attention"], "attention",
                          "jagged", "mem/train_peak_allocated_mb")
    assert sections.ratio_section(alone, "max_seq_len") == []  # only the baseline ran: no empty table
    lines = sections.oracle_section(df.filter(pl.col("attention") == "jagged"), "max_seq_len",
                                  {"auc": 0.86, "auc_recent_0": 0.6, "auc_recent_256": 0.81})
    # the gap closed: (0.70 - 0.60) / (0.81 - 0.60)
    assert "| 256 | 0.7000 | 0.8100 | 48% |" in lines and "| 4096 | 0.7500 | - | - |" in lines
    fixed = sections.oracle_section(df.filter(pl.col("attention") == "jagged"), "max_seq_len",
                                    {"auc": 0.86, "auc_recent_0": 0.6, "auc_recent_256": 0.81}, window=256)
    assert "| 4096 | 0.7500 | 0.8100 | 71% |" in fixed and any("from the last 256 items" in line for line in fixed)
    whole = sections.with_whole_window({"auc": 0.86, "auc_recent_0": 0.6, "auc_recent_256": 0.81}, 4096)
    assert whole["auc_recent_4096"] == 0.86 and whole["longest_history"] == 4096
    assert sections.with_whole_window({"auc": 0.86, "auc_recent_1024": 0.85}, 1024)["auc_recent_1024"] == 0.85  # measured wins
    lines = sections.oracle_section(df.filter(pl.col("attention") == "jagged"), "max_seq_len",
                                  sections.with_whole_window({"auc": 0.86, "auc_recent_256": 0.81}, 1024))
    assert "| 256 | 0.7000 | 0.8100 | - |" in lines and "| 4096 | 0.7500 | 0.8600 | - |" in lines  # 4096 >= the longest
    assert any("longest test history has 1024 items" in line for line in lines)
    assert not any("planted term" in line for line in lines)  # no oracle_terms: no term table


def test_oracle_section_tables_each_planted_term_at_the_runs_windows():
    df = pl.DataFrame({"max_seq_len": ["256", "4096"], "status": ["OK", "OK"], "test/auc": [0.7, 0.75]})
    terms = {"item": {"alone_256": 0.51, "without_256": 0.80, "alone_full": 0.58, "without_full": 0.84},
             "freq": {"alone_256": 0.70, "without_256": 0.77}}
    oracle = sections.with_whole_window({"auc": 0.86, "auc_recent_0": 0.6, "auc_recent_256": 0.81}, 1024)
    lines = sections.oracle_section(df, "max_seq_len", oracle, terms=terms)
    # 4096 holds the longest history (1024): the term's whole-history figure; one meta.json lacks: "-"
    assert "| term | alone 256 | alone 4096 | without 256 | without 4096 |" in lines
    assert "| item | 0.5100 | 0.5800 | 0.8000 | 0.8400 |" in lines and "| freq | 0.7000 | - | 0.7700 | - |" in lines
    fixed = sections.oracle_section(df, "max_seq_len", oracle, window=256, terms=terms)  # oracle: K, one window
    assert "| term | alone 256 | without 256 |" in fixed


def test_the_plot_budget_names_the_early_stopping_of_the_files_configs():
    from types import SimpleNamespace

    def parent(file: str, overrides: dict | None = None):
        return SimpleNamespace(data=SimpleNamespace(tags={"sweep.file": file, "sweep.set": json.dumps(overrides or {})}))
    assert report.early_stopping_words(parent("experiments/ablations/history_value.yaml")) == \
        "until val/auc stops rising (at most 3 epochs)"  # converge.yaml
    assert report.early_stopping_words(parent("experiments/ablations/history_value.yaml", {"trainer.max_epochs": 5})) == \
        "until val/auc stops rising (at most 5 epochs)"
    assert report.early_stopping_words(parent("experiments/ablations/auc_parity.yaml")) == ""  # equal_steps.yaml: no stop
    assert report.early_stopping_words(parent("experiments/ablations/seq_len.yaml")) == ""  # a fixed step budget
    assert report.early_stopping_words(parent("experiments/ablations/gone.yaml")) == ""


@pytest.mark.slow
def test_reproduce_is_exact_on_cpu(smoke, capsys):
    run = ok_run(smoke.uri)
    assert reproduce.main(["--run", run.info.run_id]) == 0
    out = capsys.readouterr().out
    assert "REPRODUCED: quality metrics, exact equality" in out
    client = MlflowClient(smoke.uri)
    (new,) = client.search_runs([run.info.experiment_id], f"tags.reproduces = '{run.info.run_id}'")
    assert new.info.status == "FINISHED" and "mlflow.parentRunId" not in new.data.tags
    quality = {k: v for k, v in run.data.metrics.items() if k.startswith(("train/", "val/", "test/"))}
    assert quality and {k: new.data.metrics[k] for k in quality} == quality


@pytest.mark.slow
def test_reproduce_refuses_other_data(smoke, tmp_path, capsys):
    run = ok_run(smoke.uri)
    other = tmp_path / "tiny_copy"
    shutil.copytree(smoke.root / "data" / "tiny", other)
    meta = json.loads((other / "meta.json").read_text())
    meta["digest"] = "0" * 64
    (other / "meta.json").write_text(json.dumps(meta))
    assert reproduce.main(["--run", run.info.run_id, "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert "data digest mismatch" in err and "python -m data_gen generate --preset tiny" in err
    assert reproduce.main(["--run", "0" * 32]) == 2


def test_targets_section_passes_misses_and_unmeasured():
    df = pl.DataFrame({
        "fill": ["0.25", "0.25", "0.25", "0.5"],
        "attention": ["jagged", "sdpa", "dense", "jagged"],
        "status": ["OK", "OK", "OOM", "OK"],
        sections.THROUGHPUT: [300.0, 100.0, None, 90.0],
        "mem/train_peak_allocated_mb": [10.0, 30.0, None, 20.0],
        "test/auc": [0.7010, 0.7000, None, 0.7],
    })
    spec = {"series": "attention", "baseline": "jagged", "targets": [
        {"at": {"fill": "0.25"}, "vs": "sdpa", "min_speedup": 2.0, "max_memory_ratio": 0.3, "max_auc_diff": 0.002},
        {"at": {"fill": "0.25"}, "vs": "dense", "min_speedup": 2.0}]}
    lines = sections.targets_section(df, spec, "mem/train_peak_allocated_mb")
    assert "| fill=0.25: jagged vs sdpa | train ex/s ratio 3.00x | >= 2.0x | PASS |" in lines
    assert "| fill=0.25: jagged vs sdpa | peak memory ratio 0.33x | <= 0.3x | MISS |" in lines
    assert "| fill=0.25: jagged vs sdpa | test AUC absolute difference 0.0010 | <= 0.002 | PASS |" in lines
    assert "| fill=0.25: jagged vs dense | - | - | NOT MEASURED (jagged OK, dense OOM) |" in lines
    shared = sections.targets_section(df.with_columns(parallel=pl.Series(["1", "2", "1", "1"])), spec, "mem/train_peak_allocated_mb")
    assert "| fill=0.25: jagged vs sdpa | train ex/s ratio 3.00x | >= 2.0x | NOT COMPARABLE (a run shared the GPU) |" in shared
    assert "| fill=0.25: jagged vs sdpa | peak memory ratio 0.33x | <= 0.3x | MISS |" in shared  # each process's own
    assert sections.targets_section(df, {}, "x") == []


def test_profile_section_reads_the_newest_traces(tmp_path):
    pattern = "training/*/profile-paper/*/loop_summary.json"
    assert "No trace matching" in " ".join(sections.profile_section(tmp_path, pattern))
    for attention, step, attn in (("sdpa", 40.0, 10.0), ("jagged", 20.0, 2.0)):
        folder = tmp_path / "training" / "h100" / "profile-paper" / attention
        folder.mkdir(parents=True)
        (folder / "loop_summary.json").write_text(json.dumps({
            "attention": attention, "wall_ms_per_step": step, "attention_ms_per_step": attn,
            "attention_share": attn / step}))
    text = "\n".join(sections.profile_section(tmp_path, pattern))
    assert "| sdpa | 40.00 | - | 10.00 | 30.00 | 0.250 |" in text and "| jagged | 20.00 | - | 2.00 | 18.00 | 0.100 |" in text
    assert "from 40.00 to 20.00 ms (2.00x)" in text and "at best be 2.22x" in text
    assert "(../../../training/h100/profile-paper/jagged/loop_summary.json)" in text  # from ablations/<name>/<device>/
    assert sections.profile_section(tmp_path, None) == []


def test_seeds_table_and_targets_on_seed_means():
    df = pl.DataFrame({
        "attention": ["jagged"] * 3 + ["sdpa"] * 3,
        "seed_everything": ["0", "1", "2"] * 2,
        "status": ["OK"] * 6,
        sections.THROUGHPUT: [3.0, 3.0, 3.0, 1.0, 1.0, 1.0],
        "mem/train_peak_allocated_mb": [1.0] * 6,
        "test/auc": [0.700, 0.702, 0.704, 0.701, 0.703, 0.708],
    })
    lines = sections.seeds_section(df, "seed_everything", ["attention", "seed_everything"])
    assert "| jagged | 3 | 0.7020 | 0.0020 | 0.7000 | 0.7040 |" in lines
    assert "| sdpa | 3 | 0.7040 | 0.0036 | 0.7010 | 0.7080 |" in lines
    spec = {"series": "attention", "baseline": "jagged", "seeds": "seed_everything",
            "targets": [{"vs": "sdpa", "min_speedup": 2.0, "max_auc_diff": 0.0015}]}
    text = "\n".join(sections.targets_section(df, spec, "mem/train_peak_allocated_mb"))
    assert "mean over the `seed_everything` values both ran" in text
    assert "| jagged vs sdpa | train ex/s ratio 3.00x | >= 2.0x | PASS |" in text  # no `at`: the pair
    assert "test AUC absolute difference 0.0020 | <= 0.0015 | MISS |" in text
    one_shared = df.with_columns(parallel=pl.Series(["1", "1", "1", "1", "4", "1"]))  # one seed's sdpa run
    assert "| jagged vs sdpa | train ex/s ratio 3.00x | >= 2.0x | NOT COMPARABLE (a run shared the GPU) |" in \
        "\n".join(sections.targets_section(one_shared, spec, "mem/train_peak_allocated_mb"))
    failed = df.with_columns(status=pl.when(pl.col("test/auc") == 0.708).then(pl.lit("FAILED")).otherwise(pl.col("status")))
    assert "NOT MEASURED (jagged OK, sdpa FAILED)" in "\n".join(sections.targets_section(failed, spec, "x"))
    assert sections.seeds_section(df, None, ["attention"]) == []


def test_a_removal_target_needs_its_drop_above_the_limit_and_beyond_2_std_of_the_seeds():
    aucs = {"full": [0.710, 0.712, 0.714], "no_x": [0.700, 0.703, 0.704],  # drops 0.010 0.009 0.010
            "no_y": [0.705, 0.714, 0.706], "no_z": [0.690, 0.712, 0.700]}  # 0.005 -0.002 0.008; 0.020 0 0.014
    df = pl.DataFrame({"variant": [v for v in aucs for _ in range(3)], "seed": ["0", "1", "2"] * 4,
                       "status": ["OK"] * 12, "test/auc": [a for v in aucs.values() for a in v]})
    spec = {"series": "variant", "baseline": "full", "seeds": "seed",
            "targets": [{"vs": v, "min_auc_drop": 0.005} for v in ("no_x", "no_y", "no_z")]}
    rows = {r[0]: r for r in sections.target_rows(df, spec, "x")}
    assert rows["full vs no_x"][1:] == ["test AUC drop 0.0097 (2 std of the 3 seeds' drops 0.0012)",
                                        ">= 0.005, beyond 2 std", "PASS"]
    assert rows["full vs no_y"][1].startswith("test AUC drop 0.0037") and rows["full vs no_y"][3] == "MISS"  # under 0.005
    assert rows["full vs no_z"][1] == "test AUC drop 0.0113 (2 std of the 3 seeds' drops 0.0205)"
    assert rows["full vs no_z"][3] == "MISS"  # above the limit, not beyond the seeds' spread
    more = pl.concat([df, pl.DataFrame({"variant": ["full"] * 3, "seed": ["3", "4", "5"], "status": ["OK"] * 3,
                                        "test/auc": [0.650] * 3})])  # seeds the others lack: left out
    spec["targets"] = [{"vs": "no_x", "max_auc_diff": 0.02, "min_auc_drop": 0.005}]
    assert [r[1] for r in sections.target_rows(more, spec, "x")] == [
        "test AUC absolute difference 0.0097", "test AUC drop 0.0097 (2 std of the 3 seeds' drops 0.0012)"]
    spec["targets"] = [{"base": "no_y", "vs": "no_z", "min_auc_drop": 0.005}]  # a part's cost on another ranker
    assert sections.target_rows(more, spec, "x") == [[  # drops 0.015 0.002 0.006: paired with no_y, not `full`
        "no_y vs no_z", "test AUC drop 0.0077 (2 std of the 3 seeds' drops 0.0133)", ">= 0.005, beyond 2 std", "MISS"]]

def test_convergence_section_judges_the_last_validation_interval():
    from types import SimpleNamespace

    import polars as pl

    from experiments.sections import convergence_lines, convergence_rows

    # a: flat; b: still rising; c: fell from its first check (past its peak); f: rose by more than tol
    # over the last interval but stays below its earlier best (past its peak, not rising); g: rose
    # by more than tol over the last interval, back to within tol of its earlier best (flat)
    curves = {"a": [0.70, 0.74, 0.745], "b": [0.70, 0.72, 0.73], "c": [0.75, 0.74], "d": [0.7],
              "f": [0.77, 0.70, 0.73], "g": [0.75, 0.70, 0.7505]}
    client = SimpleNamespace(get_metric_history=lambda run_id, key: [
        SimpleNamespace(step=100 * (i + 1), value=v) for i, v in enumerate(curves[run_id])])
    df = pl.DataFrame({"run_id": ["a", "b", "c", "d", "e", "f", "g"],
                       "status": ["OK", "OK", "OK", "OK", "FAILED", "OK", "OK"],
                       "attention": ["jagged", "sdpa", "dense", "jagged", "sdpa", "dense", "jagged"],
                       "seed": ["0", "0", "0", "1", "1", "1", "2"],
                       "test/weights_step": [300.0, None, 100.0, None, None, 100.0, 300.0]})
    lines = convergence_lines(convergence_rows(client, df, ["attention", "seed"], 0.006), ["attention", "seed"], 0.006)
    assert "4 of 5 runs did" in " ".join(lines)  # d validated once, e did not finish: neither is judged
    rows = [ln for ln in lines if ln.startswith("| jagged") or ln.startswith("| sdpa") or ln.startswith("| dense")]
    assert [r.split("|")[-2].strip() for r in rows] == ["flat", "rising", "past its peak", "past its peak", "flat"]
    assert [r.split("|")[-3].strip() for r in rows] == ["300", "-", "100", "100", "300"]  # the tested weights' step
    assert "200-300" in rows[0] and "+0.0050" in rows[0]
    assert convergence_lines(convergence_rows(client, df.filter(pl.col("run_id") == "d"), ["attention", "seed"], 0.002),
                             ["attention", "seed"], 0.002) == []


def test_recovery_section_shares_of_the_gain_and_costs(tmp_path):
    df = pl.DataFrame({
        "variant": ["short", "long", "short_emb", "short_emb_lag3", "long_emb"],
        "status": ["OK", "OK", "OK", "OK", "FAILED"],
        sections.THROUGHPUT: [400.0, 100.0, 380.0, 390.0, None],
        "mem/train_peak_allocated_mb": [10.0, 40.0, 12.0, 12.0, None],
        "test/auc": [0.70, 0.74, 0.732, 0.71, None],
    })
    spec = {"recovery": {"low": "short", "high": "long", "candidates": ["short_emb", "short_emb_lag3", "long_emb"],
                         "min_share": 0.7, "max_cost_ratio": 0.5}}
    (tmp_path / "encoder.json").write_text(json.dumps({
        "device": "GPU", "commit": "abc", "impressions": 1000, "days_trained": 12, "config": {"max_seq_len": 4096},
        "results": {"train/examples_per_s": 5000.0, "train/seconds_per_day": 3.5, "val/auc": 0.7}}))
    lines = sections.recovery_section(df, "variant", spec, "mem/train_peak_allocated_mb", tmp_path)
    assert "| short_emb | 0.7320 | +0.0320 | 0.80 | 0.26x | 0.30x | PASS |" in lines
    assert "| short_emb_lag3 | 0.7100 | +0.0100 | 0.25 | 0.26x | 0.30x | MISS |" in lines
    assert "| long_emb | - | - | - | - | - | NOT MEASURED (FAILED) |" in lines
    assert any("5,000 examples/s, 3.5 s per day of data" in ln for ln in lines)
    assert sections.recovery_section(df, "variant", {}, "x") == []
    no_long = df.with_columns(pl.when(pl.col("variant") == "long").then(pl.lit("OOM")).otherwise(pl.col("status"))
                              .alias("status"))
    assert "NOT MEASURED" in sections.recovery_section(no_long, "variant", spec, "x")[-1]


def test_one_markdown_and_one_text_table_for_every_command():
    from experiments import runs as runs_

    df = pl.DataFrame({"attention": ["jagged"], "status": ["OK"], "error": [None], "run_id": ["r1"],
                       "tag.accelerator": ["cpu"], "test/auc": [0.72634], "test/ne": [0.903],
                       "mem/peak_rss_mb": [1019.4], "sweep/process_wall_s": [41.2]})
    header, rows = runs_.summary_rows(df, ["attention"])
    assert header[3] == "test NE (train CTR)" and header[8] == "peak RSS (MB)"
    assert rows == [["jagged", "OK", "0.7263", "0.9030", "-", "-", "-", "-", "1,019", "41", "r1"]]
    text = runs_.text_table(header, rows).splitlines()
    assert text[0].startswith("attention  status  test AUC") and set(text[1]) == {"-", " "}
    assert all(ln == ln.rstrip() for ln in text) and text[0].index("status") == text[2].index("OK")
    assert runs_.markdown_table(["a", "b"], [["x|y", "1"]]) == "| a | b |\n|---|---|\n| x\\|y | 1 |"


def test_a_recorded_config_with_an_old_key_is_renamed_in_place():
    """A run recorded before model.ranker.backend became model.ranker.attention reruns under the
    new name (experiments.reproduce: the only reader of old records); other keys are untouched."""
    config = {"model": {"ranker": {"backend": "sdpa", "embed_dim": 8}}, "data": {"max_seq_len": 16}}
    assert reproduce.rename_old_keys(config) == ["model.ranker.backend -> model.ranker.attention"]
    assert config == {"model": {"ranker": {"attention": "sdpa", "embed_dim": 8}}, "data": {"max_seq_len": 16}}
    assert reproduce.rename_old_keys(config) == [] and reproduce.rename_old_keys({"model": None}) == [] \
        and reproduce.rename_old_keys({}) == []
