"""Bad input: every reader (through data_gen.read_split / validate_dataset) and the CLI reject
broken data sets with a message naming the file, column and first bad row; bad arguments
fail before any work; an interrupted generate leaves nothing that validates."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from data_gen import DataValidationError, read_split, validate_dataset
from data_gen import generate as gen
from data_gen.__main__ import main
from data_gen.config import resolve_config
from data_gen.schema import dataset_digest, sha256_file
from test_data_gen import tiny_data  # noqa: F401  (the shared session fixture)

SHARD = "train/part-00001.parquet"  # 1024 rows in two row groups of 512
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def data(tiny_data, tmp_path):  # noqa: F811
    """A private copy of the tiny data set, free to break."""
    dst = tmp_path / "data"
    shutil.copytree(tiny_data[0], dst)
    return dst


def _bad_row(path: Path, min_len: int = 2) -> int:
    """A row in the shard's second row group with a history of at least min_len items."""
    lengths = pc.list_value_length(pq.read_table(path / SHARD, columns=["hist_item"])
                                   .column(0)).to_numpy()
    return int(np.flatnonzero((np.arange(lengths.size) > 600) & (lengths >= min_len))[0])


def _rewrite(path: Path, change, resign: bool = True, shard: str = SHARD) -> None:
    """Rewrite `shard` as change(table) and, unless resign=False, update meta.json's sha256 and
    digest, as if the generator had written the bad data (so the content check must catch
    it, not the checksum)."""
    table = change(pq.read_table(path / shard))
    pq.write_table(table, path / shard, row_group_size=512)
    if resign:
        meta = json.loads((path / "meta.json").read_text())
        for split in meta["splits"].values():
            for f in split["files"]:
                if f["path"] == shard:
                    f["sha256"] = sha256_file(path / shard)
        meta["digest"] = dataset_digest([f["sha256"] for s in meta["splits"].values()
                                         for f in s["files"]])
        (path / "meta.json").write_text(json.dumps(meta))


def _set_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, array)


def _edit_scalar(name: str, row: int, value, dtype=None):
    def change(t: pa.Table) -> pa.Table:
        vals = t.column(name).to_pylist()
        vals[row] = value
        return _set_column(t, name, pa.array(vals, type=dtype or t.schema.field(name).type))
    return change


def _edit_list(name: str, row: int, fn):
    def change(t: pa.Table) -> pa.Table:
        vals = t.column(name).to_pylist()
        vals[row] = fn(vals[row])
        return _set_column(t, name, pa.array(vals, type=t.schema.field(name).type))
    return change


def _expect(path: Path, column: str | None, row: int | None, words: str,
            file: str = SHARD, **kwargs) -> DataValidationError:
    with pytest.raises(DataValidationError) as info:
        validate_dataset(path, **kwargs)
    err = info.value
    assert err.file is not None and err.file.endswith(file), str(err)
    assert err.column == column and err.row == row, str(err)
    assert words in str(err) and file in str(err)
    if column is not None:
        assert repr(column) in str(err)
    if row is not None:
        assert f"row {row}" in str(err)
    return err


def test_the_copy_is_valid(data):
    assert validate_dataset(data)["preset"] == "tiny"


def test_missing_file(data):
    (data / "val/part-00000.parquet").unlink()
    _expect(data, None, None, "missing", file="val/part-00000.parquet")


