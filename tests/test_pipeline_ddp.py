"""`pipeline fit` through Lightning's DDP strategy on CPU processes (Gloo): two processes train
and evaluate like one process on the same global batches, record one MLflow run, and resume
after a kill; one process through the DDP path works too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from pipeline.resume import checkpoint_run_id, load_checkpoint
from pipeline.cuda_graphs import loss_and_grads, model_inputs
from test_pipeline_cli import QUALITY, all_runs, fit_args, fresh_tracking_uri, history
from test_pipeline_data import tiny_data_dir

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# tiny: 64 rows per process and step; one epoch of 4 global batches, 2 of validation, 2 of test
BUDGET = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
          "--trainer.limit_test_batches", "2", "--trainer.log_every_n_steps", "1", "--mlflow.system_metrics", "false",
          "--torch_num_threads", "1", "--perf.warmup_steps", "1"]
DDP = ["--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]


class HooklessSteps(pl.Callback):
    """Every step as a CUDA-graph step runs on a GPU, without the graphs: forward and
    torch.autograd.grad (no reducer hook fires), the gradients bound to .grad, then the module
    averages all of them by hand."""

    def on_train_start(self, trainer, pl_module) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]

        def step(batch: dict):
            loss, grads = loss_and_grads(pl_module._graph_loss, model_inputs(batch), batch["label"], params, None)
            for p, g in zip(params, grads):
                p.grad = g
            return loss

        pl_module._graphs = step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


def _fit(args: list[str], uri: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline", *args]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


@pytest.fixture(scope="module")
def two_processes(tiny, tmp_path_factory):
    """A 2-process fit (batch 32 each) and a 1-process fit (batch 64), in one database."""
    root = tmp_path_factory.mktemp("ddp")
    uri = fresh_tracking_uri(tmp_path_factory, root)
    proc = _fit(fit_args(tiny, root / "two", *BUDGET, *DDP, "--trainer.devices", "2", "--data.batch_size", "32",
                         "--mlflow.run_name", "two"), uri)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = _fit(fit_args(tiny, root / "one", *BUDGET, "--data.batch_size", "64", "--mlflow.run_name", "one"), uri)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return uri, all_runs(uri)


@pytest.mark.slow
def test_two_processes_train_and_evaluate_like_one_on_the_global_batch(two_processes):
    uri, runs = two_processes
    assert set(runs) == {"two", "one"}, "one MLflow run per fit, whatever the processes"
    two, one = runs["two"], runs["one"]
    assert two.info.status == one.info.status == "FINISHED"
    assert two.data.tags["world_size"] == "2" and one.data.tags["world_size"] == "1"
    assert two.data.params["trainer.devices"] == "2" and two.data.params["data.batch_size"] == "32"
    h2, h1 = history(uri, two.info.run_id), history(uri, one.info.run_id)
    for key in QUALITY:  # the loss of every step, and metrics over the same evaluation examples
        assert h2[key].keys() == h1[key].keys() and h1[key], key
        for step, value in h1[key].items():
            assert h2[key][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, step)
    m2, m1 = two.data.metrics, one.data.metrics
    assert 1.0 <= m2["perf/rank_tokens_max_over_mean"] <= m2["perf/rank_tokens_max_over_mean_worst"] < 1.01
    assert m2["comm/sent_mb_per_step"] > 0 and "comm/sent_mb_per_step" not in m1
    assert m2["perf/train_examples_per_s"] > 0 and m2["mem/peak_rss_mb"] > 0


@pytest.mark.slow
def test_a_killed_ddp_run_resumes_into_the_same_run(tiny, two_processes, tmp_path, tmp_path_factory):
    """Killed (every process, like kill -9) after step 6 of 8, resumed from the checkpoint of step 5."""
    uri0, runs = two_processes
    want = history(uri0, runs["two"].info.run_id)
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    kill = tmp_path / "kill.yaml"
    kill.write_text("trainer:\n  callbacks:\n    - class_path: test_pipeline_tracking.KillAfterStep\n"
                    "      init_args: {step: 6}\n")
    args = [*BUDGET, *DDP, "--trainer.devices", "2", "--data.batch_size", "32", "--checkpoint.every_n_train_steps", "5"]
    root = tmp_path / "killed"
    proc = _fit(fit_args(tiny, root, *args, "--mlflow.run_name", "killed", "--config", str(kill)), uri)
    assert proc.returncode == 137, proc.stderr[-4000:]
    killed = all_runs(uri)["killed"]
    assert killed.info.status == "RUNNING"
    ckpt = next(root.rglob("last.ckpt"))
    assert checkpoint_run_id(load_checkpoint(str(ckpt))) == killed.info.run_id
    proc = _fit(fit_args(tiny, root, *args, "--ckpt_path", str(ckpt)), uri)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = all_runs(uri)
    assert set(runs) == {"killed"} and runs["killed"].info.status == "FINISHED"
    got = history(uri, killed.info.run_id)
    for key in QUALITY:  # the uninterrupted 2-process run's history, each point once
        assert got[key].keys() == want[key].keys(), key
        for step, value in want[key].items():
            assert got[key][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, step)
        steps = [m.step for m in MlflowClient(uri).get_metric_history(killed.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)


@pytest.mark.slow
def test_gradients_averaged_by_hand_train_like_ddps_reducer(tiny, two_processes, tmp_path, tmp_path_factory):
    """cuda_graphs on a CPU trains eagerly with the item table left out of DDP's reducer; with
    hookless steps (the graph step's path) every gradient is averaged by hand: both train the
    reducer's run."""
    uri0, runs = two_processes
    want = history(uri0, runs["two"].info.run_id)
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    hookless = tmp_path / "hookless.yaml"
    hookless.write_text("trainer:\n  callbacks:\n    - class_path: test_pipeline_ddp.HooklessSteps\n")
    args = [*BUDGET, *DDP, "--trainer.devices", "2", "--data.batch_size", "32", "--model.cuda_graphs", "true"]
    for name, extra in (("table", []), ("hookless", ["--config", str(hookless)])):
        proc = _fit(fit_args(tiny, tmp_path / name, *args, "--mlflow.run_name", name, *extra), uri)
        assert proc.returncode == 0, proc.stderr[-4000:]
    for name, run in all_runs(uri).items():
        got = history(uri, run.info.run_id)
        for key in QUALITY:
            assert got[key].keys() == want[key].keys(), (name, key)
            for step, value in want[key].items():
                assert got[key][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key, step)
        assert run.data.metrics["comm/sent_mb_per_step"] == pytest.approx(runs["two"].data.metrics["comm/sent_mb_per_step"])


@pytest.mark.slow
def test_the_padded_layouts_train_the_same_function_under_ddp(tiny, two_processes, tmp_path, tmp_path_factory):
    uri0, runs = two_processes
    want = history(uri0, runs["two"].info.run_id, ("train/loss_step", "test/auc"))
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    for attention in ("dense", "sdpa"):
        proc = _fit(fit_args(tiny, tmp_path / attention, *BUDGET, *DDP, "--trainer.devices", "2", "--data.batch_size",
                             "32", "--trainer.max_epochs", "1", "--model.ranker.attention", attention,
                             "--mlflow.run_name", attention), uri)
        assert proc.returncode == 0, proc.stderr[-4000:]
        run = all_runs(uri)[attention]
        got = history(uri, run.info.run_id, ("train/loss_step", "test/auc"))
        assert run.data.tags["attention"] == attention and run.data.tags["world_size"] == "2"
        for step, value in got["train/loss_step"].items():  # the jagged run's first epoch
            assert value == pytest.approx(want["train/loss_step"][step], abs=1e-4), (attention, step)
        assert list(got["test/auc"].values())[0] > 0


@pytest.mark.slow
def test_one_process_through_the_ddp_path_records_one_run(tiny, tmp_path, tmp_path_factory):
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    proc = _fit(fit_args(tiny, tmp_path, *BUDGET, *DDP, "--trainer.devices", "1", "--trainer.max_epochs", "1",
                         "--mlflow.run_name", "ws1"), uri)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = all_runs(uri).values()
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "1"
    assert run.data.metrics["test/auc"] > 0 and run.data.metrics["perf/train_examples_per_s"] > 0


def test_lightnings_distributed_sampler_is_refused(tiny, tmp_path, tmp_path_factory, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pipeline"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fresh_tracking_uri(tmp_path_factory, tmp_path))
    with pytest.raises(SystemExit) as exc:
        main(fit_args(tiny, tmp_path, "--trainer.use_distributed_sampler", "true"))
    assert exc.value.code == 2
    assert "trainer.use_distributed_sampler must stay false" in capsys.readouterr().err



def test_the_ddp_side_stream_warning_is_not_printed():
    """torch's warning about Lightning's DDP wrap on a side stream (once per process, nothing a user can act on)
    is filtered once the pipeline is imported; other warnings of torch's autograd still show (a fresh process:
    pytest sets its own filters in a test)."""
    code = ("import warnings, pipeline\n"
            "warnings.warn(\"The AccumulateGrad node's stream does not match the stream of the node.\")\n"
            "warnings.warn('Grad strides do not match bucket view strides.')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stderr
    assert "Grad strides do not match" in err and "AccumulateGrad" not in err
