"""Launch-config sweep: every valid config of every kernel family on a grid of shapes, one Parquet row each.

    python -m experiments config-sweep [--grid tiny|small|medium|full] [--families a,b] [--deadline-s 400]
        [--out runs/costmodel/sweep-<gpu>.parquet] [--compile-workers N] [--mlflow]

Resumable and bounded (--deadline-s); experiments/gpu/costmodel.sh runs it on a GPU, and
``TRITON_INTERPRET=1 ... --grid tiny --device cpu`` on the CPU. Columns: docs/tuning.md, "The sweep's rows"."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from experiments import parser
from experiments.bench.measure import CHECK_TOL, bench_ms, free_memory, graph_ms, rel_err, sync
from experiments.bench.stamp import make_stamp
from experiments.tuning.families import (DTYPES, ENERGY_SLACK, FAMILIES, KERNELS, LEVELS, SweepShape, complete,
                                         config_id, grid, hand_config, launching, make_case, space)
from experiments.tuning.warmup import sticky, warm_cache, warm_up_todo

KEY = ("family", "shape_id", "config_id")


def _compiled(family: str) -> dict:
    """{cache key: CompiledKernel} of the family's kernel (empty where Triton hides it)."""
    import importlib

    mod, *names = KERNELS[family]
    out = {}
    for name in names:  # a family may launch several kernels: the most any of them spills
        fn = getattr(importlib.import_module(f"kernels.{mod}"), name)
        try:
            for dev_cache in fn.device_caches.values():
                out.update({(name, key): k for key, k in dev_cache[0].items()})
        except (AttributeError, TypeError, IndexError):
            pass
    return out


def _spills(before: dict, after: dict) -> float:
    vals = [k.n_spills for key, k in after.items() if key not in before and getattr(k, "n_spills", None) is not None]
    return float(max(vals)) if vals else math.nan


def _outputs(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if t is not None]


def _status(exc: BaseException) -> str:
    name = type(exc).__name__
    if name == "OutOfResources" or "out of resource" in str(exc).lower():
        return "out_of_resources"
    return "compile_error" if "Compilation" in name or "compil" in str(exc).lower()[:200] else "error"


def time_config(family: str, fn, cfg: dict, ref: list | None, dtype: torch.dtype, device: torch.device, args) -> dict:
    """One row's measurements of `fn` under `cfg` (docs/tuning.md, "The sweep's rows")."""
    row = dict(status="ok", error="", ms=math.nan, energy_j=math.nan, energy_src="none",
               energy_window_s=math.nan, energy_calls=0, compile_s=math.nan, bench_s=math.nan, rel_err=math.nan,
               spills=math.nan)
    with launching(family, cfg):
        before = _compiled(family)
        t0 = time.perf_counter()
        try:
            outs = _outputs(fn())
            sync(device)
        except Exception as exc:  # noqa: BLE001 - a config that does not run is a row
            row.update(status=_status(exc), error=f"{type(exc).__name__}: {str(exc)[:200]}")
            if sticky(exc):
                row["sticky"] = True
            return row
        row["compile_s"] = time.perf_counter() - t0
        row["spills"] = _spills(before, _compiled(family))
        if ref is not None:
            errs = [rel_err(o.float(), r.float()) for o, r in zip(outs, ref)]
            row["rel_err"] = max(errs) if errs else 0.0
            if not row["rel_err"] <= CHECK_TOL[dtype]:
                row["status"] = "mismatch"
        del outs
        t1 = time.perf_counter()
        try:
            row["ms"] = graph_ms(fn, device, args.rep_ms) if args.timing == "graph" else \
                bench_ms(fn, device, args.warmup_ms, args.rep_ms)
        except Exception as exc:  # noqa: BLE001 - a call that cannot be captured (or timed) is a row
            row.update(status="error", error=f"timing: {type(exc).__name__}: {str(exc)[:190]}")
            if sticky(exc):
                row["sticky"] = True
            return row
        row["bench_s"] = time.perf_counter() - t1
    return row


