"""pipeline.profile on CPU, tiny data: one table row per attention, an attention share, the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.profile import main
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
    assert out.is_file()
    text = out.read_text()
    assert "torch " in text and "commit: " in text
    header = next(line for line in text.splitlines() if line.startswith("| attention"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    share_col = cols.index("attn share")
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| (dense|sdpa|jagged) \|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
    assert set(rows) == {"dense", "sdpa", "jagged"}
    for attention, cells in rows.items():
        share = float(cells[share_col])
        assert 0 < share <= 1, (attention, share)
        assert float(cells[cols.index("attn bwd ms")]) > 0, attention  # backward nodes were linked
    assert "| attention" in capsys.readouterr().out  # the table is printed too
    data = json.loads(out.with_suffix(".json").read_text())  # the numbers, for pipeline.report
    assert [r["attention"] for r in data["results"]] == ["dense", "sdpa", "jagged"]
    assert all(0 < r["share"] <= 1 and r["step_ms"] > 0 for r in data["results"])
    assert all(0 < r["host_ms"] <= r["step_ms"] and r["chained_step_ms"] > 0 for r in data["results"])
