"""The on-disk cache of decoded splits: same batches, invalidation, partial caches, switch."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from data_gen.schema import DataValidationError
from pipeline import split_cache as data_mod
from pipeline.cli import main as cli_main
from pipeline.data import RankerData
from pipeline.split_cache import CACHE_DIR, CACHE_MARKER
from test_pipeline_data import tiny_data_dir

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "experiments" / "configs"


@pytest.fixture
def data(tmp_path_factory, tmp_path) -> Path:
    """A private copy of the tiny data set (tests change its shards and its cache)."""
    out = tmp_path / "tiny"
    shutil.copytree(tiny_data_dir(tmp_path_factory), out, ignore=shutil.ignore_patterns(CACHE_DIR))
    return out


def cache_dir(d: Path, split: str) -> Path:
    digest = json.loads((d / "meta.json").read_text())["digest"]
    return d / CACHE_DIR / digest[:16] / split


def batches(d: Path, cache: bool, split: str = "train") -> list[dict]:
    dm = RankerData(str(d), batch_size=64, max_seq_len=8, num_workers=0, cache=cache)
    dm.setup("fit")
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    return list(loader)


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def count_full_reads(monkeypatch) -> list[str]:
    reads = []
    real = data_mod.read_split

    def spy(data_dir, split, *args, **kwargs):
        reads.append(split)
        return real(data_dir, split, *args, **kwargs)

    monkeypatch.setattr(data_mod, "read_split", spy)
    return reads


def test_cached_batches_equal_uncached(data, monkeypatch):
    reads = count_full_reads(monkeypatch)
    plain = batches(data, cache=False), batches(data, cache=False, split="val")
    assert not (data / CACHE_DIR).exists()  # cache=False writes nothing
    first = batches(data, cache=True), batches(data, cache=True, split="val")  # reads, writes the cache
    assert (cache_dir(data, "train") / CACHE_MARKER).is_file() and (cache_dir(data, "val") / CACHE_MARKER).is_file()
    n = len(reads)
    dm = RankerData(str(data), num_workers=0)
    dm.setup("fit")
    assert len(reads) == n  # served from the cache: no Parquet read
    assert not dm._splits["train"].item.flags.writeable  # memory-mapped read-only
    warm = batches(data, cache=True), batches(data, cache=True, split="val")
    assert len(reads) == n
    for a, b, c in zip(plain, first, warm):
        assert_same(a, b)
        assert_same(a, c)
    assert not [p for p in cache_dir(data, "train").parent.iterdir() if p.name.startswith(".tmp-")]


def test_changed_shard_invalidates_the_cache(data, monkeypatch):
    batches(data, cache=True)
    reads = count_full_reads(monkeypatch)
    shard = data / "val" / "part-00000.parquet"
    marker = cache_dir(data, "val") / CACHE_MARKER
    old_marker = marker.read_text()
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, new mtime
    ref = batches(data, cache=False, split="val")
    reads.clear()
    assert_same(batches(data, cache=True, split="val"), ref)
    assert reads == ["val"]  # the full, hashing read ran again (train still came from its cache)
    assert marker.read_text() != old_marker  # ... and rebuilt the cache with the new mtime
    reads.clear()
    assert_same(batches(data, cache=True, split="val"), ref)
    assert reads == []

    raw = bytearray(shard.read_bytes())  # modified bytes: the full read's checksum refuses it
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataValidationError, match="sha256 differs"):
        batches(data, cache=True, split="val")


def test_cache_of_another_digest_is_not_used(data, monkeypatch):
    batches(data, cache=True)
    meta_path = data / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["digest"] = "0" * 64  # meta.json now names other contents (and contradicts its file list)
    meta_path.write_text(json.dumps(meta))
    reads = count_full_reads(monkeypatch)
    with pytest.raises(DataValidationError, match="digest mismatch"):
        batches(data, cache=True)
    assert reads == ["train"]


def test_partial_cache_without_marker_is_ignored(data, monkeypatch):
    ref = batches(data, cache=False)
    batches(data, cache=True)
    split_dir = cache_dir(data, "train")
    (split_dir / CACHE_MARKER).unlink()  # as if the marker never got written
    np.save(split_dir / "item.npy", np.zeros(3, np.int32))  # and an array is garbage
    reads = count_full_reads(monkeypatch)
    assert_same(batches(data, cache=True), ref)
    assert "train" in reads
    assert (split_dir / CACHE_MARKER).is_file()  # rebuilt in place
    reads.clear()
    assert_same(batches(data, cache=True), ref)
    assert reads == []


def test_killed_writer_leaves_nothing_that_is_read(data, monkeypatch):
    def killed(path, write):  # the process dies while writing the arrays
        raise KeyboardInterrupt

    monkeypatch.setattr(data_mod, "_write_synced", killed)
    with pytest.raises(KeyboardInterrupt):
        batches(data, cache=True)
    assert not cache_dir(data, "train").exists()
    monkeypatch.undo()
    reads = count_full_reads(monkeypatch)
    batches(data, cache=True)
    assert reads[0] == "train"


def test_cache_false_on_the_command_line(data, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["pipeline"])  # main(args) runs as if from the command line
    args = ["fit", "--config", str(CONFIGS / "base.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
            "--data.data_dir", str(data), "--print_config"]
    with pytest.raises(SystemExit) as exc:
        cli_main([*args, "--data.cache", "false"])
    assert exc.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["data"]["cache"] is False
    with pytest.raises(SystemExit):
        cli_main(args)
    assert yaml.safe_load(capsys.readouterr().out)["data"]["cache"] is True


def test_changed_cached_arrays_are_not_used(data, monkeypatch):
    """The cache is checked against the sha256 written with it: edited labels are never trained on."""
    ref = batches(data, cache=False)
    batches(data, cache=True)
    label = cache_dir(data, "train") / "label.npy"
    flipped = 1.0 - np.load(label)  # same shape and dtype, other values
    np.save(label, flipped)
    reads = count_full_reads(monkeypatch)
    assert_same(batches(data, cache=True), ref)
    assert reads == ["train"]  # read again, and the cache rebuilt
    assert not np.array_equal(np.load(label), flipped)


def test_meta_json_edit_with_a_cache_gives_the_validators_message(data):
    batches(data, cache=True)
    meta_path = data / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["vocab_size"] = 100  # the cached item ids now lie outside the vocabulary
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataValidationError, match=r"item id outside the vocabulary \[0, 100\)"):
        batches(data, cache=True)