def nvml_handle(nv, device_index: int):
    """NVML's handle of torch's CUDA device `device_index`, matched by UUID (NVML numbers every board
    of the host, torch the visible ones); by index only where no board is hidden, else None."""
    try:
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        return nv.nvmlDeviceGetHandleByUUID((uuid if uuid.startswith("GPU-") else "GPU-" + uuid).encode())
    except Exception:  # noqa: BLE001 - an old torch or driver without UUIDs
        return None if os.environ.get("CUDA_VISIBLE_DEVICES") else nv.nvmlDeviceGetHandleByIndex(device_index)


class EnergyMeter:
    """Board energy (J) from NVML's total-energy counter; `available` is False without NVML or a
    counter (pre-Volta boards, some virtualised GPUs): energy is NaN then."""

    def __init__(self, device_index: int | None = 0):
        self._nvml = self._handle = None
        if device_index is None:
            return
        try:
            import pynvml as nv

            nv.nvmlInit()
            handle = nvml_handle(nv, device_index)
            nv.nvmlDeviceGetTotalEnergyConsumption(handle)
            self._nvml, self._handle = nv, handle
        except Exception:  # noqa: BLE001 - no NVML, driver, device or counter
            pass

    @property
    def available(self) -> bool:
        return self._handle is not None

    def read_j(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3  # mJ -> J


ENERGY_MAX_CONFIGS = 3  # per shape, besides the hand rule's: about 4 s of energy readings a shape


def energy_rows(rows: list[dict]) -> list[dict]:
    """The rows of one shape whose energy an energy-aware choice weighs: the ENERGY_MAX_CONFIGS
    fastest of those ok and within ENERGY_SLACK of the fastest, and the hand rule's."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    fastest = min(r["ms"] for r in ok)
    near = sorted((r for r in ok if r["ms"] <= ENERGY_SLACK * fastest), key=lambda r: r["ms"])[:ENERGY_MAX_CONFIGS]
    return [*near, *(r for r in ok if r["is_hand"] and r not in near)]


def needs_energy(rows: list[dict]) -> bool:
    """Whether a row of `energy_rows` has no reading of the energy counter yet."""
    return any(r.get("energy_src") != "counter" for r in energy_rows(rows))


def measure_energy(family: str, fn, rows: list[dict], device: torch.device, meter: EnergyMeter, args) -> None:
    """Energy per call (J) from the board's counter over at least args.energy_s of back-to-back
    calls (no L2 flush), for the `energy_rows` of one shape without a counter reading yet; a
    failed reading leaves energy_src 'error' (read again by a resumed sweep)."""
    if not meter.available or args.energy_s <= 0:
        return
    for r in energy_rows(rows):
        if r.get("energy_src") == "counter":
            continue
        chunk = max(1, min(1000, math.ceil(args.energy_s * 1e3 / r["ms"] / 20)))  # ~20 checks of the clock
        calls = 0
        try:
            with launching(family, complete(family, json.loads(r["config"]))):
                fn()
                sync(device)
                e0, t0 = meter.read_j(), time.perf_counter()
                while calls == 0 or time.perf_counter() - t0 < args.energy_s:
                    for _ in range(chunk):
                        fn()
                    calls += chunk
                sync(device)
                e1, t1 = meter.read_j(), time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - the timings of the shape are kept
            r.update(energy_j=math.nan, energy_src="error", error=f"energy: {type(exc).__name__}: {str(exc)[:150]}")
            continue
        r.update(energy_j=(e1 - e0) / calls, energy_src="counter", energy_window_s=t1 - t0, energy_calls=calls)


def _shape_cols(family: str, s: SweepShape, info: dict) -> dict:
    return dict(family=family, shape_id=s.id, B=s.B, N=s.N, fill=s.fill, H=s.H, D=s.D, Tq=s.Tq,
                K=s.D if "bmm" in family else 0, M=s.D if "bmm" in family else 0, dtype=s.dtype,
                T=info["T"], L=info["L"])


def load_rows(path: Path) -> list[dict]:
    import polars as pl

    return pl.read_parquet(path).to_dicts() if path.is_file() else []


def refresh(rows: list[dict]) -> None:
    """Resumed rows, in place: `is_hand` after today's hand rules (they may have changed since the
    rows were timed), and no energy but the counter's (sampled power x time of older sweeps)."""
    hand_ids: dict[tuple, str] = {}
    for r in rows:
        key = (r["family"], r["shape_id"])
        if key not in hand_ids:
            shape = SweepShape(r["B"], r["N"], r["fill"], r["H"], r["D"], r["dtype"], r["Tq"])
            hand_ids[key] = config_id(hand_config(r["family"], shape))
        r["is_hand"] = r["config_id"] == hand_ids[key]
        if r.get("energy_src") != "counter":
            r["energy_j"] = math.nan


