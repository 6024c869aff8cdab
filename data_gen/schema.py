"""The Parquet schema and the one validating reader that every part of the project uses.

Layout of a data set directory:

    meta.json                      written last: no meta.json, no data set
    train/part-00000.parquet ...   one row per example (see columns())
    val/...   test/...

A timeline data set (meta.json config with `users` > 0) has two more columns, the impression's
day (1-based) and time (days since the start of day 1), and its splits are days (split_days).

Sequence columns are Parquet lists (read by pyarrow as `list` or `large_list`), oldest item
first: a model that keeps the last `max_seq_len` items keeps the END of each list.

    from data_gen import read_split
    table = read_split("data/small", "train", columns=["hist_item", "label"])  # pyarrow.Table

`read_split` validates every shard of the split first (checksums, schema, nulls, alignment of
the sequence columns, value ranges) and raises DataValidationError naming the file, the column
and the first bad row.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

SPLITS = ("train", "val", "test")
META_FILE = "meta.json"
META_KEYS = ("generator_version", "seed", "preset", "config", "digest", "splits")
# (column, Arrow value type, is a list column); dense_0..dense_{n-1} follow cand_item.
SEQUENCE_COLUMNS = (("hist_item", pa.int32()), ("hist_action", pa.int8()),
                    ("hist_age", pa.float32()), ("hist_category", pa.int16()))
HEAD_COLUMNS = (("example_id", pa.int64()), ("user_id", pa.int64()))
TAIL_COLUMNS = (("label", pa.int8()), ("p_true", pa.float32()))
TIMELINE_COLUMNS = (("impression_day", pa.int32()), ("impression_time", pa.float64()))
FORMAT_MAJOR = 2  # generator_version's major: data of an older one is refused
DIGEST_METHOD = "sha256 of the newline-joined, sorted list of per-file sha256 hex digests"


class DataValidationError(ValueError):
    """A data set that must not be read. The message names the file, column and first bad row."""

    def __init__(self, problem: str, *, file: str | Path | None = None,
                 column: str | None = None, row: int | None = None):
        self.file = None if file is None else str(file)
        self.column, self.row, self.problem = column, row, problem
        where = [self.file or "<data set>"]
        if column is not None:
            where.append(f"column {column!r}")
        if row is not None:
            where.append(f"row {row}")
        super().__init__(f"{', '.join(where)}: {problem}")


def columns(n_dense: int, timeline: bool = False) -> list[tuple[str, pa.DataType, bool]]:
    """Every column in file order: (name, value type, is_list)."""
    out = [(n, t, False) for n, t in HEAD_COLUMNS + (TIMELINE_COLUMNS if timeline else ())]
    out += [(n, t, True) for n, t in SEQUENCE_COLUMNS]
    out += [("cand_item", pa.int32(), False), ("cand_category", pa.int16(), False)]
    out += [(f"dense_{i}", pa.float32(), False) for i in range(n_dense)]
    out += [(n, t, False) for n, t in TAIL_COLUMNS]
    return out


def is_timeline(meta: dict[str, Any]) -> bool:
    """Whether meta.json describes a timeline data set (see data_gen/timeline.py)."""
    return bool(meta["config"].get("users"))


def split_days(days: int) -> dict[str, tuple[int, int]]:
    """The first and last day (1-based, inclusive) of each split of a `days`-day timeline."""
    return {"train": (1, days - 2), "val": (days - 1, days - 1), "test": (days, days)}


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def dataset_digest(file_shas: list[str]) -> str:
    """The data digest the pipeline logs: see DIGEST_METHOD."""
    return hashlib.sha256("\n".join(sorted(file_shas)).encode()).hexdigest()


def load_meta(data_dir: str | Path) -> dict[str, Any]:
    """meta.json of a data set, checked for the keys readers rely on."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise DataValidationError(
            "meta.json is missing: not a data set, or its generation did not finish "
            "(run `python -m data_gen generate ...`)", file=path)
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataValidationError(f"unreadable meta.json: {err}", file=path) from None
    if not isinstance(meta, dict):
        raise DataValidationError("meta.json is not a JSON object", file=path)
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise DataValidationError(f"meta.json lacks {', '.join(missing)}", file=path)
    major = str(meta["generator_version"]).split(".")[0]
    if not major.isdigit() or int(major) < FORMAT_MAJOR:
        raise DataValidationError(
            f"generated by data_gen {meta['generator_version']}, without item categories and "
            f"motifs: generate it again (`python -m data_gen generate --preset {meta['preset']} "
            f"--out {Path(data_dir)} --overwrite`)", file=path)
    timeline_keys = ("users", "days") if is_timeline(meta) else ()
    for key in ("vocab_size", "n_actions", "n_dense", "n_categories") + timeline_keys:
        if not isinstance(meta["config"].get(key), int):
            raise DataValidationError(f"meta.json config lacks an integer {key!r}", file=path)
    for split in SPLITS:
        entry = meta["splits"].get(split)
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), list):
            raise DataValidationError(f"meta.json has no file list for split {split!r}", file=path)
    return meta


