"""Jagged batches from the Parquet splits: gathers, truncation end, order, resume, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from data_gen.schema import read_split
from pipeline.batches import EpochBatchSampler, JaggedSplit
from experiments.loader_bench import main as loader_bench
from pipeline.data import RankerData
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def tiny_data_dir(tmp_path_factory) -> Path:
    """The `tiny` preset under the session's temp dir, generated once per session."""
    out = tmp_path_factory.getbasetemp() / "data_tiny"
    if not (out / "meta.json").is_file():
        cmd = [sys.executable, "-m", "data_gen", "generate", "--preset", "tiny", "--out", str(out)]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


def test_gather_keeps_the_most_recent_items(tiny):
    table = read_split(tiny, "val")
    n_dense = json.loads((tiny / "meta.json").read_text())["config"]["n_dense"]
    split = JaggedSplit(table, n_dense)
    idx = np.array([0, 3, 4, 17, 18, 100, table.num_rows - 1])
    max_seq_len = 16
    batch = split.gather(idx, max_seq_len)
    items, actions, ages = (table.column(c).to_pylist() for c in ("hist_item", "hist_action", "hist_age"))
    off = batch["offsets"].numpy()
    assert off[0] == 0 and batch["n_tokens"] == off[-1] == len(batch["hist_item"])
    for b, row in enumerate(idx):
        want = items[row][-max_seq_len:] if items[row] else []  # oldest first: keep the END
        assert batch["hist_item"][off[b] : off[b + 1]].tolist() == want
        assert batch["hist_action"][off[b] : off[b + 1]].tolist() == actions[row][-max_seq_len:]
        np.testing.assert_array_equal(batch["hist_age"][off[b] : off[b + 1]].numpy(),
                                      np.asarray(ages[row][-max_seq_len:], np.float32))
    assert batch["cand_item"].tolist() == [table.column("cand_item")[int(i)].as_py() for i in idx]
    assert batch["label"].tolist() == [float(table.column("label")[int(i)].as_py()) for i in idx]
    assert batch["dense"].shape == (len(idx), n_dense)
    assert batch["dense"][2, 1].item() == pytest.approx(table.column("dense_1")[4].as_py())
    assert batch["offsets"].dtype == torch.int64 and batch["max_seq_len"] == max_seq_len


def test_sampler_order_depends_on_seed_and_epoch_only():
    def epoch(seed, e, skip=0):
        s = EpochBatchSampler(103, 10, shuffle=True, drop_last=True, seed=seed)
        s.set_epoch(e)
        s.skip_next(skip)
        return [b.tolist() for b in s]

    first = epoch(0, 0)
    assert len(first) == 10 and all(b == sorted(b) for b in first)
    assert len({i for b in first for i in b}) == 100
    assert first == epoch(0, 0) and first != epoch(0, 1) and first != epoch(1, 0)
    assert epoch(0, 0, skip=4) == first[4:]
    s = EpochBatchSampler(103, 10, shuffle=False, drop_last=False)
    assert len(s) == 11 and list(s)[-1].tolist() == [100, 101, 102]


def test_datamodule_batches_and_spec(tiny):
    dm = RankerData(str(tiny), batch_size=32, max_seq_len=8, num_workers=0)
    assert dm.spec["vocab_size"] > 0 and 0 < dm.spec["train_ctr"] < 1 and dm.spec["digest"]
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    lengths = batch["offsets"].diff()
    assert batch["label"].shape == (32,) and int(lengths.max()) <= 8
    val = list(dm.val_dataloader())
    assert sum(len(b["label"]) for b in val) == json.loads((tiny / "meta.json").read_text())["splits"]["val"]["rows"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_seq_len=0), "max_seq_len must be > 0"),
        (dict(batch_size=0), "batch_size"),
        (dict(data_dir="/nonexistent/data"), "no data set at .*generate it with .*--preset <tiny|small"),
    ],
)
def test_bad_arguments_say_what_to_fix(tiny, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RankerData(**{"data_dir": str(tiny), **kwargs})


_CONFIG_DATA = {c.name: yaml.safe_load(c.read_text())["data"]["data_dir"]
                for c in sorted((REPO / "experiments" / "configs").glob("*.yaml"))
                if "data_dir" in (yaml.safe_load(c.read_text()).get("data") or {})}


@pytest.mark.parametrize("config", list(_CONFIG_DATA))
def test_the_hint_for_absent_data_names_the_preset_the_config_asks_for(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ here
    data_dir = _CONFIG_DATA[config]
    preset = Path(data_dir).name
    with pytest.raises(ConfigError) as err:
        RankerData(data_dir=data_dir)
    assert f"`make data PRESET={preset}` or `python -m data_gen generate --preset {preset} --out {data_dir}`" \
        in str(err.value)


def test_invalid_data_set_is_refused(tiny, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text(json.dumps({"config": {}}))
    with pytest.raises(ConfigError, match="invalid data set.*data_gen validate"):
        RankerData(str(bad))


def test_loader_bench_with_worker_processes(tiny, capsys):
    loader_bench(["--data", str(tiny), "--batch-size", "64", "--workers", "1", "--batches", "5"])
    out = capsys.readouterr().out
    assert "batches/s" in out and "workers=1" in out


def test_the_category_columns_reach_the_ranker_as_its_catalogue(tiny, tmp_path):
    """Every split's item and category columns give one catalogue (item id -> the category its rows
    show); a fit copies it into the ranker's category embedding before the first step."""
    import pytorch_lightning as pl

    from data_gen.config import config_from_dict
    from data_gen.world import build_world, world_seed
    from models import RankerConfig
    from pipeline.module import RankerModule

    meta = json.loads((tiny / "meta.json").read_text())
    dm = RankerData(str(tiny), batch_size=32, max_seq_len=8, num_workers=0)
    assert dm.spec["n_categories"] == meta["config"]["n_categories"]
    table = dm.item_categories()
    shown = build_world(config_from_dict(meta["config"]), world_seed(meta["seed"])).shown_category
    seen = np.zeros(len(table), bool)
    for split in ("train", "val", "test"):
        t = read_split(tiny, split, ["hist_item", "cand_item"])
        seen[t.column("hist_item").combine_chunks().flatten().to_numpy()] = True
        seen[t.column("cand_item").to_numpy()] = True
    assert np.array_equal(table[seen], shown[seen]) and (table[~seen] == dm.spec["n_categories"]).all()
    module = RankerModule(RankerConfig(embed_dim=32, num_layers=1, mlp_dims=[8]), data_spec=dm.spec)
    assert (module.model.embed.item_category == dm.spec["n_categories"]).all()  # unknown until fit
    pl.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=tmp_path).fit(module, datamodule=dm)
    assert np.array_equal(module.model.embed.item_category.numpy(), table)
