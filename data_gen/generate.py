"""Generate a data set: shards in parallel, each from its own seed stream, then meta.json.

Determinism: the seed is split with `SeedSequence.spawn` into one stream for the item world
and one per split, and each split's stream into one per shard. A shard's bytes depend only on
(config, seed, split, shard index), never on how many worker processes ran or in what order.

Nothing is written half: a shard is written under a hidden temporary name and renamed into
place (`os.replace`, atomic on POSIX), and meta.json, without which no reader accepts the
directory, is written the same way only after every shard is in place.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from . import metrics
from .config import DataConfig
from .history import sample_history, sample_users
from .lengths import LengthModel, build_length_model
from .planted import planted_logits, sample_candidates
from .schema import (DIGEST_METHOD, META_FILE, SPLITS, columns as schema_columns,
                     dataset_digest, sha256_file)
from .world import World, build_world

GENERATOR_VERSION = "1.0.0"
# Rows generated together inside a shard. Part of the definition of the data (it orders the
# draws of a shard's stream), so changing it needs a new GENERATOR_VERSION.
CHUNK_ROWS = 4096
ORACLE_DEFINITION = (
    "auc, ne: AUC and normalized entropy of p_true (the probability each label was drawn "
    "from) against the labels. auc_recent_<k>: AUC against the same labels of the planted "
    "logit recomputed from only the last k history items of each row (k = 0: no history), "
    "i.e. the same function with older items removed; it is a plug-in score, not a "
    "Bayes-optimal predictor for a k-item window.")


@dataclass(frozen=True)
class ShardSpec:
    split: str
    index: int
    first_id: int  # example_id of the shard's first row
    rows: int
    seed: np.random.SeedSequence

    @property
    def relpath(self) -> str:
        return f"{self.split}/part-{self.index:05d}.parquet"


def plan_shards(cfg: DataConfig, seed: int) -> tuple[np.random.SeedSequence, list[ShardSpec]]:
    """The world's seed stream and every shard (train, then val, then test)."""
    world_seed, *split_seeds = np.random.SeedSequence(seed).spawn(1 + len(SPLITS))
    shards, first_id = [], 0
    for split, split_seed in zip(SPLITS, split_seeds):
        n = cfg.split_rows()[split]
        sizes = [min(cfg.rows_per_shard, n - s) for s in range(0, n, cfg.rows_per_shard)]
        for i, (size, ss) in enumerate(zip(sizes, split_seed.spawn(len(sizes)))):
            shards.append(ShardSpec(split, i, first_id, size, ss))
            first_id += size
    return world_seed, shards


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def generate_shard(world: World, cfg: DataConfig, lengths_model: LengthModel,
                   spec: ShardSpec) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """All columns of one shard (numpy; sequences as flat values + int64 offsets [B + 1]) and
    the per-row statistics the parent needs for meta.json."""
    rng = np.random.default_rng(spec.seed)
    b = spec.rows
    lengths = lengths_model.sample(rng, b)  # [B]
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    t = int(offsets[-1])
    item = np.empty(t, np.int32)
    action = np.empty(t, np.int8)
    age = np.empty(t, np.float32)
    cand = np.empty(b, np.int32)
    dense = np.empty((b, cfg.n_dense), np.float32)
    n_views = len(cfg.oracle_ks) + 1
    logits = np.empty((n_views, b), np.float32)
    p_true, label, user_id = np.empty(b, np.float32), np.empty(b, np.int8), np.empty(b, np.int64)
    for lo in range(0, b, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, b)
        users = sample_users(world, cfg, rng, lengths[lo:hi])
        flat = slice(offsets[lo], offsets[hi])
        hist = sample_history(world, cfg, rng, users, lengths[lo:hi],
                              out=(item[flat], action[flat], age[flat]))
        ci, cc = sample_candidates(world, cfg, rng, users, hist)
        dense[lo:hi] = rng.standard_normal((hi - lo, cfg.n_dense), dtype=np.float32)
        view = planted_logits(world, cfg, hist, ci, cc, dense[lo:hi])  # [n_views, B_chunk]
        p = _sigmoid(view[-1]).astype(np.float32)
        label[lo:hi] = rng.random(hi - lo) < p  # drawn from the stored float32 p_true
        user_id[lo:hi] = rng.integers(0, 2**62, hi - lo)
        p_true[lo:hi], logits[:, lo:hi], cand[lo:hi] = p, view, ci
    cols: dict[str, Any] = {
        "example_id": np.arange(spec.first_id, spec.first_id + b, dtype=np.int64),
        "user_id": user_id, "hist_item": (offsets, item), "hist_action": (offsets, action),
        "hist_age": (offsets, age), "cand_item": cand,
        **{f"dense_{i}": np.ascontiguousarray(dense[:, i]) for i in range(cfg.n_dense)},
        "label": label, "p_true": p_true,
    }
    stats = {"lengths": lengths.astype(np.int32), "label": label, "p_true": p_true,
             "logits": logits}
    return cols, stats


