"""experiments.profile on CPU, tiny data: per attention layout an attention share and step times in the JSON,
and the same results as a table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from experiments.profile import main
from test_pipeline_data import tiny_data_dir

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "configs"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


def test_profile_reports_the_attention_share_of_every_layout(tiny, tmp_path, capsys):
    out = tmp_path / "profile_tiny_cpu.md"
    rc = main([
        "--config", str(CONFIGS / "base.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
        "--data.data_dir", str(tiny), "--trainer.accelerator", "cpu",
        "--steps", "2", "--warmup", "1", "--out", str(out),
    ])
    assert rc == 0
    data = json.loads(out.with_suffix(".json").read_text())  # the numbers (experiments.report reads them)
    assert data["device"] and data["commit"] and data["torch"] == torch.__version__
    assert [r["attention"] for r in data["results"]] == ["dense", "sdpa", "jagged"]
    for r in data["results"]:
        assert 0 < r["share"] <= 1 and r["attn_ms"] > 0 and r["step_ms"] > 0, r
        assert r["attn_bwd_ms"] > 0, r  # the backward's autograd nodes were linked to attention
        assert 0 < r["host_ms"] <= r["step_ms"] and r["chained_step_ms"] > 0, r
    text = out.read_text()  # the same results as a table, in the file and on stdout
    assert all(re.search(rf"^\| {a} \|", text, re.M) for a in ("dense", "sdpa", "jagged"))
    assert text in capsys.readouterr().out