def test_truncated_file(data):
    raw = (data / SHARD).read_bytes()
    (data / SHARD).write_bytes(raw[: len(raw) // 2])
    _expect(data, None, None, "truncated")
    with pytest.raises(DataValidationError, match="truncated"):
        read_split(data, "train")


def test_missing_column(data):
    _rewrite(data, lambda t: t.drop_columns(["label"]))
    _expect(data, "label", None, "missing")


@pytest.mark.parametrize("name,dtype", [("cand_item", pa.int64()),
                                        ("hist_item", pa.list_(pa.int64())),
                                        ("p_true", pa.float64())])
def test_wrong_dtype(data, name, dtype):
    _rewrite(data, lambda t: _set_column(t, name, t.column(name).cast(dtype)))
    _expect(data, name, None, "dtype")


def test_misaligned_sequences(data):
    row = _bad_row(data)
    _rewrite(data, _edit_list("hist_action", row, lambda v: v + [0]))
    _expect(data, "hist_action", row, "misaligned")


@pytest.mark.parametrize("value", [20_000, -1])
def test_item_outside_the_vocabulary(data, value):
    row = _bad_row(data)
    _rewrite(data, _edit_list("hist_item", row, lambda v: v[:-1] + [value]))
    _expect(data, "hist_item", row, "vocabulary")


def test_candidate_outside_the_vocabulary(data):
    row = _bad_row(data, 0)
    _rewrite(data, _edit_scalar("cand_item", row, 20_000))
    _expect(data, "cand_item", row, "vocabulary")


def test_label_outside_0_1(data):
    row = _bad_row(data, 0)
    _rewrite(data, _edit_scalar("label", row, 2))
    _expect(data, "label", row, "label outside {0, 1}")
    with pytest.raises(DataValidationError, match="label outside"):
        read_split(data, "train", columns=["hist_item"])
    assert read_split(data, "train", validate=False).num_rows > 0  # reading raw still works


def test_action_outside_range_and_increasing_ages(data):
    row = _bad_row(data)
    _rewrite(data, _edit_list("hist_action", row, lambda v: [9] + v[1:]))
    _expect(data, "hist_action", row, "action outside")
    _rewrite(data, _edit_list("hist_action", row, lambda v: [0] + v[1:]))
    _rewrite(data, _edit_list("hist_age", row, lambda v: v[::-1] if v[0] > v[-1] else v))
    _expect(data, "hist_age", row, "oldest first")


@pytest.mark.parametrize("name", ["p_true", "user_id", "hist_item"])
def test_nulls(data, name):
    row = _bad_row(data)
    if name == "hist_item":
        _rewrite(data, _edit_list(name, row, lambda v: v[:-1] + [None]))
        words = "null inside a sequence"
    else:
        _rewrite(data, _edit_scalar(name, row, None))
        words = "null value"
    _expect(data, name, row, words)


def test_changed_file_and_digest_mismatch(data):
    row = _bad_row(data, 0)
    _rewrite(data, _edit_scalar("label", row, 1 - int(pq.read_table(
        data / SHARD, columns=["label"]).column(0)[row].as_py())), resign=False)
    _expect(data, None, None, "sha256 differs")
    assert validate_dataset(data, check_digest=False)  # the values themselves are legal

    fresh = data.parent / "fresh"
    shutil.copytree(data, fresh)
    meta = json.loads((fresh / "meta.json").read_text())
    meta["digest"] = "0" * 64
    (fresh / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataValidationError, match="digest mismatch") as info:
        validate_dataset(fresh)
    assert info.value.file.endswith("meta.json")


def test_missing_or_broken_meta(data):
    (data / "meta.json").write_text("{not json")
    with pytest.raises(DataValidationError, match="unreadable meta.json"):
        read_split(data, "train")
    (data / "meta.json").unlink()
    with pytest.raises(DataValidationError, match="meta.json is missing"):
        validate_dataset(data)


def test_a_split_without_files_is_invalid(data, capsys):
    """What read_split (and so training) refuses, the validation refuses too."""
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["val"]["files"] = []
    meta["digest"] = dataset_digest([f["sha256"] for s in meta["splits"].values() for f in s["files"]])
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataValidationError, match="split 'val' has no files"):
        read_split(data, "val")
    assert main(["validate", str(data), "--quiet"]) == 1
    assert "split 'val' has no files" in capsys.readouterr().err


def test_cli_exit_codes(data, tmp_path, capsys):
    assert main(["validate", str(data)]) == 0
    row = _bad_row(data, 0)
    _rewrite(data, _edit_scalar("label", row, 7))
    assert main(["validate", str(data)]) == 1
    err = capsys.readouterr().err
    assert SHARD in err and "'label'" in err and f"row {row}" in err
    for args in (["--preset", "huge"], ["--rows", "-5"], ["--alpha", "0"], ["--alpha=-1"],
                 ["--rows"], ["--no-such-key", "1"], ["--seed", "-1"], ["--workers", "0"]):
        out = tmp_path / "never"
        assert main(["generate", "--out", str(out), *args]) == 2, args
        assert not out.exists(), args  # failed before any work
        assert "error:" in capsys.readouterr().err


def test_cli_in_a_subprocess(data):
    run = [sys.executable, "-m", "data_gen", "validate", str(data)]
    ok = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    (data / "val/part-00000.parquet").unlink()
    bad = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "val/part-00000.parquet" in bad.stderr


def test_generate_refuses_to_clobber(tiny_data, tmp_path):  # noqa: F811
    with pytest.raises(FileExistsError):
        gen.generate_dataset(resolve_config("tiny"), 0, tiny_data[0], workers=1, progress=False)
    assert validate_dataset(tiny_data[0])


def test_interrupted_generate_leaves_nothing_valid(monkeypatch, tmp_path):
    out = tmp_path / "cut"
    real, calls = gen.write_shard, []

    def dying_write(cols, cfg, path):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if Ctrl-C arrived while writing the third shard
        return real(cols, cfg, path)

    monkeypatch.setattr(gen, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        gen.generate_dataset(resolve_config("tiny"), 0, out, workers=1, progress=False)
    assert len(list(out.glob("train/part-*.parquet"))) == 2  # finished shards stay ...
    assert not (out / "meta.json").exists()  # ... but no meta.json: no reader accepts them
    assert not list(out.rglob(".*tmp*"))
    with pytest.raises(DataValidationError, match="meta.json is missing"):
        validate_dataset(out)
    with pytest.raises(DataValidationError):
        read_split(out, "train")


def test_killed_generate_leaves_nothing_valid(tmp_path):
    """SIGKILL (no clean-up possible) while shards are being written."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "data_gen", "generate", "--preset", "tiny", "--rows", "40000",
           "--workers", "1", "--quiet", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not list(out.glob("train/part-*.parquet")) and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert list(out.glob("train/part-*.parquet")) and not (out / "meta.json").exists()
    assert main(["validate", str(out)]) == 1
    # a rerun into the same directory needs --overwrite, then gives a valid data set
    assert main(["generate", "--preset", "tiny", "--workers", "1", "--quiet", "--out",
                 str(out), "--overwrite"]) == 0
    assert validate_dataset(out)["config"]["rows"] == 6000
    assert not list(out.rglob(".*tmp*"))


def test_generate_refuses_an_output_it_cannot_hold(tmp_path, capsys):
    out = tmp_path / "huge"
    assert main(["generate", "--preset", "tiny", "--rows", "1e12", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "1,000,000,000,000 rows" in err
    assert " GB" in err and " h " in err and not out.exists()


def _fail_writes(monkeypatch, error, after: int = 0):
    """Let `after` shards be written, then raise `error` for the next."""
    written, real = [], gen.write_shard

    def write(cols, cfg, path):
        if len(written) >= after:
            raise error(path)
        written.append(path)
        return real(cols, cfg, path)
    monkeypatch.setattr(gen, "write_shard", write)
    return written


@pytest.mark.parametrize("code", ["EROFS", "ENOSPC"])
def test_generate_onto_a_read_only_or_full_disk_fails_in_one_line(tmp_path, monkeypatch, capsys,
                                                                 code):
    import errno

    written = _fail_writes(monkeypatch, lambda path: OSError(
        getattr(errno, code), os.strerror(getattr(errno, code)), str(path)), after=2)
    out = tmp_path / "d"
    assert main(["generate", "--preset", "tiny", "--workers", "1", "--quiet", "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and os.strerror(getattr(errno, code)) in err
    assert len(written) == 2  # two shards were complete when the third failed
    assert not (out / "meta.json").exists() and not list(out.rglob(".part-*"))  # no half shard
    assert sorted(out.rglob("*.parquet")) == sorted(written)  # only the complete ones
    with pytest.raises(DataValidationError, match="meta.json"):
        validate_dataset(out)  # which no reader accepts
