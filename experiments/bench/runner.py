"""One kind of benchmark over one suite, shape by shape, provider by provider: ``run_kind``.

Per provider: inputs in its own layout, one forward checked against the fp32 reference (a
mismatch is FAILED, untimed), then each mode timed (fwd under no_grad; fwd_bwd with a fixed
grad_out) and its peak memory. An OOM or error is the row's status, and the run goes on."""

from __future__ import annotations

import math
import sys
import time
from typing import Callable

import torch

from experiments.bench.base import OURS, Prepared, Provider, RunConfig
from experiments.bench.layouts import Jagged, make_jagged, reference_dense_attention, reference_self_attention
from experiments.bench.measure import (CHECK_TOL, bench_ms, free_memory, graph_ms, is_oom, peak_extra_bytes, rel_err,
                                       tensor_bytes)
from experiments.bench.providers import ATTENTION_PROVIDERS, DENSE_ATTENTION_PROVIDERS
from experiments.bench.providers_ops import OPS
from experiments.bench.suites import Shape, attention_flops, dense_attention_flops, get_suite

MiB = 1 << 20


def _status_of(exc: BaseException) -> str:
    return "OOM" if is_oom(exc) else f"error: {type(exc).__name__}"


def _time_mode(prep: Prepared, mode: str, cfg: RunConfig, no_graph: str | None = None) -> dict:
    if mode == "fwd":
        fn, grads, held = torch.no_grad()(prep.fwd), [], prep.held
    else:
        g = torch.randn_like(prep.fwd())  # fixed grad_out, in the provider's own output layout
        fn, grads, held = (lambda: prep.fwd().backward(g)), prep.leaves, prep.held + [g]
    ms = bench_ms(fn, cfg.device, cfg.warmup_ms, cfg.rep_ms, grad_to_none=grads)
    extra, in_bytes = peak_extra_bytes(fn, cfg.device, grads), tensor_bytes(held)
    row = {"status": "ok", "ms": ms, "input_bytes": in_bytes, "extra_bytes": extra,
           "peak_bytes": None if extra is None else in_bytes + extra}
    if cfg.graph_ms:
        row.update({"gpu_ms": None, "gpu_ms_error": no_graph} if no_graph else _graph_time(fn, cfg, grads, extra))
    return row


# A capture holds one call's memory in its own pool beside the warm-up's cached blocks; one that
# runs out of memory midway keeps its pool for the rest of the process (pytorch/pytorch#190348,
# torch 2.11), and every later row's capture would fail too. So a call this large is not captured.
GRAPH_MEMORY_FACTOR = 2.5


def too_large_to_capture(extra_bytes: int | None, free_bytes: int) -> str | None:
    if extra_bytes and GRAPH_MEMORY_FACTOR * extra_bytes > free_bytes:
        return (f"not captured: one call needs {extra_bytes / 2**30:.1f} GiB, {free_bytes / 2**30:.1f} GiB free "
                "(a capture that runs out of memory keeps its pool)")
    return None


