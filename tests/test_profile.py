"""The profiler: the loop trace of a tiny CPU fit (``--perf.trace_steps``) reports attention's time
and its share of a training step, beside the files it always wrote."""

from __future__ import annotations

import json
import math
import sys

import pytest

from pipeline.cli import main
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
