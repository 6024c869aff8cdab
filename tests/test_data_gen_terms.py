"""The planted terms on the `tiny` preset: categories and their mislabels, the motif term's
dependence on order, the per-term oracle views in meta.json, refused configs, old data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from data_gen import DataValidationError, load_meta, read_split
from data_gen.__main__ import main
from data_gen.config import ConfigError, resolve_config
from data_gen.history import History, action_strength, row_and_recency
from data_gen.metrics import auc
from data_gen.oracle import oracle_logits
from data_gen.planted import TERMS, planted_terms
from data_gen.world import build_world, world_seed
from test_data_gen import tiny_data  # noqa: F401  (the shared session fixture)


@pytest.fixture(scope="module")
def world():
    return build_world(resolve_config("tiny"), world_seed(0))


def _flat(table, name):
    arr = table.column(name).combine_chunks()
    return arr.values.to_numpy()[arr.offsets[0].as_py():arr.offsets[-1].as_py()]


def test_files_show_each_items_category_wrong_for_the_configured_share(tiny_data, world):  # noqa: F811
    path, meta = tiny_data
    cfg = resolve_config("tiny")
    t = read_split(path, "train", ["hist_item", "hist_category", "cand_item", "cand_category"])
    item, shown = _flat(t, "hist_item"), _flat(t, "hist_category")
    assert np.array_equal(shown, world.shown_category[item])
    assert np.array_equal(t.column("cand_category").to_numpy(),
                          world.shown_category[t.column("cand_item").to_numpy()])
    wrong = world.shown_category != world.item_category
    sd = np.sqrt(cfg.category_noise * (1 - cfg.category_noise) / wrong.size)
    assert abs(wrong.mean() - cfg.category_noise) < 5 * sd
    assert 0 <= world.shown_category.min() and world.shown_category.max() < cfg.n_categories
    # a category is a union of clusters: every item of a cluster has the cluster's category
    assert np.array_equal(world.item_category, world.cluster_category[world.item_cluster])


def _row(world, cats: list[int], seed: int = 0) -> History:
    """One history with items of the given true categories, oldest first."""
    cats = np.asarray(cats, np.int16)
    item = world.sample_category_items(cats, np.random.default_rng(seed).random((2, cats.size)))
    offsets = np.array([0, cats.size])
    row, recency = row_and_recency(offsets)
    return History(offsets=offsets, item=item, action=np.zeros(cats.size, np.int8),
                   age=np.zeros(cats.size, np.float32), category=world.item_category[item],
                   row=row, recency=recency)


def _terms(world, hist: History, cand_cat: int) -> dict[str, float]:
    cfg = resolve_config("tiny")
    cand = world.sample_category_items(np.array([cand_cat]), np.full((2, 1), 0.5))
    _, terms = planted_terms(world, cfg, hist, cand, np.array([cand_cat], np.int16),
                             np.zeros((1, cfg.n_dense), np.float32))
    return dict(zip(TERMS, terms[:, -1, 0]))  # the whole-history view


def test_the_motif_term_depends_on_order_and_the_per_item_terms_do_not(world):
    cfg = resolve_config("tiny")
    a, b = (int(c) for c in world.motifs[0])
    others = [c for c in range(cfg.n_categories) if c not in (a, b)][:6]
    true = _terms(world, _row(world, others[:3] + [a, others[3], b] + others[4:]), b)
    reversed_ = _terms(world, _row(world, others[:3] + [b, others[3], a] + others[4:]), b)
    apart = _terms(world, _row(world, [a] + others + others + [b]), b)
    assert true["motif"] == cfg.w_motif and reversed_["motif"] == 0  # a then b within the window
    assert apart["motif"] == 0  # a before b, but further than motif_window
    assert true["freq"] == reversed_["freq"] > 0  # the same items, counted the same
    # a shuffle keeps every count but moves the pair apart or out of order
    rng = np.random.default_rng(1)
    hist = _row(world, [a, b] + others * 3)
    before = _terms(world, hist, b)
    perm = rng.permutation(hist.item.size)
    perm = perm[np.argsort(perm == 0, kind="stable")]  # the a last: after the b
    shuffled = History(**{**hist.__dict__, "item": hist.item[perm], "category": hist.category[perm]})
    after = _terms(world, shuffled, b)
    assert before["motif"] > 0 and after["motif"] == 0 and after["freq"] == before["freq"]


def test_the_oracle_without_recency_weighs_every_match_of_R_alike(tiny_data, world):  # noqa: F811
    path, _ = tiny_data
    cfg = resolve_config("tiny")
    t = read_split(path, "test", ["hist_item", "hist_action", "cand_item"])
    no_r = oracle_logits(path, "test", [64], without="recent")["full"]
    blind = oracle_logits(path, "test", [64], recency=False)["full"] - no_r
    weighted = oracle_logits(path, "test", [64])["full"] - no_r
    strength, cand = action_strength(cfg.n_actions), t.column("cand_item").to_numpy()
    rows = 0
    for r in range(300):  # R by hand: w_recent times the mean strength over the candidate category's matches
        item, action = (np.asarray(t.column(c)[r].as_py(), dtype=np.int64) for c in ("hist_item", "hist_action"))
        match = world.item_category[item] == world.item_category[cand[r]]
        assert blind[r] == pytest.approx(cfg.w_recent * strength[action[match]].mean() if match.any() else 0.0)
        rows += int(match.sum() > 1)
    assert rows > 20 and np.abs(blind - weighted).max() > 0.1  # matches at different recencies: the weights matter

def test_meta_gives_each_terms_oracle_views(tiny_data):  # noqa: F811
    path, meta = tiny_data
    cfg = meta["config"]
    views = meta["splits"]["test"]["oracle_terms"]
    assert set(views) == set(TERMS) and "oracle_terms" not in meta["splits"]["train"]
    ks = [str(k) for k in cfg["oracle_ks"] if k > 0] + ["full"]
    for term in TERMS:
        assert set(views[term]) == {f"{how}_{k}" for how in ("alone", "without") for k in ks}
    y = read_split(path, "test", ["label"]).column(0).to_numpy()
    full = oracle_logits(path, "test", [64])
    for term in ("motif", "recent"):
        without = oracle_logits(path, "test", [64], without=term)
        assert views[term]["without_full"] == pytest.approx(auc(y, without["full"]), abs=1e-6)
        assert views[term]["without_64"] == pytest.approx(auc(y, without["64"]), abs=1e-6)
        alone = (full["full"] - without["full"]).astype(np.float32)  # the term as meta stores it
        assert views[term]["alone_full"] == pytest.approx(auc(y, alone), abs=1e-6)
    # each term carries signal of its own, and the full logit beats the logit without it
    oracle = meta["splits"]["test"]["oracle"]
    for term in TERMS:
        assert views[term]["alone_full"] > 0.52 and views[term]["without_full"] < oracle["auc"]


@pytest.mark.parametrize("over,words", [
    ({"motif_window": "2048"}, "motif_window=2048 must be in [1, max_len=2048)"),
    ({"n_categories": "30000"}, "n_categories=30000 must be in [2, min(vocab_size=20000"),
    ({"n_categories": "200"}, "n_categories=200 must be <= n_clusters=100"),
    ({"n_motifs": "17"}, "n_motifs=17 must be in [0, n_categories // 2 = 16]"),
    ({"bias": "-60"}, "bias=-60.0 is more than 20 beyond the terms' reach"),
    ({"bias": "60"}, "every label would be 1"),
    ({"w_recent": "0", "w_freq": "0", "w_item": "0", "w_motif": "0", "quality_sd": "0",
      "dense_sd": "0"}, "every row would have the same label probability"),
    ({"far_start": "4096"}, "far_start=4096 must be in [0, max_len=2048)"),
    ({"category_noise": "1.5"}, "category_noise must be in [0, 1]"),
    ({"motif_rate": "0", "cand_motif": "0.1"}, "cand_motif > 0 needs n_motifs > 0 and motif_rate > 0"),
    ({"cand_motif": "0.7"}, "must be probabilities summing <= 1"),
])
def test_configs_whose_terms_cannot_be_generated_are_refused(over, words, tmp_path, capsys):
    with pytest.raises(ConfigError) as info:
        resolve_config("tiny", over)
    assert words in str(info.value) and "\n" not in str(info.value)
    args = [x for k, v in over.items() for x in (f"--{k.replace('_', '-')}", v)]
    assert main(["generate", "--preset", "tiny", "--out", str(tmp_path / "d"), *args]) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_data_of_the_previous_generator_is_refused_with_the_command_to_regenerate(tiny_data, tmp_path):  # noqa: F811
    old = tmp_path / "old"
    shutil.copytree(tiny_data[0], old)
    meta = json.loads((old / "meta.json").read_text())
    meta["generator_version"] = "1.0.0"
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataValidationError) as info:
        load_meta(old)
    msg = str(info.value)
    assert "\n" not in msg and "without item categories" in msg
    assert f"python -m data_gen generate --preset tiny --out {old} --overwrite" in msg
