"""The comparison on a sweep's parent run, one click from MLflow's runs list: headline metrics
``<point>.<name>`` of every finished point and the baseline's ratios
(``<point>.jagged_over_sdpa.speedup``, ``.memory_saving``), the table as the run's description
and as ``comparison/comparison.{md,html}``. Why and how to read them: docs/experiments.md.
"""

from __future__ import annotations

import html
import json
import re
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.runs import markdown_table

if TYPE_CHECKING:
    import polars as pl
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

HEADLINE = {  # child metric -> name on the parent
    "perf/train_examples_per_s": "examples_per_s",
    "perf/step_time_ms": "step_ms",
    "mem/train_peak_allocated_mb": "peak_mem_mb",
    "mem/peak_rss_mb": "peak_rss_mb",
    "test/auc": "test_auc",
}
_BAD = re.compile(r"[^A-Za-z0-9_.\- ]")  # MLflow metric keys: alphanumerics and _ - . space / :


def _part(text: str) -> str:
    return _BAD.sub("_", str(text))


def point_key(row: dict, axes: list[str], series: str | None) -> str:
    """`batch_size_512.jagged`: the non-series axes as name_label, then the series label."""
    parts = [f"{_part(a)}_{_part(row[a])}" for a in axes if a != series]
    if series in axes:
        parts.append(_part(row[series]))
    return ".".join(parts) or "all"


def compare_url(experiment_id: str, run_ids: list[str]) -> str:
    """MLflow's compare-runs view of these runs, relative to the UI's address."""
    runs = urllib.parse.quote(json.dumps(run_ids))
    return f"#/compare-runs?runs={runs}&experiments={urllib.parse.quote(json.dumps([experiment_id]))}"


def parent_url(experiment_id: str, run_id: str) -> str:
    return f"#/experiments/{experiment_id}/runs/{run_id}"


def headline_metrics(df: pl.DataFrame, axes: list[str], series: str | None, ratios: dict,
                     ratio_axes: list[str]) -> dict[str, float]:
    """The parent's metrics; `ratio_axes` name the labels of each ratio's key (report.ratios)."""
    out: dict[str, float] = {}
    for row in df.filter(df["status"] == "OK").iter_rows(named=True):
        key = point_key(row, axes, series)
        gpu = row.get("mem/train_peak_allocated_mb") is not None  # else the process's RSS (CPU)
        for metric, name in HEADLINE.items():
            if row.get(metric) is not None and not (gpu and metric == "mem/peak_rss_mb"):
                out[f"{key}.{name}"] = float(row[metric])
    for pair, r in ratios.items():
        base, other = (p.strip() for p in pair.split("/", 1))
        for key_labels, speed, mem in zip(r["key"], r["throughput"], r["memory"]):
            prefix = ".".join(f"{_part(a)}_{_part(v)}" for a, v in zip(ratio_axes, key_labels))
            name = f"{prefix + '.' if prefix else ''}{_part(base)}_over_{_part(other)}"
            if speed is not None:
                out[f"{name}.speedup"] = float(speed)
            if mem is not None:
                out[f"{name}.memory_saving"] = float(mem)
    return out


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    style = "table{border-collapse:collapse;font-family:sans-serif;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px}"
    return f"<html><head><style>{style}</style></head><body><table><tr>{head}</tr>{body}</table></body></html>\n"


def log_comparison(client: MlflowClient, parent: Run, df: pl.DataFrame, axes: list[str], series: str | None,
                   ratios: dict, ratio_axes: list[str], table: tuple[list[str], list[list[str]]],
                   title: str) -> dict[str, float]:
    """Put the comparison on the parent run (see the module docstring); returns its metrics."""
    from mlflow.entities import Metric

    run_id, exp = parent.info.run_id, parent.info.experiment_id
    metrics = headline_metrics(df, axes, series, ratios, ratio_axes)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in sorted(metrics.items())])
    header, rows = table
    md = markdown_table(header, rows)
    children = [r for r in df["run_id"].to_list() if r]
    note = (f"**{title}**\n\n{md}\n\n[Compare the {len(children)} runs side by side]"
            f"({compare_url(exp, children)}) · headline metrics of every point are this run's metrics "
            "(`<point>.examples_per_s`, `<point>.<baseline>_over_<other>.speedup`, ...)\n")
    client.set_tag(run_id, "mlflow.note.content", note)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "comparison.md").write_text(f"# {title}\n\n{md}\n")
        (Path(tmp) / "comparison.html").write_text(html_table(header, rows))
        for name in ("comparison.md", "comparison.html"):
            client.log_artifact(run_id, str(Path(tmp) / name), artifact_path="comparison")
    return metrics
