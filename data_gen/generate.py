"""Generate a data set: shards in parallel, each from its own seed stream, then meta.json.

Determinism: the seed is split with `SeedSequence.spawn` into one stream for the item world
and one per split, and each split's stream into one per shard (timeline mode: one per block of
users, see timeline.py). A shard's bytes depend only on (config, seed, split, shard index),
never on how many worker processes ran or in what order.

Nothing is written half: a shard is written under a hidden temporary name and renamed into
place (`os.replace`, atomic on POSIX), and meta.json, without which no reader accepts the
directory, is written the same way only after every shard is in place."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from . import metrics, timeline
from .config import ConfigError, DataConfig
from .history import sample_history, sample_users
from .lengths import LengthModel, build_length_model
from .planted import TERMS
from .rows import build_rows
from .schema import (DIGEST_METHOD, META_FILE, SPLITS, columns as schema_columns,
                     dataset_digest, sha256_file, split_days)
from .world import World, build_world

GENERATOR_VERSION = "2.0.0"  # its major is schema.FORMAT_MAJOR
ORACLE_DEFINITION = (
    "auc, ne: AUC and normalized entropy of p_true (the probability each label was drawn "
    "from) against the labels. auc_recent_<k>: AUC against the same labels of the planted "
    "logit recomputed from only the last k history items of each row (k = 0: no history), "
    "i.e. the same function with older items removed; it is a plug-in score, not a "
    "Bayes-optimal predictor for a k-item window. oracle_terms.<term>.alone_<k> / "
    "without_<k> (val and test): the AUC of that weighted term alone, and of the logit without "
    "it, from the last k items (full: the whole history); docs/data.md says which ranker part "
    "needs each.")


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


def generate_shard(world: World, cfg: DataConfig, lengths_model: LengthModel,
                   spec: ShardSpec) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """All columns of one per-example shard, a fresh user per row, and the per-row statistics
    the parent needs for meta.json (see rows.build_rows)."""
    rng = np.random.default_rng(spec.seed)
    lengths = lengths_model.sample(rng, spec.rows)  # [B]

    def fresh_users(lo: int, hi: int, out):
        users = sample_users(world, cfg, rng, lengths[lo:hi])
        return users, sample_history(world, cfg, rng, users, lengths[lo:hi], out=out)

    return build_rows(world, cfg, rng, spec.first_id, lengths, fresh_users,
                      lambda lo, hi: rng.integers(0, 2**62, hi - lo))


def write_shard(cols: dict[str, Any], cfg: DataConfig, path: Path) -> str:
    """Write one shard with polars (zstd) atomically; return its sha256."""
    arrays = {}
    for name, _, is_list in schema_columns(cfg.n_dense, cfg.is_timeline):
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


def _written(split: str, index: int, relpath: str, cols: dict[str, Any],
             stats: dict[str, Any]) -> dict[str, Any]:
    """Write one shard; what the parent keeps of it."""
    rows = int(stats["label"].size)
    sha = write_shard(cols, _STATE["cfg"], _STATE["out"] / relpath)
    return {"split": split, "index": index, "rows": rows,
            "file": {"path": relpath, "rows": rows, "sha256": sha}, "stats": stats}


def _run_shard(spec: ShardSpec) -> list[dict[str, Any]]:
    cols, stats = generate_shard(_STATE["world"], _STATE["cfg"], _STATE["lengths"], spec)
    return [_written(spec.split, spec.index, spec.relpath, cols, stats)]


def _run_block(spec: timeline.TimelineBlock) -> list[dict[str, Any]]:
    parts = timeline.generate_block(_STATE["world"], _STATE["cfg"], _STATE["lengths"], spec)
    return [_written(split, spec.index, spec.relpath(split), cols, stats)
            for split, cols, stats in parts]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _remove_temps(out: Path) -> None:
    for split in SPLITS:
        for tmp in (out / split).glob(".part-*.tmp-*"):
            tmp.unlink(missing_ok=True)


# What a row costs, from the paper preset on 2 cores (experiments/results/data/cpu/): Parquet
# bytes per history item and per row, and history items generated per second per core.
BYTES_PER_ITEM, BYTES_PER_ROW, ITEMS_PER_CORE_S = 7.5, 40.0, 3.0e6
MAX_HOURS = 24.0  # a generation estimated to take longer is refused


def estimate(cfg: DataConfig, workers: int) -> tuple[int, float, float]:
    """(rows, bytes of Parquet, seconds on `workers` cores) that cfg would take, roughly."""
    rows = (round(cfg.users * cfg.days * cfg.impressions_per_day) if cfg.is_timeline
            else cfg.rows)
    items = rows * build_length_model(cfg).expected()["mean"]
    size = items * BYTES_PER_ITEM + rows * (BYTES_PER_ROW + 4 * cfg.n_dense)
    return rows, size, items / (ITEMS_PER_CORE_S * max(1, workers))


def check_room(cfg: DataConfig, out: Path, workers: int | None) -> None:
    """Raise ConfigError (one line) when the estimate exceeds the free space under `out` or
    MAX_HOURS; nothing is written."""
    rows, size, seconds = estimate(cfg, workers or _cpu_count())
    base = Path(out).absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    free = shutil.disk_usage(base).free
    what = f"{rows:,} rows: about {size / 1e9:,.1f} GB and {seconds / 3600:,.1f} h on " \
           f"{workers or _cpu_count()} cores"
    if size > free:
        raise ConfigError(f"--rows {what}, but {base} has {free / 1e9:,.1f} GB free")
    if seconds > MAX_HOURS * 3600:
        raise ConfigError(f"--rows {what}, over the limit of {MAX_HOURS:g} h")


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
    ("spawn" below because forking a process whose polars thread pool runs can deadlock.)"""
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


