"""The main job (the sweep of main.yaml) and its results table (``--results``): never a failed table
over a good one, never other data under the preset's name. The fits are stand-ins (the real ones:
test_pipeline_tracking)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlflow
import pytest

from experiments import sweep
from test_pipeline_cli import fresh_tracking_uri
from test_pipeline_data import tiny_data_dir

MAIN = Path(__file__).resolve().parents[1] / "experiments" / "ablations" / "main.yaml"
GOOD = {"name": "main-tiny", "header": ["attention", "status", "test AUC", "run"],
        "rows": [["dense", "OK", "0.5312", "a"], ["sdpa", "OK", "0.5301", "b"], ["jagged", "OK", "0.5322", "c"]]}


@pytest.fixture
def job(tmp_path, tmp_path_factory, monkeypatch):
    """Main jobs on tiny data whose fits exit at once with `status` (no run recorded)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fresh_tracking_uri(tmp_path_factory, tmp_path))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    # mlflow.set_tracking_uri is process-global: give the value back to the other tests afterwards
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None, raising=False)
    results = tmp_path / "results"
    (results / "training" / "cpu").mkdir(parents=True)

    def run(status: int, data: Path | None = None, layouts=("jagged",)) -> int:
        monkeypatch.setattr(sweep, "FIT_COMMAND", (sys.executable, "-c", f"import sys; sys.exit({status})"))
        data = data or tiny_data_dir(tmp_path_factory)
        return sweep.main([str(MAIN), "--new", "--data", str(data), "--set", "name=main-tiny",
                           "--set", "configs=[base, tiny]",
                           "--set", f"grid={{model.ranker.attention: [{', '.join(layouts)}]}}",
                           "--results", str(results)])

    return run, results / "training" / "cpu"


def test_a_failed_run_never_replaces_a_good_table(job, capsys):
    run, results = job
    table = results / "main-tiny.md"
    table.write_text("the good table\n")
    table.with_suffix(".json").write_text(json.dumps(GOOD))
    assert run(status=1) == 1
    assert table.read_text() == "the good table\n" and json.loads(table.with_suffix(".json").read_text()) == GOOD
    failed = (results / "main-tiny.failed.md").read_text()
    assert "| jagged | FAILED: no output |" in failed
    out = capsys.readouterr().out
    assert "main-tiny.failed.md" in out and "kept: it holds OK dense, jagged, sdpa" in out


def test_a_failed_run_may_replace_a_failed_table(job):
    run, results = job
    table = results / "main-tiny.md"
    table.write_text("a failed table\n")
    table.with_suffix(".json").write_text(json.dumps(GOOD).replace('"OK"', '"FAILED"'))
    assert run(status=1) == 1
    assert "| jagged | FAILED: no output |" in table.read_text()
    assert not (results / "main-tiny.failed.md").exists()


def test_other_data_is_not_filed_under_the_presets_name(job, tmp_path, tmp_path_factory):
    run, results = job
    other = tmp_path / "tiny_seed1"
    shutil.copytree(tiny_data_dir(tmp_path_factory), other, ignore=shutil.ignore_patterns(".cache"))
    meta = json.loads((other / "meta.json").read_text())
    meta["seed"] = 1  # as if generated with --seed 1: not `make data PRESET=tiny`
    (other / "meta.json").write_text(json.dumps(meta))
    run(status=1, data=other)
    name = f"main-tiny_tiny_seed1-{meta['digest'][:8]}"
    assert sorted(p.name for p in results.iterdir()) == [f"{name}.json", f"{name}.md"]
