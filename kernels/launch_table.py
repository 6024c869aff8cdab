"""Launch-configuration tables: measured picks of tiles, warps and stages per GPU and shape.

A table is ``kernels/configs/<gpu-slug>.json`` (:func:`device_slug`), written by ``python -m
experiments costmodel export``: one entry per (kernel family, shape). :meth:`LaunchTable.lookup`
returns the exact entry, else the nearest of its family (log2 shape features), else None;
:func:`table_path` says which file is read (``$JFA_LAUNCH_TABLE``: off, or a path; unset: the CUDA
device's). Format and matching: docs/kernels.md#launch-tables."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch


SCHEMA = "jfa-launch-table/1"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ENV = "JFA_LAUNCH_TABLE"
OFF = ("off", "0", "none", "false")
LOG_FEATURES = ("B", "N", "L", "H", "Tq")  # compared in log2 space; all others must be equal

def device_slug(name: str | None = None) -> str:
    """A GPU's name as a file-name part: 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; a name
    starting with 'CPU', or no name and no CUDA device -> 'cpu'."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if name.lower().startswith("cpu"):
        return "cpu"
    s = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


POWER_OF_TWO = ("M_KV", "N_KV", "SMALL_N", "STREAM_N", "num_warps")  # and every BLOCK_*
AT_LEAST_ONE = ("num_stages", "T_SPLITS")
FLAGS = ("SPLIT_DQ",)
SOURCES = ("measured", "predicted", "hand")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def entry_problem(e) -> str | None:
    """What makes `e` unusable as a table entry (a launcher would fail or read garbage), or None."""
    if not (isinstance(e, dict) and {"family", "shape", "config"} <= e.keys()):
        return "an entry lacks family, shape or config"
    if not isinstance(e["family"], str) or not isinstance(e["shape"], dict) or not isinstance(e["config"], dict):
        return "family must be a string, shape and config objects"
    if e.get("source", "measured") not in SOURCES:
        return f"source must be one of {', '.join(SOURCES)}"
    for k, v in e["shape"].items():
        if not (isinstance(v, str) if k == "dtype" else _int(v) and v >= 0):
            return f"shape {k} must be {'a dtype name' if k == 'dtype' else 'an int >= 0'}, got {v!r}"
    for k, v in e["config"].items():
        if k.startswith("BLOCK_") or k in POWER_OF_TWO:
            ok, want = _int(v) and v > 0 and v & (v - 1) == 0, "a positive power of two"
        elif k in AT_LEAST_ONE:
            ok, want = _int(v) and v >= 1, "an int >= 1"
        elif k in FLAGS:
            ok, want = _int(v) and v in (0, 1), "0 or 1"
        else:
            ok, want = _int(v) and v >= 0, "an int >= 0"
        if not ok:
            return f"config {k} must be {want}, got {v!r}"
    return None


def shape_key(family: str, shape: dict) -> str:
    """Canonical string of one (family, shape): 'flash_fwd|B=1024|D=64|...' (keys sorted)."""
    return family + "|" + "|".join(f"{k}={shape[k]}" for k in sorted(shape))


def _log2(x: float) -> float:
    return math.log2(max(float(x), 1.0))


class LaunchTable:
    """Entries of one table file, indexed by family; lookups are pure functions of the entries."""

    def __init__(self, entries: list[dict], meta: dict | None = None, path: str | None = None):
        self.meta, self.path = meta or {}, path
        self.exact: dict[str, dict] = {}
        self.by_family: dict[str, list[dict]] = {}
        for e in entries:
            problem = entry_problem(e)
            if problem:
                raise ValueError(f"launch table {path or '(in memory)'}: {problem}: {e!r:.160}")
            self.exact[shape_key(e["family"], e["shape"])] = e
            self.by_family.setdefault(e["family"], []).append(e)

    def __len__(self) -> int:
        return len(self.exact)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LaunchTable":
        """Read a table file; ValueError (one line) when it is not a table of this schema."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"launch table {path}: {exc}") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("entries"), list):
            raise ValueError(f"launch table {path}: not a {SCHEMA} document")
        meta = {k: v for k, v in doc.items() if k != "entries"}
        return cls(doc["entries"], meta, str(path))

    def lookup(self, family: str, shape: dict) -> dict | None:
        """The entry (dict with 'config') for `shape`: exact, else nearest in log2 space among
        the family's entries with the same exact features and the same feature names, else None."""
        hit = self.exact.get(shape_key(family, shape))
        if hit is not None:
            return hit
        best, best_d = None, math.inf
        for e in self.by_family.get(family, ()):
            s = e["shape"]
            if s.keys() != shape.keys():
                continue
            if any(s[k] != shape[k] for k in shape if k not in LOG_FEATURES):
                continue
            d = sum((_log2(s[k]) - _log2(shape[k])) ** 2 for k in shape if k in LOG_FEATURES)
            if d < best_d:
                best, best_d = e, d
        return best


def table_path(gpu_name: str | None) -> Path | None:
    """The table to read: $JFA_LAUNCH_TABLE (a path, or 'off'), else configs/<device_slug(gpu)>.json
    when `gpu_name` names a GPU; None when disabled, on a CPU, or when the file is absent."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() in OFF:
        return None
    if env:
        return Path(env)
    if not gpu_name or device_slug(gpu_name) == "cpu":
        return None
    path = CONFIG_DIR / f"{device_slug(gpu_name)}.json"
    return path if path.is_file() else None


def describe(table: "LaunchTable | None") -> str:
    """One line for result stamps: 'none (hand rules)', or the table's file, entries and source."""
    if table is None:
        return "none (hand rules)"
    src = ", ".join(f"{k} {table.meta[k]}" for k in ("gpu", "commit") if table.meta.get(k))
    return f"{Path(table.path).name if table.path else 'in memory'}: {len(table)} entries" + (f" ({src})" if src else "")


def write_table(path: str | os.PathLike, entries: list[dict], meta: dict) -> Path:
    """Write entries (sorted by key, so diffs stay readable) with `meta` as a table file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = sorted(entries, key=lambda e: shape_key(e["family"], e["shape"]))
    head = json.dumps({"schema": SCHEMA, **meta}, indent=1)[:-2]  # one entry per line below
    body = ",\n".join("  " + json.dumps(e, sort_keys=True) for e in entries)
    path.write_text(f'{head},\n "entries": [\n{body}\n ]\n}}\n')
    return path
