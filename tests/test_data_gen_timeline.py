"""The generator's timeline mode on the `timeline_tiny` preset: determinism, splits by day,
histories cut from one stream per user, seen-user counts, bad input, and a fit on it; and the
per-example mode left as it was."""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from data_gen import DataValidationError, load_meta, read_split, validate_dataset
from data_gen.__main__ import main as data_gen_main
from data_gen.config import resolve_config
from data_gen.generate import generate_dataset
from data_gen.history import sample_users
from data_gen.metrics import auc
from data_gen.oracle import oracle_logits
from data_gen.report import write_report
from data_gen.schema import SPLITS, split_days
from data_gen.world import build_world, world_seed
from pipeline.cli import main as cli_main
from pipeline.data import RankerData
from test_data_gen import tiny_data  # noqa: F401  (the shared session fixture)
from test_data_gen_validation import _edit_list, _edit_scalar, _expect, _rewrite
from test_pipeline_cli import all_runs, fit_args, tracking  # noqa: F401  (tracking: a fixture)

SHARD = "train/part-00001.parquet"
# The content of the per-example `tiny` preset at seed 0 (see content_sha256), as generator 2
# (categories, motifs) writes it: the default mode must keep producing exactly these values.
TINY_CONTENT_SHA256 = "2eccf4bb95736424511d225e69864774186c7702366ef63e8ae5d1a86ca5f1b4"


@pytest.fixture(scope="session")
def timeline_data(tmp_path_factory):
    """timeline_tiny, seed 0, generated in-process once per session (one worker)."""
    path = tmp_path_factory.getbasetemp() / "data_gen_timeline_tiny"
    if not (path / "meta.json").exists():
        generate_dataset(resolve_config("timeline_tiny"), 0, path, preset="timeline_tiny",
                         workers=1, progress=False)
    return path, load_meta(path)


def _columns(path, names):
    """Every split's columns, concatenated in split order (train, val, test) as numpy."""
    tables = [read_split(path, s, names) for s in SPLITS]
    out = {n: np.concatenate([t.column(n).to_numpy() for t in tables]) for n in names
           if not n.startswith("hist_")}
    for n in (n for n in names if n.startswith("hist_")):
        lists = [t.column(n).combine_chunks() for t in tables]
        out[n] = [np.asarray(v) for arr in lists for v in arr.to_numpy(zero_copy_only=False)]
    return out


def content_sha256(path) -> str:
    """sha256 of every split's decoded values, column by column (independent of the Parquet
    writer's bytes, so of the polars version)."""
    h = hashlib.sha256()
    for split in SPLITS:
        table = read_split(path, split)
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                h.update(pc.list_value_length(col).to_numpy().astype(np.int64).tobytes())
                col = pc.list_flatten(col)
            h.update(name.encode() + col.to_numpy().tobytes())
    return h.hexdigest()


def test_default_mode_is_unchanged(tiny_data):  # noqa: F811
    path, meta = tiny_data
    assert content_sha256(path) == TINY_CONTENT_SHA256
    assert "timeline" not in meta and "users" not in meta["config"] and "rows" in meta["config"]
    assert "impression_day" not in meta["columns"]


def test_same_bytes_whatever_the_workers(timeline_data, tmp_path):
    path, meta = timeline_data
    cfg = resolve_config("timeline_tiny")
    assert len(meta["splits"]["train"]["files"]) == 3  # three blocks of users: work to share
    files = [(f["path"], f["sha256"]) for s in SPLITS for f in meta["splits"][s]["files"]]
    for workers in (2, 3):
        again = generate_dataset(cfg, 0, tmp_path / f"w{workers}", preset="timeline_tiny",
                                 workers=workers, progress=False)
        assert [(f["path"], f["sha256"]) for s in SPLITS for f in again["splits"][s]["files"]] \
            == files
        assert again["digest"] == meta["digest"]
        assert {s: again["splits"][s]["users"] for s in SPLITS} == \
            {s: meta["splits"][s]["users"] for s in SPLITS}
    other = generate_dataset(cfg, 1, tmp_path / "s1", preset="timeline_tiny", workers=1,
                             progress=False)
    assert other["digest"] != meta["digest"]


