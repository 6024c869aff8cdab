"""The main job's results file: never a failed table over a good one, never other data under
the preset's name. The fits are stand-ins (the real ones: test_pipeline_tracking)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlflow
import pytest

from experiments import main_job as experiment
from experiments import sweep
from test_pipeline_cli import fresh_tracking_uri
from test_pipeline_data import tiny_data_dir

GOOD = """# Main job: dense vs sdpa vs jagged rankers, preset `tiny`

| attention | status | test AUC | MLflow run |
|---|---|---|---|
| dense | FINISHED | 0.5312 | a |
| sdpa | FINISHED | 0.5301 | b |
| jagged | FINISHED | 0.5322 | c |
"""


@pytest.fixture
def job(tmp_path, tmp_path_factory, monkeypatch):
    """Main jobs on tiny data whose fits exit at once with `status` (no run recorded)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fresh_tracking_uri(tmp_path_factory, tmp_path))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    # mlflow.set_tracking_uri is process-global: give the value back to the other tests afterwards
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None, raising=False)
    results = tmp_path / "results"
    results.mkdir()

    def run(status: int, data: Path | None = None, layouts=("jagged",)) -> int:
        monkeypatch.setattr(sweep, "FIT_COMMAND", (sys.executable, "-c", f"import sys; sys.exit({status})"))
        data = data or tiny_data_dir(tmp_path_factory)
        return experiment.main(["--preset", "tiny", "--data", str(data), "--attention", *layouts,
                                "--results-dir", str(results)])

    return run, results


def test_a_failed_run_never_replaces_a_good_table(job, capsys):
    run, results = job
    table = results / "main_tiny_cpu.md"
    table.write_text(GOOD)
    assert run(status=1) == 1
    assert table.read_text() == GOOD
    failed = (results / "main_tiny_cpu.failed.md").read_text()
    assert "| jagged | NOT STARTED |" in failed
    out = capsys.readouterr().out
    assert "main_tiny_cpu.failed.md" in out and "kept: it holds FINISHED dense, jagged, sdpa" in out


def test_a_failed_run_may_replace_a_failed_table(job):
    run, results = job
    table = results / "main_tiny_cpu.md"
    table.write_text(GOOD.replace("FINISHED", "FAILED"))
    assert run(status=1) == 1
    assert "| jagged | NOT STARTED |" in table.read_text()
    assert not (results / "main_tiny_cpu.failed.md").exists()


def test_other_data_is_not_filed_under_the_presets_name(job, tmp_path, tmp_path_factory):
    run, results = job
    other = tmp_path / "tiny_seed1"
    shutil.copytree(tiny_data_dir(tmp_path_factory), other, ignore=shutil.ignore_patterns(".cache"))
    meta = json.loads((other / "meta.json").read_text())
    meta["seed"] = 1  # as if generated with --seed 1: not `make data PRESET=tiny`
    (other / "meta.json").write_text(json.dumps(meta))
    run(status=1, data=other)
    assert [p.name for p in results.iterdir()] == [f"main_tiny_tiny_seed1-{meta['digest'][:8]}_cpu.md"]


def test_arguments_for_every_fit_are_key_value_pairs(job, tmp_path_factory, capsys):
    assert experiment.fit_overrides(["--trainer.max_epochs", "1", "--mlflow.system_metrics=false", "--x", "-5"]) == {
        "trainer.max_epochs": 1, "mlflow.system_metrics": False, "x": -5}
    data = tiny_data_dir(tmp_path_factory)  # the job fixture's tracking store, not the repository's
    assert experiment.main(["--preset", "tiny", "--data", str(data), "--", "trainer.max_epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: after --: unexpected argument 'trainer.max_epochs' (options are --key value)"