def _graph_time(fn, cfg: RunConfig, grads: list, extra_bytes: int | None = None) -> dict:
    """gpu_ms of the row (the kernels alone), or why not: a peer whose call cannot be captured in a
    CUDA graph (a host sync, a CPU tensor), or too large to capture safely, gets gpu_ms None and
    the reason, not a failed row."""
    try:
        if extra_bytes and cfg.device.type == "cuda":
            free_memory(cfg.device)
            reason = too_large_to_capture(extra_bytes, torch.cuda.mem_get_info(cfg.device)[0])
            if reason:
                return {"gpu_ms": None, "gpu_ms_error": reason}
        return {"gpu_ms": graph_ms(fn, cfg.device, min(cfg.rep_ms, 50.0), grad_to_none=grads)}
    except Exception as exc:  # noqa: BLE001 - the row's call time stands
        return {"gpu_ms": None, "gpu_ms_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    finally:  # a freed graph's memory pool stays cached until emptied, and later captures would run out
        free_memory(cfg.device)


def run_provider(prov: Provider, j: Jagged, ref: torch.Tensor, cfg: RunConfig, modes, base: dict) -> list[dict]:
    rows = {m: dict(base, provider=prov.name, mode=m, status="pending", wall_s=0.0) for m in modes}

    def settle(status: str, msg: str | None = None):
        for r in rows.values():
            if r["status"] == "pending":
                r["status"] = status
                if msg:
                    r["error"] = msg[:400]

    reason = prov.skip(j, cfg)
    if reason:
        settle(reason)
        return list(rows.values())
    t0, prep = time.monotonic(), None
    try:
        prep = prov.prepare(j, cfg)
        with torch.no_grad():
            out = prep.fwd()
            err = rel_err(prep.to_ref(out), ref)
            del out
        for r in rows.values():
            r["rel_err"] = None if math.isinf(err) else err
        if not err <= CHECK_TOL[j.q.dtype]:
            settle("FAILED", f"||out - ref|| / ||ref|| = {err:.3g} > {CHECK_TOL[j.q.dtype]:g}")
        for m in modes:
            if rows[m]["status"] != "pending":
                continue
            if m != "fwd" and not prov.backward:
                rows[m]["status"] = "n/a (forward only)"
                continue
            try:
                rows[m].update(_time_mode(prep, m, cfg, prov.no_graph))
            except Exception as exc:  # noqa: BLE001 - a provider's failure is a row, not a crash
                rows[m].update(status=_status_of(exc), error=str(exc)[:400])
                free_memory(cfg.device)
    except Exception as exc:  # noqa: BLE001
        settle(_status_of(exc), f"{type(exc).__name__}: {exc}")
    finally:
        del prep
        free_memory(cfg.device)
        if prov.name == "flex_packed":
            cfg.flex_spent_s += time.monotonic() - t0
    for r in rows.values():
        r["wall_s"] = round(time.monotonic() - t0, 3)
    return list(rows.values())


def _add_metrics(rows: list[dict], work: Callable[[str], tuple[float | None, float | None]]) -> None:
    """Useful TFLOP/s or GB/s, and each row's time and memory relative to ours."""
    ours = {r["mode"]: r for r in rows if r["provider"] == OURS and r["status"] == "ok"}
    for r in rows:
        (flops, nbytes), ms, o = work(r["mode"]), r.get("ms"), ours.get(r["mode"])
        ok = r["status"] == "ok" and o is not None
        r.update(flops=flops, bytes_moved=nbytes, tflops=flops / ms / 1e9 if flops and ms else None,
                 gbps=nbytes / ms / 1e6 if nbytes and ms else None, ours_speedup=r["ms"] / o["ms"] if ok else None,
                 ours_mem_ratio=r["peak_bytes"] / o["peak_bytes"] if ok and r.get("peak_bytes") and o.get("peak_bytes")
                 else None)


def _fmt_row(r: dict) -> str:
    ms = f"{r['ms']:.4g} ms" if r.get("ms") is not None else "-"
    mem = f"{r['peak_bytes'] / MiB:.0f} MiB" if r.get("peak_bytes") is not None else "mem n/a"
    rate = f"{r['tflops']:.1f} TFLOP/s" if r.get("tflops") else (f"{r['gbps']:.0f} GB/s" if r.get("gbps") else "")
    rel = f"x{r['ours_speedup']:.2f}" if r.get("ours_speedup") and r["provider"] != OURS else ""
    name = r["provider"] if not r.get("op") else f"{r['op']}:{r['provider']}"
    return f"  {name:<38} {r['mode']:<8} {ms:>12} {mem:>11} {rate:>16} {rel:>8}  {r['status']}"


def _base(kind: str, suite: str, shape: Shape, j: Jagged | None, op: str | None = None) -> dict:
    return {"kind": kind, "suite": suite, "op": op, "shape_id": shape.id, "shape": shape.as_dict(),
            "tokens": j and j.T, "max_len": j and j.max_len}


def provider_names() -> set[str]:
    names = {p.name for p in ATTENTION_PROVIDERS + DENSE_ATTENTION_PROVIDERS}
    return names | {p.name for op in OPS for p in op.providers}


def _select(providers: list[Provider], cfg: RunConfig) -> list[Provider]:
    return [p for p in providers if cfg.providers is None or p.name == OURS or p.name in cfg.providers]


def _cases(kind: str, j: Jagged, cfg: RunConfig):
    """(op, providers, reference, modes, work) for each case of one shape."""
    s = j.shape
    if kind == "attention":
        work = lambda m: (attention_flops(j.lengths, s.H, s.D, m), None)  # noqa: E731
        yield None, _select(ATTENTION_PROVIDERS, cfg), reference_self_attention, cfg.modes, work
    elif kind == "dense_attention":
        work = lambda m: (dense_attention_flops(j.lengths, s.Tq, s.H, s.D, m), None)  # noqa: E731
        yield None, _select(DENSE_ATTENTION_PROVIDERS, cfg), reference_dense_attention, cfg.modes, work
    else:
        for op in OPS:
            j.extra = op.make_inputs(j)
            work = lambda m, op=op: (op.flops(j) if op.flops else None, op.bytes_moved(j) if op.bytes_moved else None)
            yield op.name, _select(op.providers, cfg), op.reference, ("fwd",), work
            j.extra = {}
            free_memory(cfg.device)


def run_kind(kind: str, suite: str, cfg: RunConfig, on_shape: Callable[[list[dict]], None] | None = None) -> list[dict]:
    shapes = get_suite(kind, suite, cfg.max_shapes)
    all_rows: list[dict] = []
    for i, shape in enumerate(shapes):
        print(f"[{kind}/{suite} {i + 1}/{len(shapes)}] {shape.id}", end="", flush=True)
        if cfg.past_deadline():
            print("  skipped (deadline)", flush=True)
            all_rows.append(dict(_base(kind, suite, shape, None), provider="*", mode="*", status="skipped (deadline)"))
            continue
        torch.manual_seed(cfg.seed)
        j = make_jagged(shape, cfg.device, cfg.dtype, cfg.seed, per_head=kind != "ops")
        print(f"  T={j.T:,} max_len={j.max_len}", flush=True)
        shape_rows: list[dict] = []
        for op, providers, reference, modes, work in _cases(kind, j, cfg):
            try:
                ref = reference(j)
            except Exception as exc:  # noqa: BLE001 - no reference: nothing can be checked
                print(f"  reference failed: {type(exc).__name__}: {exc}", flush=True)
                ref = torch.full((1,), float("nan"), device=cfg.device)
            case_rows: list[dict] = []
            for prov in providers:
                case_rows += run_provider(prov, j, ref, cfg, modes, _base(kind, suite, shape, j, op))
            del ref
            _add_metrics(case_rows, work)
            for r in case_rows:
                print(_fmt_row(r), flush=True)
            shape_rows += case_rows
        del j
        free_memory(cfg.device)
        all_rows += shape_rows
        if on_shape is not None:
            on_shape(all_rows)
    sys.stdout.flush()
    return all_rows