def test_splits_are_days(timeline_data):
    path, meta = timeline_data
    days = meta["config"]["days"]
    assert meta["timeline"]["split_days"] == {s: list(d) for s, d in split_days(days).items()}
    last_time = -1.0
    for split in SPLITS:
        t = read_split(path, split, ["impression_day", "impression_time", "user_id"])
        day, time = t.column(0).to_numpy(), t.column(1).to_numpy()
        first, last = split_days(days)[split]
        assert t.num_rows == meta["splits"][split]["rows"] > 0
        assert day.min() >= first and day.max() <= last  # no later day in an earlier split
        assert np.array_equal(np.floor(time).astype(np.int32) + 1, day)
        assert time.min() > last_time  # every impression after those of the earlier splits
        last_time = time.max()
        user = t.column(2).to_numpy()
        assert user.min() >= 0 and user.max() < meta["config"]["users"]
    assert set(np.unique(read_split(path, "train", ["impression_day"]).column(0).to_numpy())) \
        == set(range(1, days - 1))
    ids = _columns(path, ["example_id"])["example_id"]
    assert np.array_equal(np.sort(ids), np.arange(ids.size))


def test_histories_are_prefixes_of_one_stream_per_user(timeline_data):
    """Every history lies strictly before its impression, and a user's impressions, in time
    order, see growing prefixes of one event stream (same items, actions, event times)."""
    path, meta = timeline_data
    c = _columns(path, ["user_id", "impression_time", "hist_item", "hist_action", "hist_age"])
    order = np.lexsort((c["impression_time"], c["user_id"]))
    users = c["user_id"][order]
    assert users.size / np.unique(users).size > 5  # many impressions per user
    for a, b in zip(order[:-1], order[1:]):
        age_b = c["hist_age"][b].astype(np.float64)
        assert (age_b > 0).all() and (np.diff(age_b) <= 0).all()  # before it, oldest first
        if c["user_id"][a] != c["user_id"][b]:
            continue
        n = c["hist_item"][a].size
        assert c["hist_item"][b].size >= n
        assert np.array_equal(c["hist_item"][b][:n], c["hist_item"][a])
        assert np.array_equal(c["hist_action"][b][:n], c["hist_action"][a])
        event_a = c["impression_time"][a] - c["hist_age"][a].astype(np.float64)
        event_b = c["impression_time"][b] - age_b[:n]
        np.testing.assert_allclose(event_b, event_a, rtol=0, atol=1e-3)  # float32 ages


def test_seen_user_counts_match_the_files(timeline_data):
    path, meta = timeline_data
    train_users = np.unique(read_split(path, "train", ["user_id"]).column(0).to_numpy())
    for split in SPLITS:
        user = read_split(path, split, ["user_id"]).column(0).to_numpy()
        seen = np.isin(user, train_users)
        figures = meta["splits"][split]["users"]
        assert figures["users"] == np.unique(user).size
        assert figures["seen_in_train"] == np.unique(user[seen]).size
        assert figures["rows_seen_in_train"] == seen.sum()
        assert figures["seen_share"] == pytest.approx(figures["seen_in_train"] / figures["users"])
    assert meta["splits"]["train"]["users"]["seen_share"] == 1.0
    # returning users dominate the later days, and some users are new to them
    for split in ("val", "test"):
        assert 0.5 < meta["splits"][split]["users"]["seen_share"] < 1.0


def test_label_is_planted_from_the_history_at_impression_time(timeline_data):
    path, meta = timeline_data
    for split in ("train", "test"):
        logits = oracle_logits(path, split, [64])
        t = read_split(path, split, ["p_true", "label"])
        p, y = t.column(0).to_numpy(), t.column(1).to_numpy()
        assert np.array_equal((0.5 * (1 + np.tanh(0.5 * logits["full"]))).astype(np.float32), p)
        oracle = meta["splits"][split]["oracle"]
        assert auc(y, logits["64"]) == pytest.approx(oracle["auc_recent_64"], abs=1e-6)
        assert oracle["auc"] > 0.75 and oracle["auc"] > oracle["auc_recent_64"]