def _iter_results(cfg: DataConfig, world: World, out: Path, specs: list, workers: int):
    """Each spec's shard results (a list), in completion order, from this process or a pool of
    `workers`."""
    run = _run_block if cfg.is_timeline else _run_shard
    if workers == 1:
        _init_worker(cfg, world, str(out))
        try:
            for spec in specs:
                yield run(spec)
        finally:
            _STATE.clear()
        return
    with _worker_environment():
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (cfg, world, str(out)))
    with pool:  # leaving the block (also by an exception) terminates the workers
        yield from pool.imap_unordered(run, specs, chunksize=1)


def _split_summary(cfg: DataConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    results = sorted(results, key=lambda r: r["index"])
    cat = {k: np.concatenate([r["stats"][k] for r in results], axis=-1)
           for k in ("lengths", "label", "p_true", "logits", "terms")}
    label, p_true = cat["label"], cat["p_true"]
    oracle: dict[str, Any] = {"auc": metrics.auc(label, p_true),
                              "ne": metrics.normalized_entropy(label, p_true)}
    for k, logit in zip(cfg.oracle_ks, cat["logits"]):
        oracle[f"auc_recent_{k}"] = metrics.auc(label, logit)
    summary = {"rows": int(label.size), "ctr": float(label.mean()),
               "mean_p_true": float(p_true.mean()),
               "length_stats": metrics.length_stats(cat["lengths"]), "oracle": oracle,
               "files": [r["file"] for r in results]}
    if results[0]["split"] != "train":  # held-out splits only: 32 AUCs over 1M rows take seconds
        summary["oracle_terms"] = _term_views(cfg, label, cat["logits"], cat["terms"])
    if cfg.is_timeline:
        summary["users"] = timeline.split_users([r["stats"]["users"] for r in results])
    return summary


def _term_views(cfg: DataConfig, label: np.ndarray, logits: np.ndarray,
                terms: np.ndarray) -> dict[str, Any]:
    """Per term and window (k > 0, then "full"): the AUC of the term alone and of the logit
    without it (a term off, w = 0, is left out)."""
    views = [(str(k), i) for i, k in enumerate(cfg.oracle_ks) if k > 0] + [("full", -1)]
    out: dict[str, Any] = {}
    for t, name in enumerate(TERMS):
        if getattr(cfg, f"w_{name}") != 0:
            out[name] = {f"{how}_{k}": metrics.auc(label, terms[t, i] if how == "alone" else
                                                   logits[i] - terms[t, i])
                         for how in ("alone", "without") for k, i in views}
    return out


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
    meta = {
        "generator_version": GENERATOR_VERSION, "seed": seed, "preset": preset,
        "config": config, "digest": dataset_digest(shas), "digest_method": DIGEST_METHOD,
        "columns": {n: (f"list<{_type_name(t)}>" if is_list else _type_name(t))
                    for n, t, is_list in schema_columns(cfg.n_dense, cfg.is_timeline)},
        "sequence_order": "oldest first: the most recent item is the last of each list",
        "oracle_definition": ORACLE_DEFINITION,
        "splits": splits,
        "environment": {"python": platform.python_version(), "numpy": np.__version__,
                        "polars": pl.__version__, "pyarrow": pa.__version__,
                        "seconds": round(seconds, 2)},
    }
    if cfg.is_timeline:
        meta["timeline"] = {"split_days": split_days(cfg.days),
                            "users_per_shard": timeline.users_per_block(cfg),
                            "definition": timeline.TIMELINE_DEFINITION}
    return meta


def generate_dataset(cfg: DataConfig, seed: int, out: str | Path, *, preset: str = "custom",
                     workers: int | None = None, progress: bool = True,
                     overwrite: bool = False) -> dict[str, Any]:
    """Generate every shard of cfg under `out`, then write meta.json; return meta.

    workers: processes (default: one per CPU, at most one per shard); the output is the same
    for any value. Raises FileExistsError if `out` holds a data set and overwrite is False."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    out = Path(out)
    plan = timeline.plan_blocks if cfg.is_timeline else plan_shards
    world_seed, specs = plan(cfg, seed)  # timeline: raises ConfigError for an empty split
    _prepare_out(out, overwrite)
    world = build_world(cfg, world_seed)
    n_workers = max(1, min(workers or _cpu_count(), len(specs)))
    results: list[dict[str, Any]] = []
    bar = tqdm(total=sum(spec.rows for spec in specs), unit="rows", unit_scale=True,
               desc=f"generate {out}", disable=not progress)
    running = _iter_results(cfg, world, out, specs, n_workers)
    try:
        for written in running:
            results += written
            bar.update(sum(res["rows"] for res in written))
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
