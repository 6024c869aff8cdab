"""A sweep's runs in MLflow as one polars frame, and the tables made of them (markdown, text).

What the sweep tags on the parent and child runs (``sweep.*``, ``status``) and how a report
reads them: docs/experiments.md. mlflow and polars are imported by the functions that use them."""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import TYPE_CHECKING

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    import polars as pl
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


METRICS = {  # metric key -> (column title, format)
    "test/auc": ("test AUC", ".4f"),
    "test/ne": ("test NE (train CTR)", ".4f"),
    "test/logloss": ("test log loss", ".4f"),
    "perf/train_examples_per_s": ("train ex/s", ",.0f"),
    "perf/train_tokens_per_s": ("tokens/s", ",.0f"),
    "perf/step_time_ms": ("step (ms)", ".1f"),
    "mem/train_peak_allocated_mb": ("peak GPU mem (MB)", ",.0f"),
    "mem/peak_rss_mb": ("peak RSS (MB)", ",.0f"),
    "sweep/process_wall_s": ("wall (s)", ".0f"),
}
ENV_TAGS = ("device", "accelerator", "torch_version", "triton_version", "cuda_version", "python_version",
            "lightning_version", "git_commit", "data_digest", "data_dir", "attention")
_STATUS_ORDER = {"OK": 0, "OOM": 1}
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@contextlib.contextmanager
def tracking_store():
    """The tracking store's client (pipeline.tracking.tracking_uri), checked before anything runs and
    made mlflow's; a store that cannot be read (a damaged database, a broken server) is one line."""
    import mlflow
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import check_tracking, first_line, tracking_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    check_tracking(tracking_uri())
    mlflow.set_tracking_uri(tracking_uri())
    try:
        yield MlflowClient(tracking_uri())
    except (MlflowException, sqlalchemy.exc.SQLAlchemyError) as err:
        raise ConfigError(f"the tracking store {tracking_uri()} cannot be read: {first_line(err)}") from None


def find_parent(client: MlflowClient, ref: str, experiment_ids: list[str] | None = None) -> Run:
    """A sweep's parent run by id, or by name (the newest parent of that name, matched here: a name
    is never put in a filter string); the id of any other run is refused with what to ask for instead."""
    import mlflow

    if _RUN_ID.match(ref):
        try:
            run = client.get_run(ref)
        except mlflow.exceptions.MlflowException:
            run = None
        if run is not None:
            tags = run.data.tags
            if tags.get("sweep.role") == "parent":
                return run
            if tags.get("mlflow.parentRunId"):
                raise ConfigError(f"run {ref} ({run.info.run_name}) is not a parent run: it is one run of the "
                                  f"parent {tags['mlflow.parentRunId']}; report that one "
                                  f"(make report PARENT={tags['mlflow.parentRunId']})")
            raise ConfigError(f"run {ref} ({run.info.run_name}) is not the parent run of a sweep")
    ids = experiment_ids or [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, filter_string="tags.`sweep.role` = 'parent'",
                              order_by=["attributes.start_time DESC"])
    found = next((r for r in runs if r.info.run_name == ref), None)
    if found is None:
        raise ConfigError(f"no sweep parent run with id or name {ref!r} at {mlflow.get_tracking_uri()}")
    return found


def child_runs(parent: Run) -> list[Run]:
    import mlflow

    return mlflow.search_runs(experiment_ids=[parent.info.experiment_id], order_by=["attributes.start_time ASC"],
                              filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",  # a hex id: no quoting
                              output_format="list")


def new_run(client: MlflowClient, experiment_ids: list[str], filter_string: str, known: set[str]) -> Run | None:
    """The newest run matching `filter_string` that is not in `known`: the one a child process created."""
    found = client.search_runs(experiment_ids, filter_string, order_by=["attributes.start_time DESC"])
    return next((r for r in found if r.info.run_id not in known), None)


def run_status(run: Run) -> str:
    return run.data.tags.get("status") or ("OK" if run.info.status == "FINISHED" else run.info.status)


