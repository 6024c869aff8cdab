"""A launch table is checked when it is read: an entry a launcher cannot use is refused at load
with the file and the key, never launched (a negative tile would read uninitialised memory)."""

from __future__ import annotations

import json

import pytest

from kernels.launch_table import SCHEMA, LaunchTable

GOOD = {"family": "flash_fwd", "source": "measured",
        "shape": {"B": 8, "N": 64, "L": 32, "H": 2, "D": 64, "dtype": "bfloat16", "causal": 0},
        "config": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}}


def _write(tmp_path, entry) -> str:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schema": SCHEMA, "gpu": "x", "entries": [entry]}))
    return str(path)


def _with(part: str, key: str, value) -> dict:
    e = json.loads(json.dumps(GOOD))
    e[part][key] = value
    return e


def test_a_good_entry_loads(tmp_path):
    assert len(LaunchTable.load(_write(tmp_path, GOOD))) == 1


@pytest.mark.parametrize("part,key,value,message", [
    ("config", "BLOCK_M", -64, "config BLOCK_M must be a positive power of two, got -64"),
    ("config", "BLOCK_N", 0, "config BLOCK_N must be a positive power of two, got 0"),
    ("config", "BLOCK_N", 48, "config BLOCK_N must be a positive power of two, got 48"),
    ("config", "BLOCK_M", "64", "config BLOCK_M must be a positive power of two, got '64'"),
    ("config", "num_warps", 4.0, "config num_warps must be a positive power of two, got 4.0"),
    ("config", "num_stages", 0, "config num_stages must be an int >= 1, got 0"),
    ("config", "SPLIT_DQ", True, "config SPLIT_DQ must be 0 or 1, got True"),
    ("shape", "B", -1, "shape B must be an int >= 0, got -1"),
    ("shape", "dtype", 16, "shape dtype must be a dtype name, got 16"),
    ("source", None, "guessed", "source must be one of measured, predicted, hand"),
])
def test_an_unusable_entry_is_refused_at_load(tmp_path, part, key, value, message):
    entry = dict(GOOD, source=value) if part == "source" else _with(part, key, value)
    path = _write(tmp_path, entry)
    with pytest.raises(ValueError) as err:
        LaunchTable.load(path)
    assert str(err.value).startswith(f"launch table {path}: {message}")


def test_a_table_built_in_memory_is_checked_too():
    with pytest.raises(ValueError, match=r"launch table \(in memory\): config BLOCK_M must be"):
        LaunchTable([_with("config", "BLOCK_M", -16)])
