"""`pipeline fit` with values that cannot work and runs whose validation would mislead: each is one
line naming the cause (exit 2 before anything is recorded, 1 for a run that fails), never a
traceback, never a silent result."""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from test_pipeline_cli import CONFIGS, all_runs, fit_args, tracking  # noqa: F401 (a fixture)
from test_pipeline_data import tiny_data_dir

QUICK = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
         "--trainer.limit_test_batches", "1", "--mlflow.system_metrics", "false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


def one_line(args: list[str], capsys, status: int) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == status and "Traceback" not in err, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    return line


@pytest.mark.parametrize("extra, message", [
    (["--trainer.max_epochs", "-2"], "trainer.max_epochs must be an integer >= -1 (-1: no limit), got -2"),
    (["--trainer.max_steps", "-5"], "trainer.max_steps must be an integer >= -1"),
    (["--model.lr", "-0.1"], "model.lr must be a number > 0, got -0.1"),
    (["--trainer.limit_train_batches", "-1"], "trainer.limit_train_batches must be a fraction in [0, 1] or a number"),
    (["--perf.warmup_steps", "-1"], "perf.warmup_steps must be an integer >= 0, got -1"),
    (["--checkpoint.every_n_train_steps", "-1"], "checkpoint.every_n_train_steps must be an integer >= 0"),
    (["--seed_everything", "-1"], "seed_everything must be an integer in [0, 2^32), got -1"),
    (["--trainer.log_every_n_steps", "0"], "trainer.log_every_n_steps must be an integer >= 1, got 0"),  # was a ZeroDivisionError
    (["--data.max_seq_len", "1000000000", "--model.ranker.attention", "sdpa"],
     "every history is padded to 1,000,000,000 items, and one [65, 1,000,000,000, 32] float32 activation alone takes"),
    (["--data.max_seq_len", "1000000000", "--model.ranker.attention", "dense"], "attention scores alone takes"),
])
def test_values_that_cannot_work_are_one_line_before_a_run_exists(tiny, tracking, tmp_path, capsys, extra, message):
    line = one_line(fit_args(tiny, tmp_path, *QUICK, *extra), capsys, 2)
    assert message in line, line
    assert all_runs(tracking) == {}


@pytest.mark.slow
def test_the_padded_layouts_at_a_workable_length_are_not_refused(tiny, tracking, tmp_path):
    main(fit_args(tiny, tmp_path, *QUICK, "--model.ranker.attention", "dense", "--mlflow.run_name", "dense"))
    assert all_runs(tracking)["dense"].info.status == "FINISHED"


def test_converge_yaml_with_the_progress_bar_off_trains(tiny, tracking, tmp_path):
    """converge.yaml lists a progress bar; switching the bar off raised Lightning's misconfiguration."""
    main(fit_args(tiny, tmp_path, "--config", str(CONFIGS / "converge.yaml"), *QUICK, "--mlflow.run_name", "c"))
    run = all_runs(tracking)["c"]
    assert run.info.status == "FINISHED" and "test/auc" in run.data.metrics


def test_early_stopping_on_an_undefined_auc_fails_the_run_in_one_line(tiny, tracking, tmp_path, capsys):
    """One validation example is one class: AUC is undefined. It stopped the training silently at
    the first check (EarlyStopping saw NaN), the run FINISHED and exit 0."""
    one_batch = 1.5 / json.loads((tiny / "meta.json").read_text())["splits"]["val"]["rows"]  # ("1" reads as 100%)
    args = fit_args(tiny, tmp_path, "--config", str(CONFIGS / "converge.yaml"), *QUICK, "--trainer.max_epochs", "3",
                    "--data.eval_batch_size", "1", "--trainer.limit_val_batches", f"{one_batch:.6f}",
                    "--mlflow.run_name", "one-class")
    line = one_line(args, capsys, 1)
    assert "val/auc is undefined (NaN) at step 2: AUC needs examples of both classes" in line, line
    run = all_runs(tracking)["one-class"]
    assert run.info.status == "FAILED" and "test/auc" not in run.data.metrics


class NaNWeightsAfterFirstStep(pl.Callback):
    """The model's weights turn NaN after its first step (as a diverged model's do)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.fill_(float("nan"))


def test_a_nan_model_fails_before_its_validation_is_logged(tiny, tracking, tmp_path, capsys):
    nan = tmp_path / "nan.yaml"
    nan.write_text("trainer:\n  callbacks:\n    - class_path: test_pipeline_bad_input.NaNWeightsAfterFirstStep\n")
    args = fit_args(tiny, tmp_path, *QUICK, "--trainer.limit_train_batches", "3", "--trainer.log_every_n_steps", "10",
                    "--config", str(nan), "--mlflow.run_name", "nan")
    line = one_line(args, capsys, 1)
    assert "training loss is NaN/inf at step 1" in line, line
    run = all_runs(tracking)["nan"]
    assert run.info.status == "FAILED"
    assert not any(k.startswith("val/") for k in run.data.metrics), run.data.metrics


@pytest.mark.slow
def test_a_full_checkpoint_disk_names_the_file_and_leaves_no_truncated_checkpoint(tiny, tracking, tmp_path, capsys,
                                                                                 monkeypatch):
    """The disk of the checkpoint directory fills up in the middle of a checkpoint's write."""
    ckpt_dir, real_open = tmp_path / "ckpt", builtins.open

    class Full:
        def __init__(self, file):
            self.file = file

        def write(self, data) -> int:
            self.file.write(bytes(data)[: len(data) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.file.close()

    def full_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        inside = isinstance(file, (str, os.PathLike)) and Path(file).resolve().is_relative_to(ckpt_dir.resolve())
        return Full(handle) if inside and "w" in mode else handle

    with monkeypatch.context() as patched:
        patched.setattr(builtins, "open", full_open)
        line = one_line(fit_args(tiny, tmp_path, *QUICK, "--checkpoint.dirpath", str(ckpt_dir),
                                 "--mlflow.run_name", "full"), capsys, 1)
    assert "No space left on device" in line and str(ckpt_dir) in line and ".ckpt" in line, line
    assert all_runs(tracking)["full"].info.status == "FAILED"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [], "no checkpoint, no partial file"
    assert MlflowClient(tracking).search_experiments()  # the store itself was not touched