def set_aside_stale(path: Path, rows: list[dict], code: str, timing: str, families=None) -> list[dict]:
    """The rows timed with today's kernel code and `timing`; the others of `families` (default all)
    are appended to <stem>.stale.parquet and timed again (each family is fitted on its own rows)."""
    def current(r: dict) -> bool:
        return ((families is not None and r.get("family") not in families)
                or (r.get("kernel_code") == code and (r.get("timing") or "call") == timing))

    stale = [r for r in rows if not current(r)]
    if not stale:
        return rows
    archive = path.with_name(path.stem + ".stale.parquet")
    write_rows(archive, [*load_rows(archive), *stale])
    print(f"{len(stale)} of {len(rows)} rows were timed with other kernel code than today's ({code}) or not by "
          f"{timing} timing: they are timed again (the old rows: {archive})", flush=True)
    fresh = [r for r in rows if current(r)]
    write_rows(path, fresh)
    return fresh


def write_rows(path: Path, rows: list[dict]) -> None:
    import polars as pl

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pl.DataFrame(rows, infer_schema_length=None).write_parquet(tmp)
    os.replace(tmp, path)


def sweep_shape(family: str, s: SweepShape, todo: list[dict], hand: dict, device, stamp: dict,
                meter: EnergyMeter, args, out_of_time,
                prior: list[dict] = (), warm: dict | None = None) -> tuple[list[dict], bool]:
    """Rows of the configs `todo` on one shape, then (once the shape is complete) its energy pass
    over these and the shape's `prior` rows; (rows, sticky CUDA error seen). `warm`: warm_cache's
    first-call seconds."""
    fn, info = make_case(family, s, device, args.seed)
    dtype = DTYPES[s.dtype]
    with launching(family, hand):
        ref = [o.detach().clone() for o in _outputs(fn())]
    rows, sticky, complete = [], False, True
    for cfg in todo:
        if out_of_time():
            complete = False
            break
        m = time_config(family, fn, cfg, ref, dtype, device, args)
        sticky = bool(m.pop("sticky", False))
        cid = config_id(cfg)
        m["cached_call_s"] = math.nan
        if (family, s.id, cid) in (warm or {}):  # compiled by a warm-up worker
            m["cached_call_s"], m["compile_s"] = m["compile_s"], warm[(family, s.id, cid)]
        rows.append({**_shape_cols(family, s, info), "config_id": cid, "config": json.dumps(cfg),
                     "is_hand": cid == config_id(hand), **m, "warmup_ms": args.warmup_ms,
                     "rep_ms": args.rep_ms, "timing": args.timing, "grid": args.grid,
                     **{k: stamp[k] for k in STAMP_COLS}})
        if sticky:
            break
    if complete and not sticky:  # a shape cut by the deadline: its fastest configs may be still untimed
        measure_energy(family, fn, [*prior, *rows], device, meter, args)
    del fn, ref
    free_memory(device)
    return rows, sticky


