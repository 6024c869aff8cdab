"""The training CLI in-process: what a run records in MLflow, seeding, and bad input."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from test_pipeline_data import tiny_data_dir

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "configs"
QUALITY = ("train/loss_step", "train/loss_epoch", "val/auc", "val/ne", "val/logloss", "val/calibration",
           "test/auc", "test/ne", "test/logloss", "test/calibration")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


def fresh_tracking_uri(tmp_path_factory, dest: Path) -> str:
    """A new, empty MLflow sqlite database at dest/mlflow.db: a copy of one created per session
    (creating the tables takes seconds)."""
    template = tmp_path_factory.getbasetemp() / "mlflow_template.db"
    if not template.is_file():
        MlflowClient(f"sqlite:///{template}").search_experiments()
    shutil.copy(template, dest / "mlflow.db")
    return f"sqlite:///{dest / 'mlflow.db'}"


@pytest.fixture
def tracking(tmp_path, tmp_path_factory, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", ["pipeline"])  # main(args) runs as if from the command line
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def fit_args(data: Path, root: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(CONFIGS / "base.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
        "--data.data_dir", str(data), "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *extra,
    ]


def all_runs(uri: str) -> dict:
    mlflow.set_tracking_uri(uri)
    return {r.info.run_name: r for r in mlflow.search_runs(search_all_experiments=True, output_format="list")}


def history(uri: str, run_id: str, keys=QUALITY) -> dict[str, dict[int, float]]:
    """Metric histories keyed by step (a resumed run re-logs the step it resumed from)."""
    client = MlflowClient(uri)
    return {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in keys}


@pytest.mark.slow
def test_fit_records_the_run_and_is_seeded(tiny, tracking, tmp_path, monkeypatch):
    # sample often: a tiny CPU run can end within one default interval, before any publish
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    main(fit_args(tiny, tmp_path, "--mlflow.run_name", "a"))
    main(fit_args(tiny, tmp_path, "--mlflow.run_name", "b", "--mlflow.system_metrics", "false"))
    main(fit_args(tiny, tmp_path, "--mlflow.run_name", "c", "--mlflow.system_metrics", "false",
                  "--seed_everything", "1", "--trainer.max_epochs", "1"))
    runs = all_runs(tracking)
    a, b, c = runs["a"], runs["b"], runs["c"]
    assert {r.info.status for r in (a, b, c)} == {"FINISHED"}
    ha, hb, hc = (history(tracking, r.info.run_id) for r in (a, b, c))
    assert all(ha[k] for k in QUALITY), {k: v for k, v in ha.items() if not v}
    assert ha == hb, "same config and seed must give the same metrics on CPU"
    assert ha["train/loss_step"][1] != hc["train/loss_step"][1], "the seed must matter"
    assert len(ha["val/auc"]) == 2  # one per epoch

    meta = json.loads((tiny / "meta.json").read_text())
    tags, params, metrics = a.data.tags, a.data.params, a.data.metrics
    assert tags["attention"] == "jagged" and tags["seed"] == "0" and tags["data_digest"] == meta["digest"]
    for key in ("git_commit", "device", "torch_version", "triton_version"):
        assert tags[key]
    assert params["model.ranker.attention"] == "jagged" and params["data.max_seq_len"] == "32"
    assert params["trainer.max_epochs"] == "2" and "ckpt_path" not in params
    # params are what was set (and the few keys that say what ran); the whole config is the artifact
    assert "model.weight_decay" not in params and "trainer.accelerator" not in params
    assert params["model.ranker.embed_dim"] == "32" and params["model.cuda_graphs"] == "false"
    full = yaml.safe_load(mlflow.artifacts.load_text(f"{a.info.artifact_uri}/config.yaml"))
    assert full["model"]["weight_decay"] == 0.01 and len(params) < 30
    for key in ("perf/train_examples_per_s", "perf/train_tokens_per_s", "perf/step_time_ms", "mem/peak_rss_mb"):
        assert metrics[key] > 0, key
    assert any(k.startswith("system/cpu") for k in metrics), "system metrics were not sampled"
    client = MlflowClient(tracking)
    assert {f.path for f in client.list_artifacts(a.info.run_id)} >= {"config.yaml", "data"}
    assert [f.path for f in client.list_artifacts(a.info.run_id, "data")] == ["data/meta.json"]


@pytest.mark.slow
def test_layouts_train_the_same_function(tiny, tracking, tmp_path):
    """Same seed, same data: dense and jagged start from the same weights and stay close."""
    for attention in ("dense", "jagged"):
        main(fit_args(tiny, tmp_path, "--config", str(CONFIGS / f"{attention}.yaml"), "--mlflow.run_name", attention,
                      "--mlflow.system_metrics", "false", "--trainer.max_epochs", "1"))
    runs = all_runs(tracking)
    hd, hj = (history(tracking, runs[b].info.run_id, ("train/loss_step", "test/auc")) for b in ("dense", "jagged"))
    assert runs["dense"].data.tags["attention"] == "dense"
    assert hd["train/loss_step"].keys() == hj["train/loss_step"].keys()
    for step, value in hd["train/loss_step"].items():
        assert hj["train/loss_step"][step] == pytest.approx(value, abs=1e-4)
    assert hj["test/auc"][8] == pytest.approx(hd["test/auc"][8], abs=1e-3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "extra,env_uri,message",
    [
        (["--model.ranker.attention", "flash"], None, "Expected a typing.Literal.*Got value: flash"),
        (["--data.max_seq_len", "0"], None, "data.max_seq_len must be > 0"),
        (["--data.data_dir", "/nonexistent/data"], None, "no data set at.*generate it with"),
        (["--trainer.no_such_key", "1"], None, "unrecognized arguments: --trainer.no_such_key"),
        ([], "http://127.0.0.1:{port}", "tracking server .* is unreachable"),
        (["--ckpt_path", "/nonexistent.ckpt"], None, "no such checkpoint"),
        (["--model.table_layout", "sharded", "--model.embedding_grad", "densify"], None,
         "it takes embedding_grad dense or sparse"),
        (["--model.table_exchange", "alltoall_fixed"], None, "not alltoall only with model.table_layout sharded"),
    ],
)
def test_bad_input_fails_before_training(tiny, tracking, tmp_path, monkeypatch, capsys, extra, env_uri, message):
    if env_uri:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri.format(port=_free_port()))
    with pytest.raises(SystemExit) as exc:
        main(fit_args(tiny, tmp_path, *extra))
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err), message
    assert all_runs(tracking) == {}, "nothing may be recorded for a run that cannot start"


def test_config_errors_are_one_line_naming_the_file(tiny, tracking, tmp_path, capsys):
    """An abbreviated option is not taken for the full one; a bad key in a YAML file names the file;
    either is one line on stderr (no usage dump) and exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epoch: 1\n")
    broken = tmp_path / "broken.yaml"  # a YAML syntax error: the file, line and column
    broken.write_text("model:\n  lr: [0.1\n")
    old = tmp_path / "old.yaml"  # a key of an earlier version: an unknown key like any other
    old.write_text("model:\n  ranker:\n    backend: sdpa\n")
    for extra, message in ((["--trainer.max_epoch", "1"], "unrecognized arguments: --trainer.max_epoch"),
                           (["--config", str(bad)], f"{bad}: unknown key 'trainer.max_epoch'"),
                           (["--config", str(broken)], f"{broken}:3:1: expected ',' or ']'"),
                           (["--config", str(old)], f"{old}: unknown key 'model.ranker.backend'")):
        with pytest.raises(SystemExit) as exc:
            main(fit_args(tiny, tmp_path, *extra))
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert all_runs(tracking) == {}


