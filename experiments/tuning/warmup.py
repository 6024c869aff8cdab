"""Compiling a sweep's configs before its timing pass, in spawned processes that fill Triton's disk cache.

``warm_cache(warm_up_todo(order, done, level), device, args)``: every config still to be timed runs
once over its shapes in args.compile_workers processes, for at most args.compile_budget_s; the
timing pass then loads the kernels from the cache (compiling needs no quiet GPU)."""

from __future__ import annotations

import math
import time

import torch

from experiments.bench.measure import sync
from experiments.tuning.families import SweepShape, config_id, launching, make_case, space


def sticky(exc: BaseException) -> bool:
    """A CUDA error that poisons the context (every later launch would fail)."""
    msg = str(exc).lower()
    return "illegal memory access" in msg or "unspecified launch failure" in msg or "device-side assert" in msg


_WORKER_POISONED = False  # a warm-up worker whose CUDA context a config broke runs nothing more


def warm_config(task: tuple) -> list[tuple]:
    """In a warm-up worker: run one config once on each shape (Triton compiles it into its disk
    cache); [(family, shape_id, config_id, first call's wall s or None, error or '')]. The
    allocator's cached blocks go back after every call, so a dozen workers do not fill the GPU."""
    global _WORKER_POISONED
    family, cfg, shapes, device_name, seed = task
    device, out = torch.device(device_name), []
    for s in shapes:
        secs, err, fn = None, "", None
        if not _WORKER_POISONED:
            try:
                fn, _ = make_case(family, s, device, seed)
                with launching(family, cfg):
                    t0 = time.perf_counter()
                    fn()
                    sync(device)
                    secs = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - the timing pass records what fails
                _WORKER_POISONED = sticky(exc)
                err = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                del fn
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        out.append((family, s.id, config_id(cfg), secs, err))
    return out


def warm_cache(todo: dict[str, dict[str, tuple[dict, list[SweepShape]]]], device: torch.device, args) -> dict:
    """Compile every config of `todo` ({family: {config_id: (config, shapes)}}) in spawned processes
    for at most args.compile_budget_s; {(family, shape_id, config_id): the worker's first-call s}."""
    import concurrent.futures as cf
    import multiprocessing

    tasks = [(f, cfg, shapes, str(device), args.seed) for f, by_id in todo.items() for cfg, shapes in by_id.values()]
    if not tasks:
        return {}
    t0, warm, failed = time.monotonic(), {}, []
    print(f"warming Triton's cache: {len(tasks)} configs, {sum(len(t[2]) for t in tasks)} calls, "
          f"{args.compile_workers} processes, at most {args.compile_budget_s:g} s", flush=True)
    pool = cf.ProcessPoolExecutor(args.compile_workers, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(warm_config, t) for t in tasks]
    budget = None if math.isinf(args.compile_budget_s) else args.compile_budget_s
    try:
        for fut in cf.as_completed(futures, timeout=budget):
            for f, sid, cid, secs, err in fut.result():
                if secs is not None:
                    warm[(f, sid, cid)] = secs
                else:
                    failed.append(f"{f} {sid} {cid}: {err or 'not run (a CUDA error broke the worker)'}")
    except cf.TimeoutError:
        print("  warm-up budget spent: the configs left compile in the timing pass", flush=True)
    except cf.process.BrokenProcessPool as exc:  # a worker died (a crash, not an exception)
        print(f"  a warm-up process died ({exc}): the configs left compile in the timing pass", flush=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # nothing of the warm-up may run beside the timing
    print(f"  {len(warm)} calls compiled and ran in {time.monotonic() - t0:.0f} s", flush=True)
    if failed:
        print(f"  {len(failed)} calls failed in the warm-up (compiled in the timing pass), first: {failed[0]}",
              flush=True)
    return warm


def warm_up_todo(order: list[tuple[str, SweepShape]], done: set, level: str) -> dict:
    """{family: {config_id: (config, [the shapes, in sweep order, where it is still to be timed])}}."""
    todo: dict[str, dict[str, tuple[dict, list]]] = {}
    for family, s in order:
        for cfg in space(family, s, level):
            if (family, s.id, config_id(cfg)) not in done:
                todo.setdefault(family, {}).setdefault(config_id(cfg), (cfg, []))[1].append(s)
    return todo