STAMP_COLS = ("gpu", "gpu_slug", "torch", "triton", "cuda", "commit", "kernel_code", "date")


def _progress(family: str, s: SweepShape, rows: list[dict], n_left: int, elapsed: float) -> None:
    ok = [r for r in rows if r["status"] == "ok"]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    hand = next((r for r in ok if r["is_hand"]), None)
    tail = (f"best {best['ms']:.4f} ms [{best['config_id']}]" if best else "no ok config")
    if best and hand:
        tail += f", hand {hand['ms'] / best['ms']:.2f}x"
    print(f"  {family:<18} {s.id:<40} {len(rows):3d} configs ({len(rows) - len(ok)} not ok), {tail}; "
          f"{n_left} shapes left, {elapsed:.0f} s", flush=True)


def run(args) -> int:
    device = torch.device(args.device)
    stamp = make_stamp(device, args.commit)
    out = Path(args.out.replace("<gpu>", stamp["gpu_slug"]))
    rows = load_rows(out)
    other = sorted({str(r.get("gpu_slug")) for r in rows} - {stamp["gpu_slug"]})
    if other:  # timings of another GPU (or none) would mix into this one's model
        print(f"error: {out} holds rows timed on {', '.join(other)}, not on this {stamp['gpu']}: resume a sweep "
              "only on the GPU it ran on (another --out starts afresh)", file=sys.stderr)
        return 2
    rows = set_aside_stale(out, rows, stamp["kernel_code"], args.timing, set(args.families))
    refresh(rows)
    done = {tuple(r[k] for k in KEY) for r in rows}
    t0 = time.monotonic()
    out_of_time = lambda: args.deadline_s is not None and time.monotonic() - t0 > args.deadline_s  # noqa: E731
    grids = {f: grid(f, args.grid) for f in args.families}
    order = [(f, g[i]) for i in range(max(map(len, grids.values()))) for f, g in grids.items() if i < len(g)]
    meter = EnergyMeter((device.index or 0) if device.type == "cuda" else None)
    print(f"sweep {args.grid}: {len(order)} (family, shape) pairs, {len(rows)} rows already in {out}; "
          f"{stamp['gpu']}, torch {stamp['torch']}, triton {stamp['triton']}, commit {stamp['commit']}; "
          f"energy counter "
          f"{'NVML' if meter.available else 'absent (energy NaN)'}", flush=True)
    warm = warm_cache(warm_up_todo(order, done, args.grid), device, args) if args.compile_workers > 0 else {}
    n_new = 0
    for i, (family, s) in enumerate(order):
        hand = hand_config(family, s)
        todo = [c for c in space(family, s, args.grid) if (family, s.id, config_id(c)) not in done]
        prior = [r for r in rows if r["family"] == family and r["shape_id"] == s.id]
        # a shape timed before the energy pass existed (or without NVML), or whose fastest configs
        # changed since, gets its missing energy readings now
        no_energy = meter.available and args.energy_s > 0 and needs_energy(prior)
        if not todo and not no_energy:
            continue
        if out_of_time():
            print(f"deadline ({args.deadline_s:g} s) reached: {len(order) - i} shapes not finished", flush=True)
            break
        new, sticky = sweep_shape(family, s, todo, hand, device, stamp, meter, args, out_of_time, prior, warm)
        rows += new
        n_new += len(new)
        write_rows(out, rows)
        _progress(family, s, new or prior, len(order) - i - 1, time.monotonic() - t0)
        if sticky:
            print("a CUDA error poisoned the context: stopping; rerun to resume after that config", flush=True)
            return 3
    print(f"{n_new} new rows, {len(rows)} in all -> {out} ({time.monotonic() - t0:.0f} s)", flush=True)
    if args.mlflow:
        log_mlflow(out, rows, n_new, stamp, args)
    return 0