def runs_frame(runs: list[Run], axes: list[str]) -> pl.DataFrame:
    """One row per run: ids, status, axis labels (column = axis name), metrics, env tags."""
    import polars as pl

    metric_keys = sorted({k for r in runs for k in r.data.metrics} | set(METRICS))
    rows = []
    for r in runs:
        tags = r.data.tags
        rows.append({
            "run_id": r.info.run_id, "run_name": r.info.run_name, "state": r.info.status, "status": run_status(r),
            "start_ms": r.info.start_time, "end_ms": r.info.end_time,
            "config_hash": tags.get("sweep.config_hash") or r.info.run_id,
            "point": tags.get("sweep.point") or r.info.run_name, "error": tags.get("sweep.error"),
            "parallel": tags.get("sweep.parallel") or "1",  # runs sharing the device at once
            "concurrent": tags.get("sweep.concurrent_runs") or tags.get("sweep.parallel") or "1",  # on the host
            **{a: tags.get(f"sweep.axis.{a}") for a in axes},
            **{f"tag.{t}": tags.get(t) for t in ENV_TAGS},
            **{m: r.data.metrics.get(m) for m in metric_keys},
        })
    columns = ["run_id", "run_name", "state", "status", "start_ms", "end_ms", "config_hash", "point", "error",
               "parallel", "concurrent", *axes, *(f"tag.{t}" for t in ENV_TAGS), *metric_keys]
    schema = {k: (pl.Float64 if k in metric_keys else pl.Int64 if k.endswith("_ms") else pl.Utf8) for k in columns}
    return pl.DataFrame(rows, schema=schema)


def grid_frame(parent: Run, hashes: list[str] | None) -> pl.DataFrame:
    """One row per point of the parent's grid, in grid order (axes and labels in file order): its
    finished run if any, else its OOM record, else its newest attempt; only the runs of the config
    hashes `hashes` (None: every child)."""
    import polars as pl

    axes = parent_axes(parent)
    df = runs_frame(child_runs(parent), list(axes))
    if hashes is not None:
        df = df.filter(pl.col("config_hash").is_in(hashes))
    order = pl.col("status").replace_strict(_STATUS_ORDER, default=2, return_dtype=pl.Int64)
    df = (df.with_columns(_pref=order).sort(["_pref", "start_ms"], descending=[False, True])
            .unique(subset=["config_hash"], keep="first", maintain_order=True).drop("_pref"))
    keys = [pl.col(axis).replace_strict({label: i for i, label in enumerate(labels)}, default=len(labels),
                                        return_dtype=pl.Int64)
            for axis, labels in axes.items() if axis in df.columns]
    return df.sort(keys) if keys else df


def fmt(value, spec: str = ".2f", unit: str = "") -> str:
    """`value` formatted, '-' where there is no number (None, NaN)."""
    return "-" if value is None or value != value else format(value, spec) + unit


def memory_metric(df: pl.DataFrame) -> tuple[str, str]:
    """(metric, axis label) of peak memory: the GPU's where any run was on CUDA, else the process's RSS."""
    if "cuda" in df["tag.accelerator"].to_list():
        return "mem/train_peak_allocated_mb", "peak GPU memory allocated, training (MB)"
    return "mem/peak_rss_mb", "peak process RSS (MB; CPU run)"


def summary_rows(df: pl.DataFrame, axes: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the summary: axis labels, status, quality, speed, memory, wall, run id."""
    mem = memory_metric(df)[0]
    shown = [k for k in METRICS if not k.startswith("mem/") or k == mem]
    header = [*axes, "status", *(METRICS[k][0] for k in shown), "run"]
    rows = []
    for row in df.iter_rows(named=True):
        status = row["status"] if row["status"] != "FAILED" or not row["error"] else f"FAILED: {row['error'][:80]}"
        rows.append([*(row[a] or "-" for a in axes), status,
                     *(fmt(row.get(k), METRICS[k][1]) for k in shown), row["run_id"]])
    return header, rows


def table_lines(header: list[str], rows) -> list[str]:
    """A markdown table's lines, its cells as they are (:func:`markdown_table` escapes them)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(table_lines(header, [[str(c).replace("|", "\\|") for c in r] for r in rows]))


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns two spaces apart under a dashed rule: the console's table."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*map(str, r)) for r in rows)]
    return "\n".join(ln.rstrip() for ln in lines)


def parent_axes(parent: Run) -> dict[str, list[str]]:
    return json.loads(parent.data.tags.get("sweep.axes") or "{}")
