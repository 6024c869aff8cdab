"""The profiler: the loop trace of a tiny CPU fit (``--perf.trace_steps``) reports attention's time
and its share of a training step, beside the files it always wrote."""

from __future__ import annotations

import json
import logging
import math
import sys
from types import SimpleNamespace

import pytest

from pipeline.cli import main
from pipeline.trace import LoopTrace, busy_split
from test_pipeline_cli import fit_args, fresh_tracking_uri
from test_pipeline_data import tiny_data_dir


@pytest.mark.slow
def test_the_loop_trace_reports_the_attention_share(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pipeline"])
    monkeypatch.chdir(tmp_path)  # the run's artifacts (./mlruns of a new sqlite store) go there, not into the checkout
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fresh_tracking_uri(tmp_path_factory, tmp_path))
    tiny, out = tiny_data_dir(tmp_path_factory), tmp_path / "trace"
    main(fit_args(tiny, tmp_path, "--trainer.accelerator", "cpu", "--mlflow.system_metrics", "false",
                  "--model.ranker.attention", "jagged", "--perf.trace_steps", "[2, 2]",
                  "--perf.trace_dir", str(out)))
    summary = json.loads((out / "loop_summary.json").read_text())
    assert summary["attention"] == "jagged" and summary["device"] == "cpu" and summary["commit"]
    share, attn = summary["attention_share"], summary["attention_ms_per_step"]
    assert isinstance(share, float) and math.isfinite(share) and 0 < share < 1, summary
    assert 0 < attn < summary["wall_ms_per_step"], summary
    assert 0 < summary["attention_bwd_ms_per_step"] < attn, summary  # the backward's nodes were linked
    assert {"loop_ops.txt", "loop_trace.json.gz", "loop_python.txt"} <= {p.name for p in out.iterdir()}
    # on the CPU no device kernel is recorded: the whole step is the device's idle time
    assert summary["compute_ms_per_step"] == 0 and summary["exposed_comm_ms_per_step"] == 0, summary
    assert summary["idle_ms_per_step"] == pytest.approx(summary["wall_ms_per_step"]), summary


def test_busy_split_separates_compute_exposed_communication_and_idle_time():
    kernels = [("gemm", 0, 4), ("softmax", 3, 6),  # compute 0-6 (overlapping spans count once)
               ("ncclDevKernel_AllGather", 5, 9),  # 1 under compute, 3 exposed
               ("ncclKernel_ReduceScatter", 12, 14), ("gemm", 13, 15)]  # 1 exposed, compute 13-15
    split = busy_split(kernels, wall_us=20)
    assert split == {"compute": 8, "comm": 6, "exposed_comm": 4, "idle": 20 - 12}  # busy 0-9 and 12-15


def test_each_process_of_several_traces_into_its_own_folder(tmp_path):
    rank1 = SimpleNamespace(default_root_dir=str(tmp_path), global_rank=1, world_size=2)
    alone = SimpleNamespace(default_root_dir=str(tmp_path), global_rank=0, world_size=1)
    assert LoopTrace([1, 1])._dir(rank1) == tmp_path / "traces" / "rank1"
    assert LoopTrace([1, 1], str(tmp_path / "t"))._dir(alone) == tmp_path / "t"


def test_a_trace_past_the_runs_last_step_is_a_warning_at_the_start(tmp_path, tmp_path_factory, monkeypatch, caplog):
    monkeypatch.setattr(sys, "argv", ["pipeline"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fresh_tracking_uri(tmp_path_factory, tmp_path))
    out = tmp_path / "trace"
    with caplog.at_level(logging.WARNING, logger="pipeline.callbacks"):
        main(fit_args(tiny_data_dir(tmp_path_factory), tmp_path, "--trainer.accelerator", "cpu", "--mlflow.system_metrics",
                      "false", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0", "--perf.trace_steps",
                      "[2, 2]", "--perf.trace_dir", str(out)))
    assert "perf.trace_steps [2, 2] ends past this run's 3 steps: no trace is written" in caplog.text
    assert not (out / "loop_summary.json").exists()
