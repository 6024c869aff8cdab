"""`fit --ckpt_path`: only a checkpoint of `pipeline fit`, only an unfinished run, only with the
config and data the run was made with; anything else is one line and exit 2 before training."""

from __future__ import annotations

import shutil
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from test_pipeline_cli import all_runs, fit_args, fresh_tracking_uri
from test_pipeline_data import tiny_data_dir

QUICK = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "0",
         "--trainer.limit_test_batches", "1", "--mlflow.system_metrics", "false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory) -> SimpleNamespace:
    """One FINISHED tiny fit: its database, checkpoint and run."""
    root = tmp_path_factory.mktemp("trained")
    uri = fresh_tracking_uri(tmp_path_factory, root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setattr(sys, "argv", ["pipeline"])
        main(fit_args(tiny, root, *QUICK, "--mlflow.run_name", "done"))
    return SimpleNamespace(root=root, db=root / "mlflow.db", ckpt=next(root.rglob("last.ckpt")),
                           run_id=all_runs(uri)["done"].info.run_id)


@pytest.fixture
def run(trained, tmp_path, monkeypatch) -> SimpleNamespace:
    """A private copy of the trained run's database (tests change the run's status and tags)."""
    monkeypatch.setattr(sys, "argv", ["pipeline"])
    shutil.copy(trained.db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    return SimpleNamespace(**vars(trained), uri=uri, client=client)


def fails_before_training(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-3000:]
    assert "Traceback" not in err and "weights_only" not in err, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    return line


def history(run) -> dict:
    return {k: [(m.step, m.value) for m in run.client.get_metric_history(run.run_id, k)]
            for k in run.client.get_run(run.run_id).data.metrics}


@pytest.mark.slow
def test_a_finished_run_is_never_reopened(tiny, run, capsys):
    before, info = history(run), run.client.get_run(run.run_id).info
    line = fails_before_training(fit_args(tiny, run.root, *QUICK, "--ckpt_path", str(run.ckpt)), capsys)
    assert f"MLflow run {run.run_id} is FINISHED" in line
    after = run.client.get_run(run.run_id).info
    assert (after.status, after.end_time) == ("FINISHED", info.end_time) and history(run) == before


@pytest.mark.parametrize("extra, differs", [
    (["--model.ranker.embed_dim", "64"], "model.ranker.embed_dim=64 (run: 32)"),
    (["--data.batch_size", "32"], "data.batch_size=32 (run: 64)"),
    (["--seed_everything", "1"], "seed_everything=1 (run: 0)"),
    (["--trainer.max_epochs", "3"], "trainer.max_epochs=3 (run: 1)"),
    ("other data dir", "data.data_dir="),
    ("other data digest", "data digest"),
])
def test_a_resume_must_ask_for_the_runs_own_config(tiny, run, tmp_path, capsys, extra, differs):
    run.client.set_terminated(run.run_id, "KILLED")  # as a killed run is seen again
    data = tiny
    if extra == "other data dir":
        data = tmp_path / "copy"
        shutil.copytree(tiny, data, ignore=shutil.ignore_patterns(".cache"))
    elif extra == "other data digest":
        run.client.set_tag(run.run_id, "data_digest", "0" * 64)
    args = [] if isinstance(extra, str) else extra
    before = history(run)
    line = fails_before_training(fit_args(data, run.root, *QUICK, *args, "--ckpt_path", str(run.ckpt)), capsys)
    assert "the command differs from the run it resumes" in line and differs in line, line
    assert run.client.get_run(run.run_id).info.status == "KILLED" and history(run) == before


def test_the_same_config_resumes(tiny, run):
    run.client.set_terminated(run.run_id, "KILLED")
    main(fit_args(tiny, run.root, *QUICK, "--ckpt_path", str(run.ckpt)))
    assert set(all_runs(run.uri)) == {"done"}
    assert run.client.get_run(run.run_id).info.status == "FINISHED"


def test_a_resume_by_other_code_is_refused_unless_allowed_and_keeps_the_runs_commit(tiny, run, capsys):
    """The steps before and after a resume ran different code, and the resume overwrote git_commit."""
    from pipeline.tracking import git_commit

    run.client.set_terminated(run.run_id, "KILLED")
    run.client.set_tag(run.run_id, "git_commit", "0" * 40)  # trained by another commit
    args = fit_args(tiny, run.root, *QUICK, "--ckpt_path", str(run.ckpt))
    line = fails_before_training(args, capsys)
    assert f"was trained by commit {'0' * 40} and this code is {git_commit()}" in line, line
    assert "--allow_code_change true" in line and run.client.get_run(run.run_id).info.status == "KILLED"
    main([*args, "--allow_code_change", "true"])
    after = run.client.get_run(run.run_id)
    assert after.info.status == "FINISHED" and set(all_runs(run.uri)) == {"done"}
    assert after.data.tags["git_commit"] == "0" * 40 and after.data.tags["git_commit.resumed"] == git_commit()


class NotAWeight:
    pass


@pytest.mark.parametrize("kind, message", [
    ("empty", "the file is empty"),
    ("truncated", "not a readable checkpoint, truncated or not written by torch.save"),
    ("foreign", "not a checkpoint of `pipeline fit`"),
    ("pickled object", "holds Python objects other than tensors"),
])
def test_bad_checkpoint_files_are_one_line(tiny, trained, tmp_path, tmp_path_factory, monkeypatch, capsys,
                                           kind, message):
    monkeypatch.setattr(sys, "argv", ["pipeline"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fresh_tracking_uri(tmp_path_factory, tmp_path))
    path = tmp_path / "bad.ckpt"
    if kind == "empty":
        path.touch()
    elif kind == "truncated":
        raw = trained.ckpt.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
    elif kind == "foreign":
        torch.save({"weights": torch.zeros(3)}, path)
    else:
        torch.save({"state_dict": {}, "hyper_parameters": {"ranker": NotAWeight(), "f": Fraction(1, 3)}}, path)
    for subcommand in ("fit", "test"):
        args = fit_args(tiny, tmp_path, *QUICK, "--ckpt_path", str(path))
        line = fails_before_training([subcommand, *args[1:]], capsys)
        assert f"--ckpt_path {path}: {message}" in line, line
