"""`pipeline fit` with the item table sharded over Gloo processes (model.table_layout sharded):
it trains like the replicated table, its checkpoints hold the whole table and load into either
layout and into one process, a killed run resumes, and torchrun runs it over 2 "nodes" of 2 processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_pipeline_bad_input import QUICK, one_line, tracking  # noqa: F401 (a fixture)
from test_pipeline_cli import CONFIGS, QUALITY, all_runs, fit_args, fresh_tracking_uri, history
from test_pipeline_data import tiny_data_dir
from test_pipeline_ddp import BUDGET, DDP, _fit

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SPLIT = [*DDP, "--trainer.devices", "2", "--data.batch_size", "32"]  # 2 processes of 32 rows: global batches of 64
TWO = [*BUDGET, *SPLIT]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def layouts(tiny, tmp_path_factory):
    """2-process fits with the replicated table, the sharded one, and shards of one process (each
    process a whole table, the replicas' gradients summed by hand), in one database."""
    root = tmp_path_factory.mktemp("layouts")
    uri = fresh_tracking_uri(tmp_path_factory, root)
    for name, layout in (("replicated", ["--model.table_layout", "replicated"]),
                         ("sharded", ["--model.table_layout", "sharded"]),
                         ("one-shard", ["--model.table_layout", "sharded", "--model.table_shards", "1"]),
                         ("fixed", ["--model.table_layout", "sharded", "--model.table_exchange", "alltoall_fixed"]),
                         ("rowwise", ["--model.table_layout", "replicated", "--model.optimizer", "rowwise"]),
                         ("rowwise-sharded", ["--model.table_layout", "sharded", "--model.optimizer", "rowwise"]),
                         ("rowwise-sparse", ["--model.table_layout", "sharded", "--model.optimizer", "rowwise",
                                             "--model.table_exchange", "alltoall_fixed", "--model.embedding_grad",
                                             "sparse"]),
                         ("lazyadam", ["--model.table_layout", "replicated", "--model.optimizer", "lazyadam"]),
                         ("lazyadam-sparse", ["--model.table_layout", "sharded", "--model.optimizer", "lazyadam",
                                              "--model.table_exchange", "alltoall_fixed", "--model.embedding_grad",
                                              "sparse"])):
        proc = _fit(fit_args(tiny, root / name, *TWO, *layout, "--mlflow.run_name", name), uri)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return root, uri, all_runs(uri)


def _same_history(got: dict, want: dict, what: str) -> None:
    for key in QUALITY:
        assert got[key].keys() == want[key].keys() and want[key], (what, key)
        for step, value in want[key].items():
            assert got[key][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, key, step)


@pytest.mark.slow
def test_the_sharded_table_trains_like_the_replicated_one_and_sends_less(layouts):
    _, uri, runs = layouts
    rep, shd = runs["replicated"], runs["sharded"]
    assert rep.info.status == shd.info.status == "FINISHED" and shd.data.tags["world_size"] == "2"
    assert shd.data.params["model.table_layout"] == "sharded"
    _same_history(history(uri, shd.info.run_id), history(uri, rep.info.run_id), "sharded")
    _same_history(history(uri, runs["one-shard"].info.run_id), history(uri, rep.info.run_id), "one-shard")
    _same_history(history(uri, runs["fixed"].info.run_id), history(uri, rep.info.run_id), "fixed")
    m_rep, m_shd = rep.data.metrics, shd.data.metrics
    # the table's gradient (20,000 x 32 float32) leaves the all-reduce; its lookups send less than that
    table_mb = 20_000 * 32 * 4 / 2**20
    assert m_rep["comm/sent_mb_per_step"] - m_shd["comm/sent_mb_per_step"] == pytest.approx(table_mb, rel=1e-3)
    assert 0 < m_shd["comm/table_sent_mb_per_step"] < m_shd["comm/table_gather_mb_per_step"] < table_mb
    assert "comm/table_sent_mb_per_step" not in m_rep
    # alltoall_fixed: a fixed number of slots per owner, fewer bytes than a gather of the same steps' ids
    m_fix = runs["fixed"].data.metrics
    assert 0 < m_fix["comm/table_sent_mb_per_step"] < m_fix["comm/table_gather_mb_per_step"]


@pytest.mark.slow
def test_the_rowwise_optimizer_trains_a_sharded_table_like_a_replicated_one(tiny, layouts, tmp_path):
    root, uri, runs = layouts
    _same_history(history(uri, runs["rowwise-sharded"].info.run_id), history(uri, runs["rowwise"].info.run_id),
                  "rowwise sharded")
    # the shard's gradient as a fixed-size sparse tensor of the looked-up rows: the same training
    _same_history(history(uri, runs["rowwise-sparse"].info.run_id), history(uri, runs["rowwise"].info.run_id),
                  "rowwise sharded, sparse gradient")
    assert runs["rowwise"].data.metrics["train/loss_epoch"] != runs["replicated"].data.metrics["train/loss_epoch"]
    ckpt = next((root / "rowwise-sharded").rglob("last.ckpt"))
    states = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"]
    assert [tuple(v["sum_sq"].shape) for v in states.values() if "sum_sq" in v] == [(20_000,)]  # the whole table's
    assert _test_auc(tiny, tmp_path, ckpt, uri) == pytest.approx(
        runs["rowwise-sharded"].data.metrics["test/auc"], abs=1e-6)


@pytest.mark.slow
def test_lazy_adam_trains_a_sparse_sharded_table_like_a_dense_replicated_one(layouts):
    root, uri, runs = layouts
    _same_history(history(uri, runs["lazyadam-sparse"].info.run_id), history(uri, runs["lazyadam"].info.run_id),
                  "lazyadam sharded, sparse gradient")
    assert runs["lazyadam"].data.metrics["train/loss_epoch"] != runs["replicated"].data.metrics["train/loss_epoch"]
    states = torch.load(next((root / "lazyadam-sparse").rglob("last.ckpt")), weights_only=False)["optimizer_states"]
    shapes = [tuple(v["exp_avg"].shape) for v in states[0]["state"].values() if v["exp_avg"].shape[0] == 20_000]
    assert shapes == [(20_000, 32)]  # the whole table's moments, gathered from the shards


def _test_auc(tiny: Path, root: Path, ckpt: Path, uri: str, *extra: str) -> float:
    args = ["test", "--config", str(CONFIGS / "base.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
            "--data.data_dir", str(tiny), "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar",
            "false", "--mlflow.system_metrics", "false", "--torch_num_threads", "1",
            "--trainer.limit_test_batches", "2", "--ckpt_path", str(ckpt), *extra]
    proc = _fit(args, uri)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return float(re.search(r"test/auc\s+([0-9.]+)", proc.stdout).group(1))


@pytest.mark.slow
def test_a_checkpoint_of_either_layout_loads_into_the_other_and_into_one_process(tiny, layouts, tmp_path):
    root, uri, runs = layouts
    # one process with a batch of 64, two of 32 each: the fits' global test batches
    for layout, other in (("sharded", ["--model.table_layout", "replicated"]),
                          ("replicated", ["--model.table_layout", "sharded", *SPLIT])):
        ckpt = next((root / layout).rglob("last.ckpt"))
        assert _test_auc(tiny, tmp_path, ckpt, uri, *other) == pytest.approx(
            runs[layout].data.metrics["test/auc"], abs=1e-6), layout
    one = _test_auc(tiny, tmp_path, next((root / "sharded").rglob("last.ckpt")), uri, "--model.table_layout", "sharded")
    assert one == pytest.approx(runs["sharded"].data.metrics["test/auc"], abs=1e-6)  # a shard of one: the table


@pytest.mark.slow
def test_a_killed_sharded_run_resumes_with_its_optimizer_state(tiny, layouts, tmp_path, tmp_path_factory):
    """Killed after step 6 of 8, resumed from the checkpoint of step 5: the uninterrupted run's history."""
    _, uri0, runs = layouts
    want = history(uri0, runs["sharded"].info.run_id)
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    kill = tmp_path / "kill.yaml"
    kill.write_text("trainer:\n  callbacks:\n    - class_path: test_pipeline_tracking.KillAfterStep\n"
                    "      init_args: {step: 6}\n")
    args = [*TWO, "--model.table_layout", "sharded", "--checkpoint.every_n_train_steps", "5"]
    root = tmp_path / "killed"
    proc = _fit(fit_args(tiny, root, *args, "--mlflow.run_name", "killed", "--config", str(kill)), uri)
    assert proc.returncode == 137, proc.stderr[-4000:]
    proc = _fit(fit_args(tiny, root, *args, "--ckpt_path", str(next(root.rglob("last.ckpt")))), uri)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = all_runs(uri)
    assert set(runs) == {"killed"} and runs["killed"].info.status == "FINISHED"
    _same_history(history(uri, runs["killed"].info.run_id), want, "resumed")


@pytest.mark.parametrize("extra, message", [
    (["--model.table_shards", "3", *SPLIT], "model.table_shards 3 does not divide the world size 2 (trainer.devices"),
    (["--model.table_shards", "4", "--trainer.num_nodes", "3", *SPLIT],
     "model.table_shards 4 does not divide the world size 6"),
    (["--data.vocab_size", str(10**11), *SPLIT], "the item table of 100,000,000,000 x 32 float32 rows does not fit: "
     "each of 2 processes' shard (50,000,000,000 rows) with its gradient and adamw state takes 23,842 GiB"),
    (["--data.vocab_size", str(10**11), "--model.optimizer", "rowwise", "--model.embedding_grad", "sparse", *SPLIT],
     "shard (50,000,000,000 rows) with its rowwise state takes 6,147 GiB"),  # 32 + 1 floats a row: no dense gradient
    (["--data.vocab_size", str(10**11), "--model.optimizer", "lazyadam", "--model.embedding_grad", "sparse", *SPLIT],
     "shard (50,000,000,000 rows) with its lazyadam state takes 17,881 GiB"),  # weights and two moments
    (["--data.vocab_size", str(10**11), "--model.optimizer", "lazyadam", *SPLIT],  # and the dense update's 2 temporaries
     "shard (50,000,000,000 rows) with its gradient and lazyadam state takes 35,763 GiB"),
    (["--data.vocab_size", str(10**11), "--model.table_layout", "replicated"], "one process's replica "
     "(100,000,000,000 rows) with its gradient and adamw state takes 47,684 GiB"),
    (["--data.vocab_size", "19999"], "data.vocab_size 19,999 is smaller than the vocabulary of"),
    (["--model.cuda_graphs", "true"], "model.table_layout sharded keeps the table's gradient with its shard"),
    (["--model.compile_model", "true"], "no compile_model, and cuda_graphs only with table_exchange alltoall_fixed"),
    (["--model.table_layout", "replicated", "--model.table_shards", "2"], "set only with model.table_layout sharded"),
])
@pytest.mark.timeout(120)  # a check that let the fit start would wait for absent processes
def test_a_sharded_table_that_cannot_work_is_one_line_before_anything_is_written(tiny, tracking, tmp_path, capsys,
                                                                                extra, message):
    args = fit_args(tiny, tmp_path / "run", *QUICK, "--model.table_layout", "sharded", *extra)
    assert message in one_line(args, capsys, 2)
    assert not all_runs(tracking) and not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.slow
def test_a_checkpoint_of_another_vocabulary_is_one_line(tiny, layouts, tracking, tmp_path, capsys):
    root, _, _ = layouts
    ckpt = next((root / "sharded").rglob("last.ckpt"))
    for sub in ("fit", "test"):
        args = [sub, *fit_args(tiny, tmp_path / "run")[1:], *QUICK, "--data.vocab_size", "30000", "--ckpt_path", str(ckpt)]
        assert one_line(args, capsys, 2).endswith(f"--ckpt_path {ckpt}: its item table has 20,000 rows, the data set "
                                                  "(or data.vocab_size) has 30,000 items: a checkpoint loads only into "
                                                  "a table of its size")
    assert not all_runs(tracking) and not list((tmp_path / "run").rglob("*.ckpt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_torchrun_trains_the_sharded_table_over_two_nodes_of_two_processes(tiny, tmp_path, tmp_path_factory):
    """Two torchrun launchers on this machine as two nodes (static rendezvous on localhost), one
    MLflow run of world size 4; each node's two processes shard one table (lookups inside the node)."""
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    port = _free_port()
    args = fit_args(tiny, tmp_path / "run", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
                    "--trainer.limit_val_batches", "1", "--trainer.limit_test_batches", "1", "--data.batch_size", "16",
                    "--mlflow.system_metrics", "false", "--torch_num_threads", "1", *DDP, "--trainer.devices", "2",
                    "--trainer.num_nodes", "2", "--model.table_layout", "sharded", "--model.table_shards", "2",
                    "--model.table_exchange", "alltoall_fixed", "--mlflow.run_name", "nodes")  # a table per node
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                               "--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "-m", "pipeline", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in range(2)]
    try:
        outs = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-4000:]
    runs = all_runs(uri)
    assert set(runs) == {"nodes"}, "one MLflow run for the four processes"
    run = runs["nodes"]
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "4"
    assert run.data.params["trainer.num_nodes"] == "2" and run.data.metrics["comm/table_sent_mb_per_step"] > 0
