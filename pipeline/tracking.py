"""MLflow: what every run records, how a run and a command end, how the project's runs show in the UI.

:class:`MLflowRun` (the CLI's ``mlflow.*`` options) starts or resumes the run; a run that raises is
ended FAILED (KILLED when interrupted), never left RUNNING; :func:`run_command` gives a command its
exit status. :func:`use_experiment` and :func:`save_runs_view` make the UI open on model training
and on a comparison. Where runs go and the store's pre-flight: :mod:`pipeline.tracking_store`.
Why: docs/training.md#tracking.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib.metadata
import json
import platform
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import mlflow
import pytorch_lightning as pl
import torch
from mlflow.tracking import MlflowClient
from pytorch_lightning.loggers import MLFlowLogger
from pytorch_lightning.utilities.exceptions import SIGTERMException

from models.config import InvalidConfig
from pipeline.errors import ConfigError, RunError
from pipeline.runenv import device_name, git_commit  # noqa: F401  (re-exported: tags, reports)
from pipeline.signals import flush_and_exit, handling_signals, kill_peers
from pipeline.tracking_store import (  # noqa: F401  (check_tracking, HTTP_BOUNDS: re-exported, the lab uses them)
    HTTP_BOUNDS,
    check_tracking,
    first_line,
    shown,
    tracking_uri,
)

DEFAULT_EXPERIMENT = "jagged-rankers"

_STARTED: list[str] = []  # the runs this process started or resumed: what the watchdog ends


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment_tags() -> dict[str, str]:
    return {
        "git_commit": git_commit(),
        "device": device_name(),
        "accelerator": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_version": torch.__version__,
        "triton_version": _version("triton"),
        "cuda_version": str(torch.version.cuda),
        "python_version": platform.python_version(),
        "lightning_version": pl.__version__,
    }


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"}; lists and dicts of lists as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


class MLflowRun(pl.Callback):
    """The MLflow run of this command (mlflow.* options).

    Args:
        experiment_name: MLflow experiment of a new run.
        run_name: name of a new run (default: <attention>-L<max_seq_len>).
        run_id: continue this run instead of creating one (set from --ckpt_path on resume).
        parent_run_id: make the run a child of this one (sweeps, the main job).
        system_metrics: sample CPU/GPU utilisation and memory into the run."""

    def __init__(
        self,
        experiment_name: str = DEFAULT_EXPERIMENT,
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        system_metrics: bool = True,
    ):
        self.experiment_name, self.run_name, self.run_id = experiment_name, run_name, run_id
        self.parent_run_id, self.system_metrics = parent_run_id, system_metrics
        self.resumed = run_id is not None

    @property
    def state_key(self) -> str:
        return "MLflowRun"

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def start(self, tags: dict[str, str]) -> str:
        """Start (or resume) the run in this process; returns its id. SIGTERM and SIGINT wait until
        the run is the active one (docs/training.md#tracking)."""
        try:
            with interrupts_deferred():
                return self._start(tags)
        except mlflow.exceptions.MlflowException as err:
            raise ConfigError(f"cannot start an MLflow run at {shown(tracking_uri())}: {first_line(err)}") from None

    def _start(self, tags: dict[str, str]) -> str:
        mlflow.set_tracking_uri(tracking_uri())
        if self.run_id is None:
            experiment_id = use_experiment(self.experiment_name)
            run = mlflow.start_run(
                experiment_id=experiment_id, run_name=self.run_name, parent_run_id=self.parent_run_id,
                tags=tags, log_system_metrics=self.system_metrics,
            )
        else:
            try:
                recorded = MlflowClient().get_run(self.run_id).data.tags
            except mlflow.exceptions.MlflowException as err:
                raise ConfigError(f"cannot resume MLflow run {self.run_id} at {tracking_uri()}: {err}") from None
            run = mlflow.start_run(run_id=self.run_id, log_system_metrics=self.system_metrics)
            # what the run started with stays (its commit above all); a resume by other code says so
            mlflow.set_tags({k: v for k, v in tags.items() if k not in recorded})
            if tags.get("git_commit", recorded.get("git_commit")) != recorded.get("git_commit"):
                mlflow.set_tag("git_commit.resumed", tags["git_commit"])
        self.run_id = run.info.run_id
        _STARTED.append(self.run_id)
        return self.run_id

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Ctrl-C, SIGINT from a sweep, SIGTERM from `timeout`/`kill`: stopped, not failed
        status = "KILLED" if is_interrupt(exception) else "FAILED"
        if fail_active_run(status) is not None:
            print(f"MLflow run {self.run_id} marked {status} ({type(exception).__name__}: {exception})",
                  file=sys.stderr)


KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
# MLflow 3.17's UI opens every experiment in the view its workflow switch holds (GenAI for a new
# browser), whatever the kind tag says; a link that names the view opens there
UI_QUERY = "workflowType=machine_learning"
UI_ADDRESS = "http://127.0.0.1:5000"  # `make ui`'s


def use_experiment(name: str) -> str:
    """The id of the MLflow experiment `name` at the current tracking URI (created if new), tagged
    as model training (mlflow.experimentKind); the active experiment from now on."""
    experiment = mlflow.set_experiment(name)
    if experiment.tags.get(KIND_TAG) != MODEL_TRAINING:
        MlflowClient().set_experiment_tag(experiment.experiment_id, KIND_TAG, MODEL_TRAINING)
    return experiment.experiment_id


def ui_link(experiment_id: str, run_id: str | None = None) -> str:
    """The UI's page of a run (the runs list without one), in the model-training view; relative to
    the UI's address."""
    return f"#/experiments/{experiment_id}/runs{'/' + run_id if run_id else ''}?{UI_QUERY}"


def save_runs_view(experiment_id: str, name: str, run_ids: list[str], shown: dict[str, dict[str, float]],
                   columns: list[str] = (), client: MlflowClient | None = None) -> str:
    """A saved view of the experiment's runs list (the UI's Views menu): the runs `run_ids` in this
    order (tagged `view.order`: the UI leaves pinned rows out of a shared view, and sorted by start
    time nests children under a collapsed parent); as columns each run's `shown` values, logged on it
    as `headline/<key>` (the runs table prints every digit a metric has: give them rounded), then the
    metrics `columns`. Returns its link relative to the UI's address."""
    from mlflow.entities import Metric

    client, now, keys = client or MlflowClient(tracking_uri()), int(time.time() * 1000), {}
    for i, run_id in enumerate(run_ids):
        client.set_tag(run_id, "view.order", str(i).zfill(len(str(len(run_ids)))))
        values = {f"headline/{k}": v for k, v in shown.get(run_id, {}).items()}
        client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in values.items()])
        keys.update(dict.fromkeys(values))
    columns = [f"metrics.`{k}`" for k in [*keys, *columns]]
    widths = {c: 7 * len(c) - 38 for c in columns}  # the header, the key without metrics.``, fits
    state = {"searchFilter": f"attributes.run_id IN ({', '.join(repr(r) for r in run_ids)})",
             "orderByKey": "tags.`view.order`", "orderByAsc": True, "startTime": "ALL", "lifecycleFilter": "Active",
             "datasetsFilter": [], "modelVersionFilter": "All Runs", "selectedColumns": columns,
             "columnOrder": columns, "columnWidths": widths}
    view = {"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
    key = re.sub(r"[^A-Za-z0-9_-]", "-", name)
    client.set_experiment_tag(experiment_id, f"mlflow.sharedViewState.{key}", json.dumps(view))
    return f"{ui_link(experiment_id)}&viewStateShareKey={key}"


@contextmanager
def interrupts_deferred():
    """SIGTERM and SIGINT that arrive while the block runs are held and raised again once it ends,
    to the handlers from before. A no-op off the main thread, and for a signal whose handler was
    not set from Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    previous = {s: h for s, h in previous.items() if h is not None}
    for s in previous:
        signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def is_interrupt(exception: BaseException) -> bool:
    """Ctrl-C / SIGINT (KeyboardInterrupt) or SIGTERM (Lightning's SIGTERMException)."""
    return isinstance(exception, (KeyboardInterrupt, SIGTERMException))


def end_run(status: str) -> None:
    """End the active run (FINISHED / FAILED / KILLED), if any; stops system metrics."""
    if mlflow.active_run() is not None:
        mlflow.end_run(status)


def fail_active_run(status: str = "FAILED") -> str | None:
    """End the active run with `status` while handling another error (signals held meanwhile; a
    failed end tried once more by id); a store that fails now too is one line on stderr, if any,
    not an error raised over the one being handled. Returns the run's id (None: no active run)."""
    run = mlflow.active_run()
    if run is None:
        return None
    run_id, handled = run.info.run_id, sys.exc_info()[1]
    if is_interrupt(handled):  # raised inside a read of the store, its frames hold the read open: a sqlite
        traceback.clear_frames(handled.__traceback__)  # lock on every write, the run's end included
        gc.collect()
    with interrupts_deferred():
        try:
            end_run(status)
        except Exception:  # noqa: BLE001 - whatever failed, the store still says RUNNING: once more by id
            try:
                MlflowClient(tracking_uri()).set_terminated(run_id, status)
            except (mlflow.exceptions.MlflowException, OSError) as err:
                with contextlib.suppress(OSError):
                    print(f"could not mark MLflow run {run_id} {status} at {shown(tracking_uri())}: "
                          f"{first_line(err)}", file=sys.stderr)
    return run_id


class RunLogger(MLFlowLogger):
    """Lightning's MLFlowLogger that ends an interrupted run KILLED, not FAILED (Lightning finalizes
    every logger "failed" from inside its exception handlers, after the callbacks' on_exception), and
    that does not log a resumed run's metric points twice (`logged`: metric -> last step it holds)."""

    def __init__(self, *args, logged: dict[str, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._logged = logged or {}

    def log_metrics(self, metrics, step=None) -> None:
        if self._logged and step is not None:
            metrics = {k: v for k, v in metrics.items() if step > self._logged.get(k, -1)}
        if metrics:
            super().log_metrics(metrics, step)

    def finalize(self, status: str = "success") -> None:
        if status == "failed" and is_interrupt(sys.exc_info()[1]):
            status = "KILLED"
        super().finalize(status)


# no space, over quota, read-only file system, no permission: the machine's state, not a bug
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def ending(err: BaseException) -> tuple[int, str, str] | None:
    """(exit status, run status, one-line message) of an error that needs no traceback."""
    cause = err
    while cause is not None and not isinstance(cause, (ConfigError, InvalidConfig)):
        cause = cause.__cause__  # jsonargparse wraps what a config class raised while parsing
    if cause is not None:
        return 2, "FAILED", f"error: {cause}"
    if isinstance(err, (FloatingPointError, RunError)):  # NaN/inf loss, an undefined monitored metric
        return 1, "FAILED", f"error: {err}"
    if isinstance(err, SIGTERMException):
        return 143, "KILLED", "stopped by SIGTERM"
    if isinstance(err, KeyboardInterrupt) or (isinstance(err, SystemExit)
                                              and isinstance(err.__context__, KeyboardInterrupt)):
        return 130, "KILLED", "interrupted (Ctrl-C / SIGINT)"  # Lightning exits 1 after a Ctrl-C
    if isinstance(err, mlflow.exceptions.MlflowException):
        return 1, "FAILED", f"error: MLflow tracking at {shown(tracking_uri())} failed: {first_line(err)}"
    if _peer_failed(err):
        cause = re.sub(r"^\[[^\]]*\]\s*", "", first_line(err)).split(". ")[0]  # Gloo's source position, its advice
        return 1, "FAILED", f"error: another process of the distributed run failed or died ({cause})"
    if isinstance(err, OSError) and err.errno in _DISK_ERRNOS:
        where = f": {err.filename}" if err.filename else ""
        return 1, "FAILED", f"error: {err.strerror or first_line(err)}{where}"
    return None


def _peer_failed(err: BaseException) -> bool:
    """A collective that failed because a peer process is gone (Gloo sees the closed connection)."""
    return isinstance(err, torch.distributed.DistError) or (
        isinstance(err, RuntimeError) and re.search(r"/gloo/|Connection (reset|closed) by peer", str(err)) is not None)


def run_command(body) -> int:
    """Run ``body()`` as a command that records an MLflow run: 0 when it returns; for an expected
    failure (:func:`ending`) the active run ended FAILED or KILLED, one line on stderr and its exit
    status (2 config, 1 failed, 130 SIGINT, 143 SIGTERM); anything else ends the run FAILED and is
    raised. SIGTERM and a stuck or dead peer process never hang it (:mod:`pipeline.signals`)."""
    with handling_signals(_force_end):
        try:
            body()
            return 0
        except BaseException as err:
            end = ending(err)
            # errors outside the trainer (the trainer's own callbacks have ended the run already)
            run_id = fail_active_run(end[1] if end else "FAILED")
            if end is None:
                if run_id is not None:
                    print(f"MLflow run {run_id} marked FAILED ({type(err).__name__}: {err})", file=sys.stderr)
                raise
            print(end[2], file=sys.stderr)
            return end[0]


def _force_end(code: int, status: str, message: str) -> None:
    """The watchdog's end of a process that did not stop in time: the line, the run ended with
    `status` by its id (the main thread, stuck, holds the active run), local peers killed."""
    with contextlib.suppress(OSError):
        print(message, file=sys.stderr)
    if _STARTED:
        marker = threading.Thread(target=_mark_run, args=(_STARTED[-1], status), daemon=True)
        marker.start()
        marker.join(15.0)
    kill_peers()
    flush_and_exit(code)


def _mark_run(run_id: str, status: str) -> None:
    with contextlib.suppress(Exception):  # the process ends next whatever happens here
        client = MlflowClient(tracking_uri())
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status)


def logged_steps(run_id: str) -> dict[str, int]:
    """The last step of every metric the run holds (what a resumed run must not log again)."""
    client = MlflowClient(tracking_uri())
    keys = client.get_run(run_id).data.metrics
    return {k: max((m.step for m in client.get_metric_history(run_id, k)), default=-1) for k in keys}


def log_run_inputs(config: dict, config_yaml: str, meta_path: Path, resumed: bool) -> None:
    """Params (`config`, nested or flat), the resolved config's YAML and the data's meta.json into
    the active run. A resumed run keeps its params (MLflow forbids changing them) and gets the
    config it was resumed with as ``config_resumed.yaml``."""
    with tempfile.TemporaryDirectory() as tmp:
        name = "config_resumed.yaml" if resumed else "config.yaml"
        (Path(tmp) / name).write_text(config_yaml)
        mlflow.log_artifact(str(Path(tmp) / name))
    if not resumed:
        items = list(flatten(config).items())
        for i in range(0, len(items), 100):
            mlflow.log_params({k: v[:6000] for k, v in items[i : i + 100]})
        mlflow.log_artifact(str(meta_path), artifact_path="data")
