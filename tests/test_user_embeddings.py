"""User embeddings end to end on the tiny timeline: encoder fit, export, the as-of join, the ranker
option, and every bad input the issue names (pipeline/user_embeddings.py, encoder.py, user_features.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import asdict

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data_gen import read_split
from models import Ranker, RankerConfig, UserEmbeddingConfig, feature_width
from pipeline.cli import main as cli_main
from pipeline.data import RankerData
from pipeline.errors import ConfigError
from pipeline.user_embeddings import main as ue_main
from pipeline.user_features import UserEmbeddings, join_as_of, manifest_path, read_embeddings, write_embeddings
from test_data_gen import tiny_data  # noqa: F401  (a session fixture)
from test_data_gen_timeline import timeline_data  # noqa: F401  (a session fixture)
from test_pipeline_cli import all_runs, fit_args, tracking  # noqa: F401  (tracking: a fixture)
from test_pipeline_failures import server  # noqa: F401  (a fixture)
from pipeline.tracking import HTTP_BOUNDS

DIM = 16
ENCODER = ["--max-seq-len", "256", "--dim", str(DIM), "--embed-dim", "32", "--batch-size", "64",
           "--log-every", "5"]


@pytest.fixture(scope="module")
def exported(timeline_data, tmp_path_factory):  # noqa: F811
    """The encoder trained for a few steps and its daily export (own tracking store)."""
    root = tmp_path_factory.mktemp("user_embeddings")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    data = str(timeline_data[0])
    assert ue_main(["fit", "--data", data, "--out", str(root / "enc.pt"), "--max-steps", "12", *ENCODER]) == 0
    assert ue_main(["export", "--data", data, "--encoder", str(root / "enc.pt"), "--out",
                    str(root / "emb.parquet")]) == 0
    yield root
    mp.undo()


def _frame(path):
    t = pq.read_table(path)
    return {c: t.column(c).to_numpy() if c != "embedding" else np.stack(t.column(c).to_numpy(zero_copy_only=False))
            for c in t.column_names}


@pytest.mark.slow
def test_the_encoder_logs_its_cost_and_the_export_is_as_of_each_next_day(exported, timeline_data):  # noqa: F811
    record = json.loads((exported / "enc.pt.json").read_text())
    assert record["steps"] == 12 and record["cutoff_day"] == timeline_data[1]["config"]["days"] - 1
    assert {"val/auc", "train/examples_per_s", "train/seconds_per_day"} <= set(record["results"])
    manifest = json.loads(manifest_path(exported / "emb.parquet").read_text())
    assert manifest["data_digest"] == timeline_data[1]["digest"] and manifest["dim"] == DIM
    rows = _frame(exported / "emb.parquet")
    assert rows["embedding"].shape == (manifest["rows"], DIM) and np.isfinite(rows["embedding"]).all()
    # the newest log read is before the as-of day starts, and the daily schedule serves each
    # active day's last history from the next day on
    assert (rows["history_time"] < rows["as_of_day"] - 1).all()
    assert (rows["as_of_day"] == np.floor(rows["history_time"]).astype(int) + 2).all()
    runs = all_runs(f"sqlite:///{exported / 'mlflow.db'}")
    (run,) = runs.values()
    assert {"val/auc", "export/rows", "export/seconds_per_as_of_day"} <= set(run.data.metrics)


def test_export_as_of_one_day_takes_each_users_last_history_before_it(exported, timeline_data):  # noqa: F811
    data = str(timeline_data[0])
    out = exported / "emb4.parquet"
    assert ue_main(["export", "--data", data, "--encoder", str(exported / "enc.pt"), "--out", str(out),
                    "--as-of", "4"]) == 0
    day4, daily = _frame(out), _frame(exported / "emb.parquet")
    assert (day4["as_of_day"] == 4).all() and len(np.unique(day4["user_id"])) == len(day4["user_id"])
    for u, t, e in zip(day4["user_id"][:20], day4["history_time"][:20], day4["embedding"][:20]):
        mine = (daily["user_id"] == u) & (daily["as_of_day"] <= 4)
        newest = np.flatnonzero(mine)[np.argmax(daily["as_of_day"][mine])]
        assert daily["history_time"][newest] == t  # the same history as the daily file's newest
        np.testing.assert_allclose(daily["embedding"][newest], e, rtol=1e-5, atol=1e-6)


def test_join_takes_the_newest_embedding_as_of_the_day_minus_the_lag():
    emb = UserEmbeddings("x", user=np.array([7, 7, 7, 9]), as_of_day=np.array([2, 4, 6, 3], np.int32),
                         history_time=np.array([0.5, 2.5, 4.5, 1.5]), table=np.zeros((4, 2), np.float32),
                         manifest={})
    user = np.array([7, 7, 7, 7, 9, 9, 5])
    day = np.array([1, 2, 5, 6, 3, 7, 4], np.int32)
    rows, stats = join_as_of(user, day, emb, lag_days=0)
    np.testing.assert_array_equal(rows, [-1, 0, 1, 2, 3, 3, -1])
    assert (stats.rows, stats.missing) == (7, 2)
    rows, stats = join_as_of(user, day, emb, lag_days=3)  # day - 3: 7 -> as of <= 3 etc.
    np.testing.assert_array_equal(rows, [-1, -1, 0, 0, -1, 3, -1])
    assert stats.missing == 4


@pytest.mark.slow
def test_a_ranker_trains_with_the_embedding_and_logs_the_missing_users(exported, timeline_data, tracking,  # noqa: F811
                                                                        tmp_path, capsys):
    args = fit_args(timeline_data[0], tmp_path, "--mlflow.run_name", "with-emb", "--mlflow.system_metrics", "false",
                    "--trainer.max_epochs", "1", "--model.ranker.user_embedding.dim", str(DIM),
                    "--model.ranker.user_embedding.path", str(exported / "emb.parquet"),
                    "--model.ranker.user_embedding.lag_days", "1")
    cli_main(args)
    run = all_runs(tracking)["with-emb"]
    assert run.info.status == "FINISHED" and "test/auc" in run.data.metrics
    m = run.data.metrics
    assert 0 < m["data/train_user_embedding_missing"] < m["data/train_user_embedding_missing"] / \
        m["data/train_user_embedding_missing_share"]  # some, not all, training rows lack one
    assert run.data.tags["user_embedding.sha256"] == json.loads(manifest_path(exported / "emb.parquet").read_text())["sha256"]
    assert "user embeddings (test):" in capsys.readouterr().out


@pytest.mark.slow
def test_a_resume_after_the_embedding_file_was_exported_again_is_refused(exported, timeline_data, tracking,  # noqa: F811
                                                                          tmp_path, capsys):
    """Re-exported in place, the file's second half of the steps read other embeddings than the
    first, and the run recorded only the new file's digest."""
    from mlflow.tracking import MlflowClient

    emb = tmp_path / "emb.parquet"
    for name in ("emb.parquet", "emb.parquet.json"):
        shutil.copy(exported / name, tmp_path / name)
    args = fit_args(timeline_data[0], tmp_path, "--mlflow.run_name", "emb", "--mlflow.system_metrics", "false",
                    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches",
                    "0", "--trainer.limit_test_batches", "1", "--model.ranker.user_embedding.dim", str(DIM),
                    "--model.ranker.user_embedding.path", str(emb))
    cli_main(args)
    run, client = all_runs(tracking)["emb"], MlflowClient(tracking)
    client.set_terminated(run.info.run_id, "KILLED")  # as a killed run is seen again
    joined = run.data.tags["user_embedding.sha256"]
    rows, manifest = _frame(emb), json.loads(manifest_path(emb).read_text())
    write_embeddings(emb, rows["user_id"], rows["as_of_day"], rows["history_time"], rows["embedding"] + 1.0,
                     {"data_digest": manifest["data_digest"]})
    with pytest.raises(SystemExit) as exc:
        cli_main([*args, "--ckpt_path", str(next(tmp_path.rglob("last.ckpt")))])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "the user embedding file changed since its run started" in err[-1], err[-3:]
    after = client.get_run(run.info.run_id)
    assert after.info.status == "KILLED" and after.data.tags["user_embedding.sha256"] == joined


