"""Per-file checks behind `schema.validate_dataset` and `schema.read_split`.

Order matters for the message a user sees: a missing file, then an unreadable footer (a
truncated file), then row count and schema from the footer, then the checksum, then the
content (nulls, alignment, ranges), batch by batch, reporting the first bad row of the file."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .schema import (DataValidationError, columns as schema_columns, is_timeline, sha256_file,
                     split_days)


def read_table(data_dir: Path, split: str, entry: dict[str, Any], meta: dict[str, Any],
               columns: list[str] | None, *, check_digest: bool, deep: bool,
               want_table: bool = True) -> pa.Table | None:
    """Read one shard of `split` listed in meta (entry = {path, rows, sha256}) after checking it.

    deep=False checks only the footer (row count, schema) and, with check_digest, the bytes."""
    rel = entry.get("path", "")
    path = data_dir / rel
    if not path.is_file():
        raise DataValidationError("file is missing", file=path)
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataValidationError(f"unreadable Parquet (truncated or corrupt): {err}",
                                  file=path) from None
    if pf.metadata.num_rows != entry.get("rows"):
        raise DataValidationError(
            f"{pf.metadata.num_rows} rows, meta.json says {entry.get('rows')}", file=path)
    expected = schema_columns(meta["config"]["n_dense"], is_timeline(meta))
    _check_schema(path, pf.schema_arrow, expected)
    if check_digest and sha256_file(path) != entry.get("sha256"):
        raise DataValidationError("sha256 differs from meta.json (file changed since it was "
                                  "generated)", file=path)
    names = [n for n, _, _ in expected]
    if columns is not None:
        unknown = [c for c in columns if c not in names]
        if unknown:
            raise DataValidationError(f"no such column(s) {unknown}", file=path)
    if not (deep or want_table):
        return None
    try:
        table = pf.read(columns=names if deep or columns is None else columns)
    except (pa.ArrowException, OSError) as err:
        raise DataValidationError(f"unreadable Parquet data: {err}", file=path) from None
    if deep:
        row0 = 0
        for batch in table.to_batches():
            _check_batch(path, batch, row0, meta["config"])
            if is_timeline(meta):
                _check_timeline(path, batch, row0, meta["config"], split)
            row0 += batch.num_rows
    return table if columns is None else table.select(columns)


def _check_schema(path: Path, schema: pa.Schema, expected) -> None:
    for name, value_type, is_list in expected:
        idx = schema.get_field_index(name)
        if idx < 0:
            raise DataValidationError("column is missing", file=path, column=name)
        found = schema.field(idx).type
        if is_list:
            ok = (pa.types.is_list(found) or pa.types.is_large_list(found)) \
                and found.value_type == value_type
            want = f"list<{value_type}>"
        else:
            ok, want = found == value_type, str(value_type)
        if not ok:
            raise DataValidationError(f"dtype {found}, expected {want}", file=path, column=name)


def _first_null_row(arr: pa.Array) -> int:
    return int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(offsets rebased to 0: int64 [B + 1], the values of exactly these rows)."""
    off = arr.offsets.to_numpy().astype(np.int64)
    return off - off[0], arr.values.slice(off[0], off[-1] - off[0])


def _row_of_flat(off: np.ndarray) -> Callable[[int], int]:
    """The row of a flat sequence position, for offsets off [B + 1]."""
    return lambda i: int(np.searchsorted(off, i, side="right") - 1)


def _fail_first(path: Path, column: str, bad: np.ndarray, row_of: Callable[[int], int],
                row0: int, problem: str) -> None:
    hits = np.flatnonzero(bad)
    if hits.size:
        raise DataValidationError(problem, file=path, column=column, row=row0 + row_of(hits[0]))


