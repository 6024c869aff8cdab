"""experiments/gpu/runs_table.py on a store of made-up runs: the weak-scaling efficiency of each
W-process run against its 1-process bases, repeats averaged, and its plot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlflow

REPO = Path(__file__).resolve().parents[1]


def _runs_table():
    spec = importlib.util.spec_from_file_location("runs_table", REPO / "experiments/gpu/runs_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_efficiency_against_the_single_process_and_its_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("ddp")
    for name, speed in [("jagged-w1-single", 100.0), ("jagged-w1-single#2", 110.0), ("jagged-w2-ddp-sharded-graphs", 200.0),
                        ("jagged-w4-ddp-sharded-graphs", 360.0), ("jagged-w4-ddp-sharded-graphs#2", 380.0)]:
        with mlflow.start_run(run_name=name, tags={"device": "GPU X", "git_commit": "abc1234", "world_size": "1"}):
            mlflow.log_metric("perf/train_examples_per_s", speed)
    _runs_table().main(["ddp", "perf/train_examples_per_s", "--plot", str(tmp_path / "scaling.png")])
    out = capsys.readouterr().out
    assert "GPU X, torch None, triton None, commit abc1234" in out
    assert "| jagged-w1-single | 2 FINISHED | 1 | 105 [100, 110] |" in out
    # 200 / (2 x 105); (360 + 380) / 2 / (4 x 105), pairs from 360 / 440 to 380 / 400
    assert "| jagged | 2 | sharded-graphs | - | 95.2% [90.9%, 100.0%] |" in out
    assert "| jagged | 4 | sharded-graphs | - | 88.1% [81.8%, 95.0%] |" in out
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