def test_the_joined_columns_are_the_files_embedding_or_the_unknown_flag(exported, timeline_data):  # noqa: F811
    cfg = UserEmbeddingConfig(dim=DIM, path=str(exported / "emb.parquet"), lag_days=0)
    dm = RankerData(str(timeline_data[0]), batch_size=64, max_seq_len=32, num_workers=0, user_embedding=cfg)
    dm.setup("test")
    split = dm._splits["test"]
    batch = split.gather(np.arange(64), 32)
    n_dense = dm.spec["n_dense"]
    assert batch["dense"].shape == (64, feature_width(n_dense, RankerConfig(user_embedding=cfg)))
    emb = read_embeddings(cfg.path, data_digest=dm.spec["digest"], dim=DIM)
    rows, _ = join_as_of(split.user[:64], split.day[:64], emb, 0)
    known = batch["dense"][:, -1].numpy()
    np.testing.assert_array_equal(known, (rows >= 0).astype(np.float32))
    np.testing.assert_array_equal(batch["dense"][rows >= 0, n_dense:-1].numpy(), emb.table[rows[rows >= 0]])
    assert (batch["dense"][rows < 0, n_dense:].numpy() == 0).all()


def test_unknown_rows_use_the_learned_vector_whatever_their_columns_hold():
    cfg = RankerConfig(embed_dim=32, num_layers=1, mlp_dims=[16],
                       user_embedding=UserEmbeddingConfig(dim=4, path="unused.parquet"))
    torch.manual_seed(0)
    model = Ranker(cfg, vocab_size=50, n_actions=3, n_dense=2).double()
    offsets = torch.tensor([0, 2, 5])
    inputs = dict(hist_item=torch.randint(0, 50, (5,)), hist_action=torch.zeros(5, dtype=torch.long),
                  hist_age=torch.rand(5), offsets=offsets, max_seq_len=4, cand_item=torch.tensor([1, 2]))
    dense = torch.randn(2, 2 + 4 + 1, dtype=torch.float64)
    dense[:, -1] = torch.tensor([1.0, 0.0])  # row 0 known, row 1 unknown
    other = dense.clone()
    other[:, 2:6] += torch.arange(1.0, 5.0, dtype=torch.float64)  # not a constant shift: the LayerNorm would erase it
    a, b = model(dense=dense, **inputs), model(dense=other, **inputs)
    assert a[1] == b[1] and a[0] != b[0]
    assert RankerConfig(**asdict(cfg)) == cfg  # a checkpoint's hyperparameters rebuild the config