def _check_batch(path: Path, batch: pa.RecordBatch, row0: int, cfg: dict[str, Any]) -> None:
    """Nulls, sequence alignment and value ranges of one record batch (rows row0...)."""
    vocab, n_actions = cfg["vocab_size"], cfg["n_actions"]
    for name in batch.schema.names:
        col = batch.column(name)
        if col.null_count:
            raise DataValidationError("null value", file=path, column=name,
                                      row=row0 + _first_null_row(col))
    seq = {}
    for name in ("hist_item", "hist_action", "hist_age", "hist_category"):
        off, values = _list_parts(batch.column(name))
        if values.null_count:
            flat = _first_null_row(values)
            row = int(np.searchsorted(off, flat, side="right") - 1)
            raise DataValidationError("null inside a sequence", file=path, column=name,
                                      row=row0 + row)
        seq[name] = (off, values.to_numpy(zero_copy_only=False))
    ref = np.diff(seq["hist_item"][0])
    for name in ("hist_action", "hist_age", "hist_category"):
        _fail_first(path, name, np.diff(seq[name][0]) != ref, int, row0,
                    "sequence length differs from hist_item's (misaligned sequences)")
    off = seq["hist_item"][0]
    row_of_flat = _row_of_flat(off)
    item, action, age = (seq[n][1] for n in ("hist_item", "hist_action", "hist_age"))
    _fail_first(path, "hist_item", (item < 0) | (item >= vocab), row_of_flat, row0,
                f"item id outside the vocabulary [0, {vocab})")
    _fail_first(path, "hist_action", (action < 0) | (action >= n_actions), row_of_flat, row0,
                f"action outside [0, {n_actions})")
    _fail_first(path, "hist_age", ~(np.isfinite(age) & (age >= 0)), row_of_flat, row0,
                "age is negative or not finite")
    starts = np.zeros(age.size + 1, dtype=bool)
    starts[off] = True  # a rise in age is only legal where a new row starts
    _fail_first(path, "hist_age", (np.diff(age) > 0) & ~starts[1:-1], row_of_flat, row0,
                "ages increase within a sequence (must be oldest first)")
    _check_scalars(path, batch, row0, cfg)
    _check_categories(path, batch, row0, cfg, item, seq["hist_category"][1], row_of_flat)


def _check_categories(path: Path, batch: pa.RecordBatch, row0: int, cfg: dict[str, Any],
                      item: np.ndarray, cat: np.ndarray, row_of_flat: Callable[[int], int]) -> None:
    """Categories in range, and one category per item id across the batch's rows."""
    n_cat = cfg["n_categories"]
    cand, cand_cat = _column(batch, "cand_item"), _column(batch, "cand_category")
    _fail_first(path, "hist_category", (cat < 0) | (cat >= n_cat), row_of_flat, row0,
                f"category outside [0, {n_cat})")
    _fail_first(path, "cand_category", (cand_cat < 0) | (cand_cat >= n_cat), int, row0,
                f"category outside [0, {n_cat})")
    table = np.full(cfg["vocab_size"], -1, np.int16)
    table[cand] = cand_cat
    table[item] = cat
    _fail_first(path, "hist_category", table[item] != cat, row_of_flat, row0,
                "an item id with two categories")
    _fail_first(path, "cand_category", table[cand] != cand_cat, int, row0,
                "an item id with two categories")


def _column(batch: pa.RecordBatch, name: str) -> np.ndarray:
    return batch.column(name).to_numpy(zero_copy_only=False)


def _check_scalars(path: Path, batch: pa.RecordBatch, row0: int, cfg: dict[str, Any]) -> None:
    col = partial(_column, batch)
    vocab = cfg["vocab_size"]
    cand = col("cand_item")
    _fail_first(path, "cand_item", (cand < 0) | (cand >= vocab), int, row0,
                f"item id outside the vocabulary [0, {vocab})")
    label = col("label")
    _fail_first(path, "label", (label != 0) & (label != 1), int, row0, "label outside {0, 1}")
    p = col("p_true")
    _fail_first(path, "p_true", ~(np.isfinite(p) & (p >= 0) & (p <= 1)), int, row0,
                "p_true outside [0, 1]")
    for i in range(cfg["n_dense"]):
        _fail_first(path, f"dense_{i}", ~np.isfinite(col(f"dense_{i}")), int, row0,
                    "dense feature is not finite")


def _check_timeline(path: Path, batch: pa.RecordBatch, row0: int, cfg: dict[str, Any],
                    split: str) -> None:
    """A timeline row: a known user, an impression on one of its split's days, and a history
    strictly before the impression (every age > 0)."""
    col = partial(_column, batch)
    users = cfg["users"]
    user = col("user_id")
    _fail_first(path, "user_id", (user < 0) | (user >= users), int, row0,
                f"user id outside [0, {users})")
    first, last = split_days(cfg["days"])[split]
    day = col("impression_day")
    _fail_first(path, "impression_day", (day < first) | (day > last), int, row0,
                f"impression day outside the {split} split's days [{first}, {last}]")
    time = col("impression_time")
    _fail_first(path, "impression_time", ~np.isfinite(time) | (np.floor(time) + 1 != day), int,
                row0, "impression time not within its impression_day")
    off, age = _list_parts(batch.column("hist_age"))
    age = age.to_numpy(zero_copy_only=False)
    _fail_first(path, "hist_age", age <= 0, _row_of_flat(off), row0,
                "history item not before the impression (age <= 0)")