def _check_digest(data_dir: Path, meta: dict[str, Any]) -> None:
    shas = [f.get("sha256", "") for s in SPLITS for f in meta["splits"][s]["files"]]
    if dataset_digest(shas) != meta["digest"]:
        raise DataValidationError(
            f"digest mismatch: meta.json says {meta['digest']}, its file list gives "
            f"{dataset_digest(shas)}", file=data_dir / META_FILE)


def validate_dataset(data_dir: str | Path, *, check_digest: bool = True, deep: bool = True,
                     progress: bool = False) -> dict[str, Any]:
    """Check every shard of every split; return meta.

    check_digest: recompute each file's sha256 and the data digest and compare with meta.json.
    deep: read every shard and check schema, nulls, alignment and value ranges (else only the
    footer: schema and row count). progress: a progress bar over the files.
    Raises DataValidationError on the first problem.
    """
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    for split in SPLITS:  # read_split refuses these: so must the validation
        if not meta["splits"][split]["files"]:
            raise DataValidationError(f"split {split!r} has no files", file=data_dir / META_FILE)
    if check_digest:
        _check_digest(data_dir, meta)
    entries = [(split, e) for split in SPLITS for e in meta["splits"][split]["files"]]
    if progress:
        from tqdm.auto import tqdm

        entries = tqdm(entries, desc=f"validate {data_dir}", unit="file")
    for split, entry in entries:
        _validate_file(data_dir, split, entry, meta, check_digest=check_digest, deep=deep)
    return meta


def read_split(data_dir: str | Path, split: str, columns: list[str] | None = None, *,
               validate: bool = True) -> pa.Table:
    """All shards of one split as one pyarrow Table (chunks are the files' record batches).

    Sequence columns come back as list or large_list arrays of int32 / int8 / float32 values;
    take `.offsets` and `.values` per chunk for the jagged layout. With validate=True (the
    default) every shard of the split is checked as in validate_dataset before it is returned.
    """
    from ._checks import read_table  # local: keeps `import data_gen` light for meta-only use

    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    if split not in SPLITS:
        raise DataValidationError(f"unknown split {split!r}; one of {', '.join(SPLITS)}",
                                  file=data_dir)
    if validate:
        _check_digest(data_dir, meta)
    tables = []
    for entry in meta["splits"][split]["files"]:
        tables.append(read_table(data_dir, split, entry, meta, columns,
                                 check_digest=validate, deep=validate))
    if not tables:
        raise DataValidationError(f"split {split!r} has no files", file=data_dir / META_FILE)
    return pa.concat_tables(tables)


def _validate_file(data_dir: Path, split: str, entry: dict[str, Any], meta: dict[str, Any], *,
                   check_digest: bool, deep: bool) -> None:
    from ._checks import read_table

    read_table(data_dir, split, entry, meta, None, check_digest=check_digest, deep=deep,
               want_table=False)