# --- bad input ----------------------------------------------------------------------------
@pytest.fixture
def emb_copy(exported, tmp_path):
    for name in ("emb.parquet", "emb.parquet.json"):
        shutil.copy(exported / name, tmp_path / name)
    return tmp_path / "emb.parquet"


def _digest(timeline_data):  # noqa: F811
    return timeline_data[1]["digest"]


def test_another_data_sets_file_is_refused(emb_copy, timeline_data):  # noqa: F811
    with pytest.raises(ConfigError, match="computed from another data set"):
        read_embeddings(emb_copy, data_digest="0" * 64, dim=DIM)


def test_a_wrong_dimension_is_refused(emb_copy, timeline_data):  # noqa: F811
    with pytest.raises(ConfigError, match=f"holds embeddings of dim {DIM}, the config says .*dim=8"):
        read_embeddings(emb_copy, data_digest=_digest(timeline_data), dim=8)


def test_a_changed_or_missing_file_is_refused(emb_copy, timeline_data):  # noqa: F811
    with open(emb_copy, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    with pytest.raises(ConfigError, match="sha256 differs"):
        read_embeddings(emb_copy, data_digest=_digest(timeline_data), dim=DIM)
    manifest_path(emb_copy).unlink()
    with pytest.raises(ConfigError, match="no manifest"):
        read_embeddings(emb_copy, data_digest=_digest(timeline_data), dim=DIM)
    with pytest.raises(ConfigError, match="does not exist"):
        read_embeddings(emb_copy.with_name("nope.parquet"), data_digest=_digest(timeline_data), dim=DIM)


def test_an_embedding_computed_after_its_as_of_day_is_leakage(emb_copy, timeline_data):  # noqa: F811
    rows = _frame(emb_copy)
    time = rows["history_time"].copy()
    time[3] = rows["as_of_day"][3] - 1 + 0.25  # read a log of its own as-of day
    manifest = json.loads(manifest_path(emb_copy).read_text())
    write_embeddings(emb_copy, rows["user_id"], rows["as_of_day"], time, rows["embedding"],
                     {"data_digest": manifest["data_digest"]})
    with pytest.raises(ConfigError, match=f"leakage: the embedding of user {rows['user_id'][3]} as of day"):
        read_embeddings(emb_copy, data_digest=_digest(timeline_data), dim=DIM)


def test_repeated_user_days_are_refused(tmp_path):
    write_embeddings(tmp_path / "e.parquet", np.array([1, 1]), np.array([3, 3]), np.array([0.5, 1.5]),
                     np.zeros((2, 2)), {"data_digest": "d"})
    with pytest.raises(ConfigError, match="user 1 has two embeddings as of day 3"):
        read_embeddings(tmp_path / "e.parquet", data_digest="d", dim=2)


def test_bad_options_stop_fit_with_one_line(exported, timeline_data, tiny_data, tracking, tmp_path, capsys):  # noqa: F811
    emb = ["--model.ranker.user_embedding.dim", str(DIM), "--model.ranker.user_embedding.path",
           str(exported / "emb.parquet")]
    cases = [
        (timeline_data[0], ["--model.ranker.user_embedding.lag_days", "-1"], "lag_days must be >= 0"),
        (timeline_data[0], ["--model.ranker.user_embedding.dim", "8"], "holds embeddings of dim 16"),
        (tiny_data[0], [], "needs a timeline data set"),
    ]
    for data, extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            cli_main(fit_args(data, tmp_path, *emb, *extra))
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and message in err[-1] and err[-1].startswith("error:")
    assert not all_runs(tracking)  # refused before any run was recorded


def test_the_encoder_commands_refuse_bad_input_with_exit_2(exported, tiny_data, timeline_data, capsys):  # noqa: F811
    assert ue_main(["fit", "--data", str(tiny_data[0]), *ENCODER]) == 2
    assert "per-example data" in capsys.readouterr().err
    assert ue_main(["fit", "--data", str(timeline_data[0]), "--cutoff-day", "99", *ENCODER]) == 2
    assert "--cutoff-day must be in [2, 6]" in capsys.readouterr().err  # day 6 is validation, 7 test
    assert ue_main(["export", "--data", str(timeline_data[0]), "--encoder", str(exported / "enc.pt"),
                    "--out", "x.parquet", "--as-of", "1"]) == 2
    assert "--as-of must be in [2, 7]" in capsys.readouterr().err


@pytest.mark.slow
def test_an_earlier_cutoff_day_labels_and_times_the_days_it_trained_and_validated(timeline_data, tracking,  # noqa: F811
                                                                                   tmp_path, capsys):
    """--cutoff-day 4 trains on days 1-3 and validates on the validation day (6 of 7), not on day 4."""
    data, meta = timeline_data
    out = tmp_path / "enc.pt"
    assert ue_main(["fit", "--data", str(data), "--out", str(out), "--cutoff-day", "4", "--max-steps", "2",
                    *ENCODER]) == 0
    said = capsys.readouterr().out
    assert "impressions of days 1..3" in said and "(day 6 impressions" in said, said
    record = json.loads(open(f"{out}.json").read())
    days = read_split(data, "train", ["impression_day"]).column("impression_day").to_numpy()
    assert meta["config"]["days"] == 7  # days 1-5 train, 6 validation, 7 test
    assert record["cutoff_day"] == 4 and record["days_trained"] == 3 and record["val_day"] == 6
    assert record["impressions"] == int((days < 4).sum()) < len(days)
    r = record["results"]
    assert r["train/seconds_per_day"] == pytest.approx(r["train/seconds"] / (2 * 64) * record["impressions"] / 3)


@pytest.mark.parametrize("extra, message", [
    (["--num-layers", "-1"], "argument --num-layers: must be >= 0, got -1"),  # trained an encoder without layers
    (["--lr", "-1"], "argument --lr: must be a number > 0, got -1"),  # torch's traceback, the run FAILED
    (["--lr", "nan"], "argument --lr: must be a number > 0, got nan"),
    (["--max-steps", "-1"], "argument --max-steps: must be >= 0, got -1"),  # logged "-1 steps"
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--cutoff-day", "0"], "--cutoff-day must be in [2, 6]"),  # read as "the default"
    (["--cutoff-day", "7"], "--cutoff-day must be in [2, 6]"),  # trained on days 1-5, said and timed 1-6
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
])
def test_bad_encoder_arguments_are_one_line_and_exit_2(timeline_data, tracking, tmp_path, capsys,  # noqa: F811
                                                        extra, message):
    args = ["fit", "--data", str(timeline_data[0]), "--out", str(tmp_path / "enc.pt"), *ENCODER, *extra]
    assert ue_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not all_runs(tracking) and not (tmp_path / "enc.pt").exists()


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("kind, message", [
    ("empty", "the file is empty"),
    ("truncated", "not a readable encoder file, truncated or not written by torch.save"),
    ("malicious", "holds Python objects other than tensors and plain values"),
    ("foreign", "not an encoder written by `pipeline.user_embeddings fit` (it lacks one of config"),
    ("other weights", "not an encoder written by `pipeline.user_embeddings fit` (RuntimeError: Error(s) in loading"),
])
def test_bad_encoder_files_are_one_line_and_never_unpickled(exported, timeline_data, tracking, tmp_path,  # noqa: F811
                                                             capsys, monkeypatch, kind, message):
    path, good = tmp_path / "enc.pt", (exported / "enc.pt").read_bytes()
    if kind == "empty":
        path.touch()
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "malicious":
        torch.save({"config": Payload()}, path)
    elif kind == "foreign":
        torch.save({"weights": torch.zeros(3)}, path)
    else:
        ckpt = torch.load(exported / "enc.pt", weights_only=True)
        ckpt["state_dict"] = {k: torch.zeros(1) for k in ckpt["state_dict"]}
        torch.save(ckpt, path)
    monkeypatch.chdir(tmp_path)
    args = ["export", "--data", str(timeline_data[0]), "--encoder", str(path), "--out", str(tmp_path / "e.parquet")]
    assert ue_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --encoder {path}: ") and message in err[0], err
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "e.parquet").exists()