@pytest.mark.slow
@pytest.mark.parametrize("command", [["experiments", "sweep", "experiments/ablations/smoke.yaml", "--dry"],
                                     ["experiments", "report", "--parent", "x", "--ou", "/tmp"],
                                     ["experiments", "summary", "--res", "/tmp"],
                                     ["data_gen", "generate", "--preset", "tiny", "--out", "/tmp/x", "--row", "9"]])
def test_no_command_takes_an_abbreviated_option(command):
    proc = subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and ("unrecognized arguments" in proc.stderr or "unknown option" in proc.stderr), proc.stderr


def test_every_parser_refuses_abbreviated_options():
    """Each argparse parser of the project is built with allow_abbrev=False (`--out` is not `--output`)."""
    import ast

    lax = []
    for path in sorted(p for pkg in ("data_gen", "kernels", "models", "pipeline", "experiments") for p in (REPO / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser":
                strict = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                             for k in node.keywords)
                if not strict:
                    lax.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not lax, lax


def test_nan_loss_fails_the_run_and_names_the_step(tiny, tracking, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(fit_args(tiny, tmp_path, "--model.lr", "1e30", "--mlflow.run_name", "nan",
                      "--mlflow.system_metrics", "false"))
    assert exc.value.code == 1
    assert "loss is NaN/inf at step" in capsys.readouterr().err
    assert all_runs(tracking)["nan"].info.status == "FAILED"


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one(tiny, tracking, tmp_path):
    """model.compile_model: one torch.compile(dynamic=True) graph around the ranker; same losses."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for name, flag in (("eager", "false"), ("compiled", "true")):
        main(fit_args(tiny, tmp_path, "--config", str(CONFIGS / "jagged.yaml"), "--mlflow.run_name", name,
                      "--mlflow.system_metrics", "false", "--trainer.max_epochs", "1",
                      "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "0",
                      "--trainer.limit_test_batches", "2", "--model.compile_model", flag))
    runs = all_runs(tracking)
    assert runs["compiled"].info.status == "FINISHED" and runs["compiled"].data.params["model.compile_model"] == "true"
    he, hc = (history(tracking, runs[n].info.run_id, ("train/loss_step", "test/auc")) for n in ("eager", "compiled"))
    assert he["train/loss_step"] and he["train/loss_step"].keys() == hc["train/loss_step"].keys()
    for step, value in he["train/loss_step"].items():
        assert hc["train/loss_step"][step] == pytest.approx(value, abs=1e-5)
    assert hc["test/auc"] == pytest.approx(he["test/auc"], abs=1e-5)
    # the ranker was compiled (train and eval graphs), without graph breaks
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.slow
def test_early_stopping_inside_an_epoch_as_the_accuracy_ablations_validate(tiny, tracking, tmp_path):
    """converge.yaml with validation every half epoch (the ablations: every quarter; tiny: 74 steps an
    epoch there): the run stops mid-epoch after patience + 1 checks and tests the weights of the best one."""
    main(fit_args(tiny, tmp_path, "--config", str(CONFIGS / "converge.yaml"), "--mlflow.run_name", "half",
                  "--mlflow.system_metrics", "false", "--trainer.val_check_interval", "0.5", "--trainer.callbacks",
                  '[{"class_path": "pytorch_lightning.callbacks.EarlyStopping", "init_args": '
                  '{"monitor": "val/auc", "mode": "min", "min_delta": 1.0, "patience": 2}}]', "--checkpoint.mode", "min"))
    run = all_runs(tracking)["half"]
    got = history(tracking, run.info.run_id, ("val/auc", "train/loss_step", "test/weights_step"))
    val = [v for _, v in sorted(got["val/auc"].items())]
    checks = sorted(got["val/auc"])  # Lightning logs a check at its batch count: the optimizer step, or one less
    epoch = 2 * (checks[0] + 1)  # the first check comes half an epoch in
    assert len(val) == 3 and checks[-1] in (epoch * 3 // 2 - 1, epoch * 3 // 2)  # stopped mid-epoch, at the 3rd
    assert max(got["train/loss_step"]) < 2 * epoch  # and trained no further
    tested, = got["test/weights_step"].values()  # the best check's checkpoint (its file names the optimizer step)
    assert tested - checks[val.index(min(val))] in (0, 1)


@pytest.mark.slow
def test_fit_tests_the_monitored_best_checkpoint_and_stops_early(tiny, tracking, tmp_path, capsys):
    """checkpoint.monitor set: the test metrics are of the best checkpoint's weights (test/weights_step
    names its step); EarlyStopping given as a trainer callback ends the run; unset: the final weights."""
    stop = ('[{"class_path": "pytorch_lightning.callbacks.EarlyStopping", '
            '"init_args": {"monitor": "val/auc", "mode": "max", "min_delta": 1.0, "patience": 2}}]')
    # "best" = the LOWEST val AUC, so that the tested weights are not simply the last ones
    main(fit_args(tiny, tmp_path, "--mlflow.run_name", "best", "--mlflow.system_metrics", "false",
                  "--trainer.max_epochs", "5", "--trainer.callbacks", stop, "--checkpoint.monitor", "val/auc",
                  "--checkpoint.mode", "min", "--checkpoint.save_top_k", "1", "--checkpoint.save_last", "false"))
    main(fit_args(tiny, tmp_path, "--mlflow.run_name", "final", "--mlflow.system_metrics", "false"))
    runs = all_runs(tracking)
    best = history(tracking, runs["best"].info.run_id, ("val/auc", "train/loss_step", "test/weights_step"))
    val = [v for _, v in sorted(best["val/auc"].items())]
    assert len(val) == 3  # a gain of 1.0 in AUC never comes: stopped after patience + 1 = 3 of 5 epochs
    assert max(best["train/loss_step"]) < 3 * 8
    # tiny: 8 steps an epoch, validation at each epoch's end; the tested weights are the worst epoch's
    assert list(best["test/weights_step"].values()) == [8 * (1 + val.index(min(val)))]
    # and those are the weights tested: `test` of that checkpoint file prints the same test AUC
    ckpt, = [c for c in tmp_path.rglob("*.ckpt") if f"step={8 * (1 + val.index(min(val)))}" in c.name]
    capsys.readouterr()
    main(["test", "--config", str(CONFIGS / "base.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
          "--data.data_dir", str(tiny), "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar",
          "false", "--mlflow.system_metrics", "false", "--ckpt_path", str(ckpt)])
    retest_auc = float(re.search(r"test/auc\s+([0-9.]+)", capsys.readouterr().out).group(1))
    assert retest_auc == pytest.approx(runs["best"].data.metrics["test/auc"], abs=1e-6)
    assert retest_auc != pytest.approx(runs["final"].data.metrics["test/auc"], abs=1e-6)  # other weights, other AUC
    final = history(tracking, runs["final"].info.run_id, ("test/weights_step",))
    assert list(final["test/weights_step"].values()) == [2 * 8]  # tiny.yaml: 2 epochs, the final weights


def test_a_limit_of_1_is_one_batch_not_every_batch(tiny, tracking, tmp_path):
    """Lightning annotates the trainer's limit_*_batches Union[float, int]: read float first, "1"
    would be 1.0, every batch of the split."""
    main(fit_args(tiny, tmp_path, "--mlflow.run_name", "one", "--mlflow.system_metrics", "false",
                  "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1",
                  "--trainer.limit_test_batches", "0.5"))
    run = all_runs(tracking)["one"]
    assert [run.data.params[f"trainer.limit_{s}_batches"] for s in ("train", "val", "test")] == ["1", "1", "0.5"]
    steps = [m.step for m in MlflowClient(tracking).get_metric_history(run.info.run_id, "train/loss_epoch")]
    assert steps == [0]  # the epoch of one step logs its loss at its step (0-based)