def test_users_take_keeps_each_users_interests():
    cfg = resolve_config("timeline_tiny")
    world = build_world(cfg, world_seed(0))
    rng = np.random.default_rng(1)
    users = sample_users(world, cfg, rng, np.array([5, 0, 70, 9]))
    rows = np.array([2, 0, 2, 3])
    taken = users.take(rows)
    assert np.array_equal(taken.switch, users.switch[rows])
    u = rng.random(4000, dtype=np.float32)
    group = rng.integers(0, 2 * rows.size, u.size).astype(np.int32)  # (row, mixture) pairs
    original = (2 * rows[group // 2] + group % 2).astype(np.int32)
    assert np.array_equal(taken.pick_clusters(group, u), users.pick_clusters(original, u))


@pytest.mark.parametrize("args,words", [
    (["--users", "100"], "days in [3, 3650]"),
    (["--days", "5"], "needs --users"),
    (["--impressions-per-day", "3"], "--impressions-per-day applies only in timeline mode"),
    (["--preset", "timeline_tiny", "--days", "2"], "days in [3, 3650]"),
    (["--preset", "timeline_tiny", "--users", "-1"], "users must be"),
    (["--preset", "timeline_tiny", "--rows", "500"], "--rows does not apply in timeline mode"),
    (["--preset", "timeline_tiny", "--test-fraction", "0.2"], "does not apply"),
    (["--preset", "timeline_tiny", "--impressions-per-day", "0"], "impressions_per_day"),
    (["--preset", "timeline_tiny", "--activity-shape", "nan"], "activity_shape"),
    (["--preset", "timeline_tiny", "--users", "1", "--impressions-per-day", "0.01"],
     "has no impressions"),
])
def test_bad_timeline_arguments_fail_before_any_work(args, words, tmp_path, capsys):
    out = tmp_path / "never"
    assert data_gen_main(["generate", "--quiet", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.fixture
def broken(timeline_data, tmp_path):
    """A private copy of the timeline data, free to break."""
    dst = tmp_path / "data"
    shutil.copytree(timeline_data[0], dst)
    return dst


def test_validation_rejects_bad_timeline_rows(broken):
    days = load_meta(broken)["config"]["days"]
    shard = pq.read_table(broken / SHARD, columns=["impression_day", "hist_age"])
    day = int(shard.column(0)[7].as_py())
    _rewrite(broken, _edit_scalar("impression_day", 7, days - 1), shard=SHARD)  # a val day
    _expect(broken, "impression_day", 7, "outside the train split's days [1, 5]", file=SHARD)
    _rewrite(broken, _edit_scalar("impression_day", 7, day % (days - 2) + 1), shard=SHARD)
    _expect(broken, "impression_time", 7, "not within its impression_day", file=SHARD)
    _rewrite(broken, _edit_scalar("impression_day", 7, day), shard=SHARD)
    row = int(np.flatnonzero(pc.list_value_length(shard.column(1)).to_numpy() > 0)[0])
    _rewrite(broken, _edit_list("hist_age", row, lambda v: v[:-1] + [0.0]), shard=SHARD)
    _expect(broken, "hist_age", row, "not before the impression", file=SHARD)
    with pytest.raises(DataValidationError, match="not before the impression"):
        read_split(broken, "train")


def test_validation_rejects_an_unknown_user(broken):
    _rewrite(broken, _edit_scalar("user_id", 3, 300), shard=SHARD)
    _expect(broken, "user_id", 3, "user id outside [0, 300)", file=SHARD)
    assert validate_dataset(broken, deep=False)  # the footer is fine: the values are not


def test_the_data_module_reads_timeline_data_unchanged(timeline_data):
    path, meta = timeline_data
    dm = RankerData(str(path), batch_size=64, max_seq_len=32, num_workers=0, cache=False)
    dm.setup()
    for split in SPLITS:
        data = dm._splits[split]
        assert data.num_rows == meta["splits"][split]["rows"]
        assert np.array_equal(data.label, read_split(path, split, ["label"]).column(0).to_numpy())
    batch = next(iter(dm.train_dataloader()))
    assert batch["n_tokens"] > 0


@pytest.mark.slow
def test_fit_on_timeline_data(timeline_data, tracking, tmp_path):
    path, _ = timeline_data
    cli_main(fit_args(path, tmp_path, "--mlflow.run_name", "timeline", "--mlflow.system_metrics",
                      "false", "--trainer.max_epochs", "1"))
    run = all_runs(tracking)["timeline"]
    assert run.info.status == "FINISHED" and "test/auc" in run.data.metrics
    assert run.data.tags["data_digest"] == timeline_data[1]["digest"]


def test_report_names_the_timeline(timeline_data, tmp_path):
    text = write_report(timeline_data[0], tmp_path / "rep")["summary"].read_text()
    assert "Timeline: 300 users over 7 days" in text and "users seen in train: val" in text