@pytest.mark.parametrize("command", ["fit", "export"])
@pytest.mark.parametrize("store, message", [  # a hanging server is waited out: 5 s
    pytest.param("hang", "answers /health but not its API", marks=pytest.mark.slow), ("closed", "is unreachable")])
def test_the_encoder_commands_check_the_tracking_server_first(exported, timeline_data, server, monkeypatch,  # noqa: F811
                                                              capsys, tmp_path, command, store, message):
    """Against a server that answers /health but not its API, fit hung 900 s; against an
    unreachable one it retried for minutes and ended in tracebacks."""
    import socket
    import time

    for key in HTTP_BOUNDS:  # recorded, so that what check_tracking sets is undone afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    if store == "closed":
        with socket.socket() as sock:  # a port nothing listens on
            sock.bind(("127.0.0.1", 0))
            uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    else:
        uri = server(store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    data = str(timeline_data[0])
    args = (["fit", "--data", data, "--out", str(tmp_path / "enc.pt"), *ENCODER] if command == "fit" else
            ["export", "--data", data, "--encoder", str(exported / "enc.pt"), "--out", str(tmp_path / "e.parquet")])
    t0 = time.monotonic()
    assert ue_main(args) == 2
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: MLflow tracking server") and message in err[0], err
    assert not (tmp_path / "enc.pt").exists() and not (tmp_path / "e.parquet").exists()


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_the_encoder_fit_and_ends_its_run_killed(timeline_data, tracking, tmp_path, capsys,  # noqa: F811
                                                                 monkeypatch, signum, status):
    from pipeline.encoder import EncoderModule

    step = EncoderModule.training_step

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            os.kill(os.getpid(), signum)
        return step(self, batch, batch_idx)

    monkeypatch.setattr(EncoderModule, "training_step", training_step)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert ue_main(["fit", "--data", str(timeline_data[0]), "--out", str(tmp_path / "enc.pt"), *ENCODER]) == status
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores further Ctrl-C after one
    said = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted (Ctrl-C / SIGINT)"
    assert said in capsys.readouterr().err
    (run,) = all_runs(tracking).values()
    assert run.info.status == "KILLED" and not (tmp_path / "enc.pt").exists()
