"""The synthetic data generator on the `tiny` preset: schema, determinism, distributions, the
planted signal, and the CLI. Bad inputs are in test_data_gen_validation.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from sklearn.metrics import roc_auc_score

from data_gen import load_meta, read_split, validate_dataset
from data_gen.config import ConfigError, resolve_config
from data_gen.generate import generate_dataset, generate_shard, plan_shards
from data_gen.lengths import build_length_model
from data_gen.metrics import auc, normalized_entropy
from data_gen.oracle import oracle_logits
from data_gen.report import fit_zipf_slope, write_report
from data_gen.schema import SPLITS, dataset_digest, sha256_file
from data_gen.world import build_world


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The tiny preset, seed 0, generated in-process once per session (also imported by
    test_data_gen_validation.py, hence the reuse of an existing directory)."""
    path = tmp_path_factory.getbasetemp() / "data_gen_tiny"
    if not (path / "meta.json").exists():
        generate_dataset(resolve_config("tiny"), 0, path, preset="tiny", workers=1,
                         progress=False)
    return path, load_meta(path)


def _file_shas(meta):
    return [(f["path"], f["sha256"]) for s in SPLITS for f in meta["splits"][s]["files"]]


def _flat(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    arr = table.column(name).combine_chunks()
    off = arr.offsets.to_numpy().astype(np.int64)
    return off - off[0], arr.values.slice(off[0], off[-1] - off[0]).to_numpy()


def test_schema_and_meta(tiny_data):
    path, meta = tiny_data
    cfg = meta["config"]
    for key in ("generator_version", "seed", "preset", "config", "digest", "splits"):
        assert key in meta
    assert meta["preset"] == "tiny" and cfg["vocab_size"] == 20_000
    total = 0
    for split in SPLITS:
        t = read_split(path, split)
        entry = meta["splits"][split]
        assert t.num_rows == entry["rows"] == sum(f["rows"] for f in entry["files"]) > 0
        total += t.num_rows
        types = {f.name: f.type for f in t.schema}
        assert types["example_id"] == pa.int64() and types["user_id"] == pa.int64()
        assert types["cand_item"] == pa.int32() and types["label"] == pa.int8()
        assert types["p_true"] == pa.float32()
        assert [n for n in t.column_names if n.startswith("dense_")] == \
            [f"dense_{i}" for i in range(cfg["n_dense"])]
        off_i, item = _flat(t, "hist_item")
        off_a, action = _flat(t, "hist_action")
        off_g, age = _flat(t, "hist_age")
        assert item.dtype == np.int32 and action.dtype == np.int8 and age.dtype == np.float32
        assert np.array_equal(off_i, off_a) and np.array_equal(off_i, off_g)
        assert item.min() >= 0 and item.max() < cfg["vocab_size"]
        assert action.min() >= 0 and action.max() < cfg["n_actions"]
        assert len(np.unique(action)) == cfg["n_actions"]  # every action type occurs
        # oldest first: ages never increase inside a row
        inside = np.ones(age.size, dtype=bool)
        inside[off_i[1:-1]] = False  # position i starts a new row: its age may jump up
        assert np.all(np.diff(age)[inside[1:]] <= 0) and age.min() >= 0
        label = t.column("label").to_numpy()
        assert set(np.unique(label)) == {0, 1}
        ls = entry["length_stats"]
        assert ls["max"] == np.diff(off_i).max() and ls["mean"] == pytest.approx(
            np.diff(off_i).mean())
        assert entry["ctr"] == pytest.approx(label.mean())
    assert total == cfg["rows"]
    ids = np.concatenate([read_split(path, s, ["example_id"]).column(0).to_numpy()
                          for s in SPLITS])
    assert np.array_equal(ids, np.arange(total))
    shas = [sha for _, sha in _file_shas(meta)]
    assert meta["digest"] == dataset_digest(shas)
    assert all(sha256_file(path / p) == sha for p, sha in _file_shas(meta))


def test_read_split_returns_requested_columns_without_copying(tiny_data):
    path, meta = tiny_data
    t = read_split(path, "val", columns=["hist_item", "label"])
    assert t.column_names == ["hist_item", "label"]
    assert t.column("hist_item").num_chunks >= len(meta["splits"]["val"]["files"])


def test_same_seed_same_bytes_whatever_the_workers(tiny_data, tmp_path):
    path, meta = tiny_data
    cfg = resolve_config("tiny")
    two = generate_dataset(cfg, 0, tmp_path / "w2", preset="tiny", workers=2, progress=False)
    assert _file_shas(two) == _file_shas(meta) and two["digest"] == meta["digest"]
    assert two["splits"]["train"]["oracle"] == meta["splits"]["train"]["oracle"]
    other = generate_dataset(cfg, 1, tmp_path / "s1", preset="tiny", workers=1, progress=False)
    assert other["digest"] != meta["digest"]


@pytest.mark.parametrize("alpha", [1.0, 0.6, 1.4])
def test_item_popularity_follows_zipf(alpha, tiny_data):
    if alpha == 1.0:  # the written data set
        _, item = _flat(read_split(tiny_data[0], "train", ["hist_item"]), "hist_item")
    else:  # the same generator, other alphas (alpha <= 1 included), without writing files;
        # without motifs, whose planted items (2 x motif_rate of all) are drawn by category
        # first (docs/data.md), which tilts the slope at a steep alpha (-1.34 for 1.4)
        cfg = resolve_config("tiny", {"alpha": alpha, "rows": 3000, "motif_rate": 0,
                                      "cand_motif": 0})
        world_seed, shards = plan_shards(cfg, 3)
        world = build_world(cfg, world_seed)
        cols, _ = generate_shard(world, cfg, build_length_model(cfg), shards[0])
        item = cols["hist_item"][1]
    counts = np.bincount(item, minlength=20_000)
    fit = fit_zipf_slope(counts)
    assert fit["max_rank"] > 200
    assert fit["slope"] == pytest.approx(-alpha, abs=0.06)
    # ids are permuted: popularity rank is not the id
    top = np.argsort(counts)[::-1][:50]
    assert not np.array_equal(np.sort(top), np.arange(50))


def test_lengths_follow_the_config(tiny_data):
    path, meta = tiny_data
    cfg = resolve_config("tiny")
    model = build_length_model(cfg)
    expected = model.expected()
    assert expected["mean"] == pytest.approx(cfg.mean_len, rel=1e-6)
    lengths = np.concatenate([np.diff(_flat(read_split(path, s, ["hist_item"]), "hist_item")[0])
                              for s in SPLITS])
    n = np.arange(model.pmf.size)
    sd = np.sqrt((model.pmf * (n - expected["mean"]) ** 2).sum())
    assert abs(lengths.mean() - expected["mean"]) < 4 * sd / np.sqrt(lengths.size)
    for q in (0.5, 0.9):
        got = np.quantile(lengths, q, method="inverted_cdf")
        assert abs(got - model.quantile(q)) <= 0.15 * model.quantile(q) + 2
    assert (lengths == 0).any() and (lengths > 1024).any() and lengths.max() <= cfg.max_len
    assert (lengths == 0).mean() == pytest.approx(expected["frac_zero"], abs=0.01)


@pytest.mark.parametrize("dist,over", [("uniform", {"min_len": 3, "max_len": 300}),
                                       ("lognormal", {"mean_len": 200.0, "length_sigma": 0.8}),
                                       ("power", {"min_len": 5, "mean_len": 40.0})])
def test_length_families(dist, over):
    cfg = resolve_config("tiny", {"length_dist": dist, **over})
    model = build_length_model(cfg)
    x = model.sample(np.random.default_rng(0), 200_000)
    assert x.min() >= cfg.min_len and x.max() <= cfg.max_len
    target = (cfg.min_len + cfg.max_len) / 2 if dist == "uniform" else cfg.mean_len
    assert model.expected()["mean"] == pytest.approx(target, rel=1e-6)
    assert x.mean() == pytest.approx(target, rel=0.02)


def test_oracle_auc_is_honest_and_well_above_chance(tiny_data):
    path, meta = tiny_data
    t = read_split(path, "train", ["label", "p_true"])
    y, p = t.column("label").to_numpy(), t.column("p_true").to_numpy()
    oracle = meta["splits"]["train"]["oracle"]
    assert oracle["auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-12)
    assert oracle["auc"] == pytest.approx(auc(y, p), abs=1e-12)
    assert oracle["ne"] == pytest.approx(normalized_entropy(y, p), abs=1e-9)
    assert oracle["auc"] > 0.75 and oracle["ne"] < 0.85
    # labels really are Bernoulli(p_true): calibrated in every decile of p
    edges = np.quantile(p, np.linspace(0, 1, 11))
    bins = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, 9)
    for b in range(10):
        m = bins == b
        se = np.sqrt(p[m].mean() * (1 - p[m].mean()) / m.sum())
        assert abs(y[m].mean() - p[m].mean()) < 4.5 * se + 1e-3


def test_old_history_carries_signal(tiny_data):
    path, meta = tiny_data
    oracle = meta["splits"]["train"]["oracle"]
    # more history, better oracle; the last 64 items miss a clear part of the signal
    assert oracle["auc_recent_0"] < oracle["auc_recent_64"] < oracle["auc_recent_256"] \
        <= oracle["auc_recent_1024"] + 1e-9
    assert oracle["auc"] - oracle["auc_recent_64"] > 0.025
    assert oracle["auc_recent_64"] - oracle["auc_recent_0"] > 0.05
    # recomputed from the files alone (plus the world rebuilt from seed and config): p_true is
    # a function of the stored columns, and the windowed AUCs in meta.json are what they say
    logits = oracle_logits(path, "train", [64, 256])
    p = read_split(path, "train", ["p_true"]).column(0).to_numpy()
    assert np.array_equal((0.5 * (1 + np.tanh(0.5 * logits["full"]))).astype(np.float32), p)
    y = read_split(path, "train", ["label"]).column(0).to_numpy()
    assert auc(y, logits["64"]) == pytest.approx(oracle["auc_recent_64"], abs=1e-6)
    assert auc(y, logits["256"]) == pytest.approx(oracle["auc_recent_256"], abs=1e-6)


def test_truncating_history_changes_only_long_rows(tiny_data):
    path, _ = tiny_data
    logits = oracle_logits(path, "val", [64])
    lengths = np.diff(_flat(read_split(path, "val", ["hist_item"]), "hist_item")[0])
    same = np.isclose(logits["64"], logits["full"], rtol=0, atol=1e-12)
    assert same[lengths <= 64].all()
    assert not same[lengths > 300].all()


def test_config_overrides_and_bad_values():
    cfg = resolve_config("small", {"rows": "1e4", "max-len": "4096", "oracle_ks": "0,32,512"})
    assert (cfg.rows, cfg.max_len, cfg.oracle_ks) == (10_000, 4096, (0, 32, 512))
    assert dataclasses.replace(cfg, rows=7).rows == 7
    bad = [("nope", {}, "unknown preset"), ("tiny", {"rows": "-5"}, "rows must be positive"),
           ("tiny", {"alpha": "0"}, "alpha must be > 0"), ("tiny", {"alpha": "-1"}, "alpha"),
           ("tiny", {"rows": "abc"}, "cannot read"), ("tiny", {"alpah": "1"}, "did you mean"),
           ("tiny", {"mean_len": "5000"}, "out of reach"), ("tiny", {"rows": "2"}, "empty split"),
           ("tiny", {"length_dist": "zipf"}, "length_dist")]
    for preset, over, message in bad:
        with pytest.raises(ConfigError, match=message):
            resolve_config(preset, over)


def test_report_writes_plots_and_summary(tiny_data, tmp_path):
    path, meta = tiny_data
    paths = write_report(path, tmp_path / "rep")
    for p in paths.values():
        assert p.stat().st_size > 1000
    assert paths["lengths"].read_bytes()[:4] == b"\x89PNG"
    text = paths["summary"].read_text()
    assert meta["digest"] in text and "| train |" in text and "slope" in text
    y = read_split(path, "test", ["label"]).column(0).to_numpy()
    blind = text.split("| recent blind to recency |")[1].split("\n")[0]  # its last cell: the whole history
    assert blind.endswith(f" {auc(y, oracle_logits(path, 'test', [64], recency=False)['full']):.4f} |")


def test_meta_is_plain_json_with_the_oracle_definition(tiny_data):
    path, meta = tiny_data
    again = json.loads((path / "meta.json").read_text())
    assert again == load_meta(path) == validate_dataset(path)
    assert "last k history items" in meta["oracle_definition"]
    assert meta["config"]["length_model"]["dist"] == "power"


def test_long_preset_has_long_histories_and_a_long_range_signal(tmp_path):
    # the spec of the `long` preset (S2-attention's case), checked on 1,500 of its rows
    cfg = resolve_config("long", {"rows": 1500, "vocab_size": 50_000})
    assert cfg.max_len == 16_384 and cfg.mean_len >= 2048 and cfg.oracle_ks[-1] == 16_384
    generate_dataset(cfg, 0, tmp_path / "long", preset="long", workers=1, progress=False)
    meta = load_meta(tmp_path / "long")
    oracle = meta["splits"]["train"]["oracle"]
    assert meta["splits"]["train"]["length_stats"]["max"] <= 16_384
    # more of the history, more of the planted signal, past 1024 items
    assert oracle["auc_recent_1024"] + 0.02 < oracle["auc_recent_4096"] <= oracle["auc_recent_16384"] + 1e-3
    # the long and timeline presets are the paper preset's order world (frequent motifs, R on the last match)
    world = ("motif_rate", "n_motifs", "motif_window", "recent_halflife", "w_recent", "cand_current")
    paper, timeline = resolve_config("paper", {}), resolve_config("timeline", {})
    assert all(getattr(cfg, k) == getattr(paper, k) == getattr(timeline, k) for k in world)