def log_mlflow(path: Path, rows: list[dict], n_new: int, stamp: dict, args) -> str:
    """One MLflow run (experiment 'kernel-costmodel') with the Parquet as an artifact."""
    import mlflow

    from pipeline.tracking import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment("kernel-costmodel")
    with mlflow.start_run(run_name=f"sweep-{stamp['gpu_slug']}-{args.grid}") as run:
        mlflow.set_tags({f"stamp.{k}": str(stamp[k]) for k in STAMP_COLS} | {"kind": "config-sweep"})
        mlflow.log_params({"grid": args.grid, "families": ",".join(args.families), "deadline_s": args.deadline_s,
                           "timing": args.timing, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                           "seed": args.seed})
        mlflow.log_metrics({"rows": len(rows), "new_rows": n_new, "ok_rows": sum(r["status"] == "ok" for r in rows)})
        mlflow.log_artifact(str(path))
    print(f"MLflow run {run.info.run_id} ({tracking_uri()})", flush=True)
    return run.info.run_id


def parse_args(argv=None) -> argparse.Namespace:
    p = parser("config-sweep", __doc__)
    p.add_argument("--grid", default="small", choices=LEVELS)
    p.add_argument("--families", default="all", help=f"comma-separated, of: {', '.join(FAMILIES)}")
    p.add_argument("--out", default="runs/costmodel/sweep-<gpu>.parquet", help="Parquet file (<gpu>: the GPU's slug)")
    p.add_argument("--deadline-s", type=float, default=None, help="start no new config after this many seconds")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up, ms (call timing)")
    p.add_argument("--rep-ms", type=float, default=40.0, help="do_bench repetition time, ms")
    p.add_argument("--timing", choices=("graph", "call"), default=None,
                   help="graph: CUDA-graph replays, the kernels alone (default on CUDA); call: whole calls")
    p.add_argument("--energy-s", type=float, default=1.0, help="seconds of calls per energy reading (0: none)")
    p.add_argument("--compile-workers", type=int, default=None,
                   help="processes compiling the configs before timing (default: CUDA cores-2 up to 12; CPU 0)")
    p.add_argument("--compile-budget-s", type=float, default=None, help="warm-up seconds (default: deadline / 2)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--commit", default=None, help="git commit to record (default $GIT_COMMIT, else HEAD)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlflow", action="store_true", help="log an MLflow run with the Parquet as its artifact")
    args = p.parse_args(argv)
    args.families = list(FAMILIES) if args.families == "all" else [f for f in args.families.split(",") if f]
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.timing = args.timing or ("graph" if args.device == "cuda" else "call")
    if args.compile_workers is None:
        args.compile_workers = min(12, max(0, (os.cpu_count() or 1) - 2)) if args.device == "cuda" else 0
    if args.compile_budget_s is None:
        args.compile_budget_s = args.deadline_s / 2 if args.deadline_s is not None else math.inf
    for bad, why in (
            (not args.families or set(args.families) - set(FAMILIES),
             f"unknown families {sorted(set(args.families) - set(FAMILIES))}; known: {', '.join(FAMILIES)}"),
            (args.device not in ("cuda", "cpu"), f"--device must be cuda or cpu, not {args.device!r}"),
            (args.device == "cuda" and not torch.cuda.is_available(), "--device cuda: no CUDA device here"),
            (args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
             "--device cpu runs the Triton kernels through the interpreter: set TRITON_INTERPRET=1"),
            (args.deadline_s is not None and args.deadline_s <= 0, "--deadline-s must be positive"),
            (args.timing == "graph" and args.device != "cuda", "--timing graph replays CUDA graphs: it needs --device cuda"),
            (args.compile_workers < 0, "--compile-workers must be 0 or more"),
            (args.compile_budget_s <= 0, "--compile-budget-s must be positive")):
        if bad:
            p.error(why)
    return args


def main(argv=None) -> int:
    return run(parse_args(argv))

