"""Splits decoded once, memory-mapped after: the cache behind ``load_split``.

Decoded splits are cached (``cache=True``, the default): after the first, fully validated read
of a split its flat arrays are saved as .npy files under
``<data_dir>/.cache/<digest[:16]>/<split>/`` (a temp dir renamed into place, a marker file
written last), and later processes memory-map them instead of decoding the Parquet shards. A
cache is used only for the digest meta.json names now, only while every shard of the split
has the size and mtime recorded in the marker and meta.json has the sha256 recorded there
(the validation of the values depends on its vocabulary sizes), and only while every array
has the sha256 written with it; otherwise the split is read and checked in full again and the
cache rebuilt. Checking the arrays reads them once per process: a fraction of a decode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from data_gen.schema import META_FILE, dataset_digest, is_timeline, load_meta, read_split, sha256_file
from pipeline.batches import CATEGORY_COLUMNS, HIST_COLUMNS, JaggedSplit

SPLITS = ("train", "val", "test")
CACHE_DIR = ".cache"  # under the data directory
CACHE_VERSION = 4  # bump when JaggedSplit's arrays or the marker change meaning
CACHE_MARKER = "complete.json"  # written last: a split directory without it is never read
log = logging.getLogger(__name__)


def _columns(n_dense: int, timeline: bool) -> list[str]:
    return [*HIST_COLUMNS, *CATEGORY_COLUMNS, "cand_item", *(f"dense_{i}" for i in range(n_dense)), "label", "user_id",
            *(["impression_day"] if timeline else [])]


def load_split(data_dir: str | Path, split: str, n_dense: int, *, cache: bool = True) -> JaggedSplit:
    """One split as a JaggedSplit: from a valid cache, else a full validated read (then cached)."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    columns = _columns(n_dense, is_timeline(meta))
    if not cache:
        return JaggedSplit(read_split(data_dir, split, columns=columns), n_dense)
    entries = meta["splits"][split]["files"] if split in meta["splits"] else []
    digest = str(meta["digest"])
    usable = bool(re.fullmatch(r"[0-9a-f]{16,}", digest)) and bool(entries)
    if usable:
        cached = _read_cache(data_dir, split, n_dense, meta)
        if cached is not None:
            return cached
    before = _shard_stats(data_dir, entries)
    data = JaggedSplit(read_split(data_dir, split, columns=columns), n_dense)  # hashes every shard
    if usable and before is not None and _shard_stats(data_dir, entries) == before:  # unchanged while read
        arrays = data.arrays()
        marker = {"version": CACHE_VERSION, "digest": digest, "split": split, "n_dense": n_dense,
                  "files": before, "meta_sha256": sha256_file(data_dir / META_FILE),
                  "arrays": {k: [list(a.shape), a.dtype.str, _sha256(a)] for k, a in arrays.items()}}
        try:
            _write_cache(data_dir, split, data, marker)
        except OSError as err:  # a read-only data directory, a full disk: train uncached
            warnings.warn(f"could not cache the {split} split under {data_dir / CACHE_DIR}: {err}", stacklevel=2)
    return data


def _split_cache(data_dir: Path, digest: str, split: str) -> Path:
    return data_dir / CACHE_DIR / digest[:16] / split


def _shard_stats(data_dir: Path, entries: list[dict]) -> list[dict] | None:
    """[{path, sha256, rows, size, mtime_ns}] of the split's shards; None if one is missing."""
    out = []
    for e in entries:
        try:
            st = os.stat(data_dir / str(e.get("path", "")))
        except OSError:
            return None
        out.append({"path": e.get("path"), "sha256": e.get("sha256"), "rows": e.get("rows"),
                    "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).data).hexdigest()


def _read_cache(data_dir: Path, split: str, n_dense: int, meta: dict) -> JaggedSplit | None:
    """The cached split if complete, current (digest, shard sizes and mtimes, meta.json) and
    intact (every array's sha256), else None."""
    digest = meta["digest"]
    shas = [f.get("sha256", "") for s in SPLITS for f in meta["splits"][s]["files"]]
    if dataset_digest(shas) != digest:
        return None  # meta.json contradicts itself: the full read reports it
    path = _split_cache(data_dir, digest, split)
    try:
        marker = json.loads((path / CACHE_MARKER).read_text())
        if (marker.get("version") != CACHE_VERSION or marker.get("digest") != digest
                or marker.get("split") != split or marker.get("n_dense") != n_dense
                or marker.get("files") != _shard_stats(data_dir, meta["splits"][split]["files"])
                or marker.get("meta_sha256") != sha256_file(data_dir / META_FILE)
                or set(marker.get("arrays", {})) != set(JaggedSplit.ARRAYS)):
            return None
        arrays = {}
        for name, (shape, dtype, sha) in marker["arrays"].items():
            arr = np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            if list(arr.shape) != shape or arr.dtype.str != dtype or _sha256(arr) != sha:
                log.warning("the cache %s differs from its checksums (%s.npy): reading the split again", path, name)
                return None
            arrays[name] = np.asarray(arr)  # a plain ndarray over the mapping
        data = JaggedSplit.from_arrays(arrays)
    except FileNotFoundError:
        return None  # no cache (yet)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        log.warning("ignoring the unreadable cache %s: %s", path, err)
        return None
    log.info("%s split: memory-mapped from the cache %s", split, path)
    return data


def _write_cache(data_dir: Path, split: str, data: JaggedSplit, marker: dict) -> None:
    """Save the split's arrays, marker last, in a temp dir renamed into place; drop stale caches."""
    root = data_dir / CACHE_DIR
    final = _split_cache(data_dir, marker["digest"], split)
    final.parent.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():  # caches of earlier contents of this directory (another digest)
        if old != final.parent and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    for old in final.parent.glob(".tmp-*"):  # left by killed processes (an hour is long enough)
        if time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{split}-", dir=final.parent))
    try:
        for name, arr in data.arrays().items():
            _write_synced(tmp / f"{name}.npy", lambda f, a=arr: np.save(f, a, allow_pickle=False))
        _write_synced(tmp / CACHE_MARKER, lambda f: f.write(json.dumps(marker, indent=1).encode()))
        if final.exists():  # incomplete or stale: move it aside (a rename) before ours goes in
            aside = Path(tempfile.mkdtemp(prefix=f".tmp-{split}-old-", dir=final.parent))
            os.replace(final, aside / split)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / CACHE_MARKER).is_file():  # else another process was faster: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_synced(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
