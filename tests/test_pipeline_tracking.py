"""Runs in separate processes: kill and resume, the main job's comparison on its parent run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from pipeline.resume import checkpoint_run_id, load_checkpoint
from test_pipeline_cli import QUALITY, all_runs, fit_args, fresh_tracking_uri, history
from test_pipeline_data import tiny_data_dir

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


class KillAfterStep(pl.Callback):
    """Dies like `kill -9` once `step` optimizer steps are done: no cleanup, no MLflow status."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            os._exit(137)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


def _env(uri: str) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(TESTS)}


def _fit(args: list[str], uri: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(uri), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory) -> dict[str, dict[int, float]]:
    """Metric history of the run that the killed-and-resumed runs must reproduce."""
    root = tmp_path_factory.mktemp("full")
    with pytest.MonkeyPatch.context() as mp:
        uri = fresh_tracking_uri(tmp_path_factory, root)
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setattr(sys, "argv", ["pipeline"])
        main(fit_args(tiny, root, "--mlflow.run_name", "full", "--mlflow.system_metrics", "false"))
    return history(uri, all_runs(uri)["full"].info.run_id)


@pytest.mark.slow
@pytest.mark.parametrize(
    "checkpointing",
    [["--checkpoint.every_n_train_steps", "3"], []],
    ids=["mid-epoch-checkpoint", "epoch-end-checkpoint"],
)
def test_killed_run_resumes_into_the_same_mlflow_run(tiny, uninterrupted, tmp_path, tmp_path_factory, checkpointing):
    """tiny: 8 steps an epoch; killed at step 11, resumed from step 9 (mid-epoch) or 8 (epoch end)."""
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    common = ["--mlflow.system_metrics", "false", *checkpointing]
    kill = tmp_path / "kill.yaml"
    kill.write_text("trainer:\n  callbacks:\n    - class_path: test_pipeline_tracking.KillAfterStep\n"
                    "      init_args: {step: 11}\n")
    root = tmp_path / "killed"
    proc = _fit(fit_args(tiny, root, "--mlflow.run_name", "killed", *common, "--config", str(kill)), uri)
    assert proc.returncode == 137, proc.stderr[-3000:]
    killed = all_runs(uri)["killed"]
    assert killed.info.status == "RUNNING"  # what a SIGKILL leaves behind
    ckpt = next(root.rglob("last.ckpt"))
    assert checkpoint_run_id(load_checkpoint(str(ckpt))) == killed.info.run_id
    before = history(uri, killed.info.run_id)
    assert max(before["train/loss_step"]) >= 9 and not before["test/auc"]

    proc = _fit(fit_args(tiny, root, *common, "--ckpt_path", str(ckpt)), uri)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = all_runs(uri)
    assert set(runs) == {"killed"}, "the resumed fit must continue the same run"
    assert runs["killed"].info.status == "FINISHED"
    after = history(uri, killed.info.run_id)
    for key, steps in before.items():  # nothing logged before the kill is lost
        assert steps.items() <= after[key].items(), key
    for key in QUALITY:  # and the whole history is the uninterrupted run's
        assert after[key].keys() == uninterrupted[key].keys(), key
        for step, value in uninterrupted[key].items():
            assert after[key][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, step)
    client = MlflowClient(uri)
    for key in QUALITY:  # the steps between the last checkpoint and the kill are not logged twice
        steps = [m.step for m in client.get_metric_history(killed.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))


