"""User embeddings as ranker features: the file, its checks, and the as-of join.

The file (``python -m pipeline.user_embeddings export``) is a Parquet table ``user_id, as_of_day,
history_time, embedding[dim]`` with a manifest ``<file>.json``; :func:`read_embeddings` checks it
(sha256, data digest, dim, no row read from logs at or after its as-of day, no repeated user-day)
and :func:`join_as_of` gives each impression on day t its user's newest embedding with
``as_of_day <= t - lag``. Format and rules: docs/training.md#the-user-encoder.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from data_gen.schema import sha256_file
from pipeline.errors import ConfigError

FORMAT_VERSION = 1
MANIFEST_KEYS = ("format", "sha256", "data_digest", "dim", "rows", "definition")
DEFINITION = ("embedding of user_id as of as_of_day: computed from the user's logs before day "
              "as_of_day starts (history_time, the newest log read, < as_of_day - 1 in days since "
              "the start of day 1)")


def manifest_path(path: str | Path) -> Path:
    return Path(f"{path}.json")


@dataclass(frozen=True)
class UserEmbeddings:
    """A validated embedding file: rows [E] of users, as-of days, the times of the newest logs
    read, and the embeddings [E, dim] float32."""

    path: str
    user: np.ndarray
    as_of_day: np.ndarray
    history_time: np.ndarray
    table: np.ndarray
    manifest: dict

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])


@dataclass(frozen=True)
class JoinStats:
    """A split's join: rows, and rows whose user had no embedding as of the impression."""

    rows: int
    missing: int

    @property
    def missing_share(self) -> float:
        return self.missing / max(self.rows, 1)


def write_embeddings(path: str | Path, user: np.ndarray, as_of_day: np.ndarray, history_time: np.ndarray,
                     table: np.ndarray, info: dict) -> dict:
    """Write the file (temp file renamed into place) and then its manifest; returns the manifest.
    info: data_digest and whatever else the manifest should carry (encoder run, settings)."""
    path = Path(path)
    table = np.ascontiguousarray(table, dtype=np.float32)
    n, dim = table.shape
    flat = pa.array(table.reshape(-1), pa.float32())
    arrow = pa.table({
        "user_id": pa.array(np.asarray(user, np.int64)),
        "as_of_day": pa.array(np.asarray(as_of_day, np.int32)),
        "history_time": pa.array(np.asarray(history_time, np.float64)),
        "embedding": pa.FixedSizeListArray.from_arrays(flat, dim),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(arrow, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    manifest = {"format": FORMAT_VERSION, "sha256": sha256_file(path), "dim": int(dim), "rows": int(n),
                "definition": DEFINITION, **info}
    manifest_path(path).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_embeddings(path: str | Path, *, data_digest: str, dim: int) -> UserEmbeddings:
    """The embedding file at `path`, checked for the data set with this digest and embeddings of
    this width (ConfigError naming the file otherwise)."""
    path = Path(path)
    where = f"user embedding file {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist: write it with `python -m pipeline.user_embeddings export`")
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where} has no manifest {manifest_path(path).name} beside it") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: unreadable manifest: {err}") from None
    if not isinstance(manifest, dict) or any(k not in manifest for k in MANIFEST_KEYS):
        raise ConfigError(f"{where}: its manifest lacks one of {', '.join(MANIFEST_KEYS)}")
    if manifest["format"] != FORMAT_VERSION:
        raise ConfigError(f"{where}: format {manifest['format']}, this code reads {FORMAT_VERSION}")
    if sha256_file(path) != manifest["sha256"]:
        raise ConfigError(f"{where}: its sha256 differs from its manifest's (changed or corrupt): export it again")
    if manifest["data_digest"] != data_digest:
        raise ConfigError(f"{where} was computed from another data set (digest {str(manifest['data_digest'])[:12]}, "
                          f"this one {data_digest[:12]}): export it from this data set")
    if int(manifest["dim"]) != dim:
        raise ConfigError(f"{where} holds embeddings of dim {manifest['dim']}, the config says "
                          f"model.ranker.user_embedding.dim={dim}")
    try:
        arrow = pq.read_table(path, columns=["user_id", "as_of_day", "history_time", "embedding"])
    except (OSError, pa.ArrowException, KeyError) as err:
        raise ConfigError(f"{where}: unreadable Parquet: {err}") from None
    emb = arrow.column("embedding").combine_chunks()
    if not pa.types.is_fixed_size_list(emb.type) or emb.type.list_size != dim or emb.null_count:
        raise ConfigError(f"{where}: the embedding column is not {dim} float32 values per row")
    user = arrow.column("user_id").to_numpy().astype(np.int64)
    day = arrow.column("as_of_day").to_numpy().astype(np.int32)
    time = arrow.column("history_time").to_numpy().astype(np.float64)
    table = emb.flatten().to_numpy().astype(np.float32).reshape(-1, dim)
    if len(user) != int(manifest["rows"]):
        raise ConfigError(f"{where}: {len(user)} rows, its manifest says {manifest['rows']}")
    if not np.isfinite(table).all():
        raise ConfigError(f"{where}: non-finite embedding values")
    late = np.flatnonzero(~(time < day.astype(np.float64) - 1.0))
    if late.size:
        i = int(late[0])
        raise ConfigError(f"{where}: leakage: the embedding of user {user[i]} as of day {day[i]} read a log at "
                          f"time {time[i]:.3f}, not before day {day[i]} (time {day[i] - 1}); "
                          f"{late.size} such rows")
    keys = pl.DataFrame({"u": user, "d": day})
    if keys.is_duplicated().any():
        dup = keys.filter(keys.is_duplicated()).row(0)
        raise ConfigError(f"{where}: user {dup[0]} has two embeddings as of day {dup[1]}")
    return UserEmbeddings(str(path), user, day, time, table, manifest)


def join_as_of(user: np.ndarray, day: np.ndarray, emb: UserEmbeddings, lag_days: int) -> tuple[np.ndarray, JoinStats]:
    """For each example (user [R], impression day [R]) the row of emb holding the user's newest
    embedding with as_of_day <= day - lag_days, or -1 (none yet): int64 [R], and the counts."""
    if lag_days < 0:
        raise ConfigError(f"user_embedding.lag_days must be >= 0, got {lag_days}")
    examples = pl.DataFrame({"user_id": np.asarray(user, np.int64),
                             "key": np.asarray(day, np.int32) - np.int32(lag_days),
                             "row": np.arange(len(user), dtype=np.int64)}).sort("key")
    table = pl.DataFrame({"user_id": emb.user, "as_of_day": emb.as_of_day,
                          "emb_row": np.arange(len(emb.user), dtype=np.int64)}).sort("as_of_day")
    joined = examples.join_asof(table, left_on="key", right_on="as_of_day", by="user_id", strategy="backward")
    rows = joined.sort("row")["emb_row"].fill_null(-1).to_numpy().astype(np.int64)
    return rows, JoinStats(rows=len(rows), missing=int((rows < 0).sum()))
