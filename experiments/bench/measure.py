"""Timing, peak memory, the output check and the device ceilings.

Timing: ``triton.testing.do_bench`` on CUDA (CUDA events, L2 flushed, median; the first call,
Triton's compile, is never timed), a host clock on the CPU; ``graph_ms`` the same call replayed
as a CUDA graph (the kernels alone). Peak memory (CUDA): the inputs' bytes plus the peak
allocated during one call beyond what was allocated before it."""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Callable, Iterable

import torch


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (isinstance(exc, RuntimeError)
                                                            and "out of memory" in str(exc).lower())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":  # on the CPU nothing is measured, and gc.collect() costs time
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def clear_grads(tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    storages = (t.untyped_storage() for t in tensors if t is not None)
    return sum({st.data_ptr(): st.nbytes() for st in storages}.values())


def bench_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float, rep_ms: float,
             grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of `fn()`; gradients of `grad_to_none` are reset before each run."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                             return_mode="median"))
    return _cpu_bench(fn, warmup_ms, rep_ms, grad_to_none or [])


def graph_ms(fn: Callable[[], object], device: torch.device, rep_ms: float,
             grad_to_none: list[torch.Tensor] | None = None) -> float | None:
    """Median milliseconds of `fn()` replayed as a CUDA graph (``do_bench_cudagraph``: no host time,
    no launch gaps: the kernels' own time); None off CUDA."""
    if device.type != "cuda":
        return None
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))


def _cpu_bench(fn, warmup_ms: float, rep_ms: float, grads: list[torch.Tensor]) -> float:
    def timed() -> float:
        clear_grads(grads)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    timed()  # the first call
    est_ms = max(timed(), 1e-3)
    for _ in range(int(warmup_ms / est_ms)):
        timed()
    return statistics.median([timed() for _ in range(max(5, min(1000, int(rep_ms / est_ms))))])


def peak_extra_bytes(fn: Callable[[], object], device: torch.device, grads: list[torch.Tensor]) -> int | None:
    """Peak bytes allocated during one `fn()` beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    clear_grads(grads)
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    clear_grads(grads)
    return max(0, peak - base)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (inf on a shape mismatch or a non-finite value)."""
    if out.shape != ref.shape:
        return math.inf
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    num = float(torch.linalg.vector_norm(out64 - ref64))
    den = float(torch.linalg.vector_norm(ref64))
    return num / den if den > 0 else num


# ||out - ref|| / ||ref|| allowed against the fp32 reference (bf16 operands land between 1e-3 and 1e-2)
CHECK_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-3, torch.float64: 1e-6}


def measure_ceilings(device: torch.device, dtype: torch.dtype, warmup_ms: float, rep_ms: float) -> dict:
    """Device copy bandwidth (bytes read + written) and dense matmul rate, measured here."""
    small = device.type != "cuda"
    n_bytes = (8 << 20) if small else (1 << 30)
    src = torch.randn(n_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, warmup_ms, rep_ms)
    copy_gbps = 2 * n_bytes / (ms * 1e-3) / 1e9
    del src, dst
    n = 256 if small else 8192
    mdtype = torch.float32 if small else dtype
    a, b = (torch.randn(n, n, device=device, dtype=mdtype) for _ in range(2))
    mm_tflops = 2 * n**3 / (bench_ms(lambda: a @ b, device, warmup_ms, rep_ms) * 1e-3) / 1e12
    del a, b
    free_memory(device)
    return {"copy_gbps": copy_gbps, "copy_bytes": 2 * n_bytes, "matmul_tflops": mm_tflops,
            "matmul_shape": [n, n, n], "matmul_dtype": str(mdtype).replace("torch.", "")}