@pytest.mark.slow
def test_main_job_puts_the_comparison_on_its_parent(tiny, tmp_path, tmp_path_factory):
    """The main job (`make experiment`: the sweep of main.yaml) on tiny data: the table printed and
    written, and the parent run, read back through the MLflow client, carries the comparison."""
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "experiments", "sweep", "experiments/ablations/main.yaml", "--new",
           "--data", str(tiny), "--set", "name=main-tiny", "--set", "configs=[base, tiny]",
           "--set", "grid={model.ranker.attention: [dense, jagged]}", "--results", str(results),
           "--set", "trainer.max_epochs=1", "--set", "mlflow.system_metrics=false",
           "--set", f"trainer.default_root_dir={tmp_path / 'ckpt'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(uri), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for text in ("attention", "test AUC", "train ex/s", "peak RSS (MB)", "wall (s)", "MLflow tracking URI", "make ui"):
        assert text in out, text
    md = (results / "training" / "cpu" / "main-tiny.md").read_text()
    assert "| dense | OK |" in md and "| jagged | OK |" in md and "git commit" in md

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("main-job")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"main-tiny", "1 dense", "2 jagged"}  # children sort in the order they ran
    assert all(r.info.status == "FINISHED" for r in runs.values())
    parent = runs["main-tiny"]
    assert runs["2 jagged"].data.tags["mlflow.parentRunId"] == parent.info.run_id
    m, raw = parent.data.metrics, {a: runs[f"{i} {a}"].data.metrics for i, a in ((1, "dense"), (2, "jagged"))}
    for attention, child in raw.items():  # as shown: rounded (MLflow's tables print every digit)
        for key, name, decimals in (("test/auc", "test_auc", 4), ("perf/train_examples_per_s", "examples_per_s", 0),
                                    ("perf/step_time_ms", "step_ms", 1), ("mem/peak_rss_mb", "peak_rss_mb", 0)):
            assert m[f"{attention}.{name}"] == child[f"headline/{name}"] == round(child[key], decimals), (attention, key)
    speed = raw["jagged"]["perf/train_examples_per_s"] / raw["dense"]["perf/train_examples_per_s"]
    assert m["jagged_over_dense.speedup"] == pytest.approx(speed, abs=0.005)
    assert m["jagged_over_dense.memory_saving"] == pytest.approx(
        raw["dense"]["mem/peak_rss_mb"] / raw["jagged"]["mem/peak_rss_mb"], abs=0.005)
    # the comparison's view: these runs, the parent first, the headline columns, its link printed and in the note
    exp = client.get_experiment(exp.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    state = json.loads(json.loads(exp.tags["mlflow.sharedViewState.main-tiny"])["state"])
    assert state["selectedColumns"] == [f"metrics.`{k}`" for k in ("headline/test_auc", "headline/examples_per_s",
                                        "headline/step_ms", "headline/peak_rss_mb", "jagged_over_dense.speedup")]
    shown = client.search_runs([exp.experiment_id], state["searchFilter"],
                               order_by=[f"{state['orderByKey']} {'ASC' if state['orderByAsc'] else 'DESC'}"])
    assert [r.info.run_name for r in shown] == ["main-tiny", "1 dense", "2 jagged"]
    view = parent.data.tags["sweep.view"]
    assert view == f"#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=main-tiny"
    parent_link = f"#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning"
    assert f"http://127.0.0.1:5000/{view} (the comparison)" in out and f"5000/{parent_link} (the parent run)" in out
    note = parent.data.tags["mlflow.note.content"]
    assert "| dense |" in note and "| jagged |" in note and f"]({view})" in note
    arts = {f.path for f in client.list_artifacts(parent.info.run_id, "comparison")}
    assert arts == {"comparison/comparison.md", "comparison/comparison.html"}
    report = {f.path for f in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.md", "report/throughput.png", "report/memory.png"} <= report


def test_a_run_whose_end_is_interrupted_is_still_ended(tmp_path, tmp_path_factory, monkeypatch):
    """mlflow.end_run takes the run off its stack before the store records the status: a SIGTERM
    (or a store error) in between left the run RUNNING with nothing left to end it."""
    import signal

    import mlflow

    from pipeline.tracking import MLflowRun, fail_active_run

    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    real_terminate = MlflowClient.set_terminated
    calls = []

    def signalled_then_failing(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 1:  # the first try: a SIGTERM arrives, then the store fails
            os.kill(os.getpid(), signal.SIGTERM)
            raise mlflow.exceptions.MlflowException("database is locked")
        return real_terminate(self, *args, **kwargs)

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        run_id = MLflowRun(experiment_name="end", system_metrics=False).start({"t": "1"})
        monkeypatch.setattr(MlflowClient, "set_terminated", signalled_then_failing)
        with pytest.raises(Stopped):  # the signal is raised again once the run is ended
            fail_active_run("KILLED")
    finally:
        signal.signal(signal.SIGTERM, previous)
        monkeypatch.undo()
        if mlflow.active_run() is not None:
            mlflow.end_run()
    assert len(calls) == 2 and MlflowClient(uri).get_run(run_id).info.status == "KILLED"


def test_a_sigterm_while_the_run_starts_waits_until_the_run_can_be_ended(tmp_path, tmp_path_factory, monkeypatch):
    """A sweep killed while its fit starts the MLflow run: SIGTERM arriving after the store has
    the run and before it is the active one left it RUNNING for ever. It is now held back until
    the run is active, so the handler's exit path ends the run KILLED."""
    import signal
    import threading

    import mlflow

    from pipeline.tracking import MLflowRun, fail_active_run

    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    real_create = MlflowClient.create_run

    def create_then_killed(self, *args, **kwargs):
        run = real_create(self, *args, **kwargs)  # the store has the run, still RUNNING
        os.kill(os.getpid(), signal.SIGTERM)
        return run

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped()

    monkeypatch.setattr(MlflowClient, "create_run", create_then_killed)
    previous = signal.signal(signal.SIGTERM, stop)
    idle = threading.Event()  # a fit has threads (loaders, MLflow's): the kernel may hand them the signal
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    try:
        with pytest.raises(Stopped):
            MLflowRun(experiment_name="sigterm", system_metrics=False).start({"t": "1"})
        assert mlflow.active_run() is not None  # the signal landed once the run was active
        fail_active_run("KILLED")
    finally:
        idle.set()
        signal.signal(signal.SIGTERM, previous)
        if mlflow.active_run() is not None:
            mlflow.end_run()
    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("sigterm").experiment_id])
    assert run.info.status == "KILLED"


def test_a_sigterm_inside_a_store_read_does_not_keep_the_run_from_ending(tmp_path, tmp_path_factory, monkeypatch):
    """A sweep killed while its fit logs its inputs: run_command's handler raised SIGTERMException
    inside an MLflow read of the sqlite store, after the query ran and before its rows were fetched.
    SQLAlchemy closes a cursor on an Exception only, so the read stayed open in the exception's
    frames, and its lock kept every other connection from writing the run's end (20 s busy timeout,
    each try) until the watchdog ended the process: the run left RUNNING without params."""
    import mlflow
    from pytorch_lightning.utilities.exceptions import SIGTERMException
    from sqlalchemy.orm import loading

    from pipeline.tracking import MLflowRun, fail_active_run

    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    real_instances, real_terminate, ends = loading.instances, MlflowClient.set_terminated, []

    def interrupted(*args, **kwargs):  # where the handler raised: the query ran, its rows not yet read
        monkeypatch.setattr(loading, "instances", real_instances)
        raise SIGTERMException()

    def counted(self, *args, **kwargs):
        ends.append(args)
        return real_terminate(self, *args, **kwargs)

    try:  # system metrics: a second thread of the run, so the store holds more than one connection
        run_id = MLflowRun(experiment_name="read", system_metrics=True).start({"t": "1"})
        monkeypatch.setattr(loading, "instances", interrupted)
        monkeypatch.setattr(MlflowClient, "set_terminated", counted)
        with pytest.raises(SIGTERMException):
            try:
                mlflow.log_params({"a": "1"})
            except SIGTERMException:
                fail_active_run("KILLED")  # as run_command does, while the exception is handled
                raise
    finally:
        monkeypatch.undo()
        if mlflow.active_run() is not None:
            mlflow.end_run()
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"
    assert len(ends) == 1, "the run's end failed while the interrupted read held the store"


def test_the_projects_experiments_open_as_model_training_with_a_saved_view(tmp_path, tmp_path_factory, monkeypatch):
    """MLflow 3.17 opens an experiment in its GenAI view unless told otherwise: every experiment a
    run of the pipeline starts in is tagged mlflow.experimentKind, and a saved view of the runs list
    shows the given columns in their order (what the UI's Views menu and the link open)."""
    from pipeline.tracking import MLflowRun, end_run, save_runs_view

    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    MLflowRun(experiment_name="kind", system_metrics=False).start({"t": "1"})
    end_run("FINISHED")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("kind")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    ids = [client.create_run(exp.experiment_id, run_name=f"r{i}").info.run_id for i in range(11)][::-1]
    shown = {ids[1]: {"test_auc": 0.6123, "step_ms": 12.5}, ids[2]: {"test_auc": 0.6}}
    link = save_runs_view(exp.experiment_id, "main small", ids, shown, ["x_over_y.speedup"])
    assert link == f"#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=main-small"
    view = json.loads(client.get_experiment(exp.experiment_id).tags["mlflow.sharedViewState.main-small"])
    state = json.loads(view["state"])
    columns = ["metrics.`headline/test_auc`", "metrics.`headline/step_ms`", "metrics.`x_over_y.speedup`"]
    assert view["name"] == "main small" and state["selectedColumns"] == state["columnOrder"] == columns
    rows = client.search_runs([exp.experiment_id], state["searchFilter"],  # these runs, in this order
                              order_by=[f"{state['orderByKey']} {'ASC' if state['orderByAsc'] else 'DESC'}"])
    assert [r.info.run_id for r in rows] == ids
    assert rows[1].data.metrics == {"headline/test_auc": 0.6123, "headline/step_ms": 12.5}