def write_shard(cols: dict[str, Any], cfg: DataConfig, path: Path) -> str:
    """Write one shard with polars (zstd) atomically; return its sha256."""
    arrays = {}
    for name, _, is_list in schema_columns(cfg.n_dense):
        if is_list:
            offsets, values = cols[name]
            arrays[name] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
        else:
            arrays[name] = pa.array(cols[name])
    frame = pl.from_arrow(pa.table(arrays))
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        frame.write_parquet(tmp, compression="zstd", statistics=False,
                            row_group_size=cfg.row_group_size)
        sha = sha256_file(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return sha


# Worker-process state, set once per process by _init_worker (the world is large).
_STATE: dict[str, Any] = {}


def _init_worker(cfg: DataConfig, world: World, out: str) -> None:
    _STATE.update(cfg=cfg, world=world, out=Path(out), lengths=build_length_model(cfg))


def _run_shard(spec: ShardSpec) -> dict[str, Any]:
    cfg, out = _STATE["cfg"], _STATE["out"]
    cols, stats = generate_shard(_STATE["world"], cfg, _STATE["lengths"], spec)
    sha = write_shard(cols, cfg, out / spec.relpath)
    return {"split": spec.split, "index": spec.index, "rows": spec.rows,
            "file": {"path": spec.relpath, "rows": spec.rows, "sha256": sha}, "stats": stats}


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _remove_temps(out: Path) -> None:
    for split in SPLITS:
        for tmp in (out / split).glob(".part-*.tmp-*"):
            tmp.unlink(missing_ok=True)


def _prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse to clobber a data set unless asked; then clear old shards, meta.json first."""
    old = [out / META_FILE] if (out / META_FILE).exists() else []
    for split in SPLITS:
        old += sorted((out / split).glob("part-*.parquet"))
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds a data set ({old[0].name}, ...); "
                              "pass --overwrite or choose another --out")
    (out / META_FILE).unlink(missing_ok=True)  # first: a half-rewritten set must never validate
    for path in old:
        path.unlink(missing_ok=True)
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
    _remove_temps(out)


@contextlib.contextmanager
def _worker_environment():
    """Environment variables that spawned workers inherit (restored afterwards).

    One polars thread per worker: the processes already fill the cores. glibc keeps freed
    memory instead of returning it to the OS, so that each shard reuses the previous one's
    pages: page faults cost ~10 us each on a VM, ~0.3 s of system time per 65k-row shard.
    ("spawn" below because forking a process whose polars thread pool runs can deadlock.)
    """
    env = {"POLARS_MAX_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 32),
           "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _iter_results(cfg: DataConfig, world: World, out: Path, shards: list[ShardSpec],
                  workers: int):
    """Shard results in completion order, from this process or a pool of `workers`."""
    if workers == 1:
        _init_worker(cfg, world, str(out))
        try:
            for spec in shards:
                yield _run_shard(spec)
        finally:
            _STATE.clear()
        return
    with _worker_environment():
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (cfg, world, str(out)))
    with pool:  # leaving the block (also by an exception) terminates the workers
        yield from pool.imap_unordered(_run_shard, shards, chunksize=1)


def _split_summary(cfg: DataConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    results = sorted(results, key=lambda r: r["index"])
    cat = {k: np.concatenate([r["stats"][k] for r in results], axis=-1)
           for k in ("lengths", "label", "p_true", "logits")}
    label, p_true = cat["label"], cat["p_true"]
    oracle: dict[str, Any] = {"auc": metrics.auc(label, p_true),
                              "ne": metrics.normalized_entropy(label, p_true)}
    for k, logit in zip(cfg.oracle_ks, cat["logits"]):
        oracle[f"auc_recent_{k}"] = metrics.auc(label, logit)
    return {"rows": int(label.size), "ctr": float(label.mean()),
            "mean_p_true": float(p_true.mean()),
            "length_stats": metrics.length_stats(cat["lengths"]), "oracle": oracle,
            "files": [r["file"] for r in results]}


def _type_name(t: pa.DataType) -> str:
    return "float32" if t == pa.float32() else str(t)  # Arrow calls it "float"


def build_meta(cfg: DataConfig, seed: int, preset: str, results: list[dict[str, Any]],
               seconds: float) -> dict[str, Any]:
    """meta.json's content (see the README's Data section)."""
    splits = {s: _split_summary(cfg, [r for r in results if r["split"] == s]) for s in SPLITS}
    shas = [f["sha256"] for s in SPLITS for f in splits[s]["files"]]
    model = build_length_model(cfg)
    config = cfg.to_dict()
    config["length_model"] = {"dist": model.dist, "params": model.params,
                              "expected": model.expected()}
    return {
        "generator_version": GENERATOR_VERSION, "seed": seed, "preset": preset,
        "config": config, "digest": dataset_digest(shas), "digest_method": DIGEST_METHOD,
        "columns": {n: (f"list<{_type_name(t)}>" if is_list else _type_name(t))
                    for n, t, is_list in schema_columns(cfg.n_dense)},
        "sequence_order": "oldest first: the most recent item is the last of each list",
        "oracle_definition": ORACLE_DEFINITION,
        "splits": splits,
        "environment": {"python": platform.python_version(), "numpy": np.__version__,
                        "polars": pl.__version__, "pyarrow": pa.__version__,
                        "seconds": round(seconds, 2)},
    }


def generate_dataset(cfg: DataConfig, seed: int, out: str | Path, *, preset: str = "custom",
                     workers: int | None = None, progress: bool = True,
                     overwrite: bool = False) -> dict[str, Any]:
    """Generate every shard of cfg under `out`, then write meta.json; return meta.

    workers: processes (default: one per CPU, at most one per shard); the output is the same
    for any value. Raises FileExistsError if `out` holds a data set and overwrite is False.
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    out = Path(out)
    world_seed, shards = plan_shards(cfg, seed)
    _prepare_out(out, overwrite)
    world = build_world(cfg, world_seed)
    n_workers = max(1, min(workers or _cpu_count(), len(shards)))
    results: list[dict[str, Any]] = []
    bar = tqdm(total=cfg.rows, unit="rows", unit_scale=True, desc=f"generate {out}",
               disable=not progress)
    running = _iter_results(cfg, world, out, shards, n_workers)
    try:
        for res in running:
            results.append(res)
            bar.update(res["rows"])
    except BaseException:
        running.close()  # stops the workers before their temporary files are removed
        _remove_temps(out)  # finished shards stay, but without meta.json nothing accepts them
        raise
    finally:
        bar.close()
    meta = build_meta(cfg, seed, preset, results, time.perf_counter() - start)
    write_json_atomic(out / META_FILE, meta)
    return meta


def write_json_atomic(path: Path, obj: Any) -> None:
    """json.dump to a temporary name, then rename into place."""
    import json

    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
