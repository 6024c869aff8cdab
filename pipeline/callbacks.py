"""Speed and memory of a run, measured where the numbers mean something.

:class:`PerfMonitor` logs, through the trainer's loggers:

- ``perf/train_examples_per_s``, ``perf/train_tokens_per_s`` (real history items, no padding),
  ``perf/step_time_ms``, ``perf/steady_steps``: over the steady-state training steps only; the
  first ``warmup_steps`` (compilation, autotuning, allocator growth) and validation are excluded.
  The GPU is synchronised only where the clock starts and stops, never per step.
- ``mem/{train,val,test}_peak_allocated_mb`` and ``..._reserved_mb`` on CUDA:
  ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after a reset at each phase start.
- ``mem/peak_rss_mb``: the process's peak resident memory (CPU and GPU machines alike).
"""

from __future__ import annotations

import resource
import sys
import time

import pytorch_lightning as pl
import torch

_MB = 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / _MB if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux


class PerfMonitor(pl.Callback):
    """Args:
    warmup_steps: training steps excluded from the throughput window (per fit call).
    """

    def __init__(self, warmup_steps: int = 20):
        if warmup_steps < 0:
            raise ValueError(f"perf.warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self._seen = 0  # training steps seen in this process
        self._t0: float | None = None
        self._elapsed = 0.0
        self._steps = self._examples = self._tokens = 0
        self._peaks: dict[str, tuple[int, int]] = {}

    # --- throughput --------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None and self._seen >= self.warmup_steps:
            _sync(pl_module.device)
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._seen += 1
        if self._t0 is not None:
            self._steps += 1
            self._examples += int(batch["label"].shape[0])
            self._tokens += int(batch["n_tokens"])

    def _pause(self, pl_module) -> None:
        if self._t0 is not None:
            _sync(pl_module.device)
            self._elapsed += time.perf_counter() - self._t0
            self._t0 = None

    def throughput(self) -> dict[str, float]:
        if self._steps == 0 or self._elapsed <= 0:
            return {}
        return {
            "perf/train_examples_per_s": self._examples / self._elapsed,
            "perf/train_tokens_per_s": self._tokens / self._elapsed,
            "perf/step_time_ms": 1000.0 * self._elapsed / self._steps,
            "perf/steady_steps": float(self._steps),
        }

    # --- memory ------------------------------------------------------------------------
    def _reset_peak(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def _record_peak(self, phase: str, pl_module) -> None:
        if pl_module.device.type != "cuda":
            return
        alloc = torch.cuda.max_memory_allocated(pl_module.device)
        reserved = torch.cuda.max_memory_reserved(pl_module.device)
        old = self._peaks.get(phase, (0, 0))
        self._peaks[phase] = (max(old[0], alloc), max(old[1], reserved))

    def memory(self, phases: tuple[str, ...]) -> dict[str, float]:
        out = {"mem/peak_rss_mb": peak_rss_mb()}
        for phase in phases:
            if phase in self._peaks:
                alloc, reserved = self._peaks[phase]
                out[f"mem/{phase}_peak_allocated_mb"] = alloc / _MB
                out[f"mem/{phase}_peak_reserved_mb"] = reserved / _MB
        return out

    # --- phases ------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._reset_peak(pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":  # validation inside fit: stop the training clock
            self._pause(pl_module)
            self._record_peak("train", pl_module)
        self._reset_peak(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._record_peak("val", pl_module)
        self._reset_peak(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._pause(pl_module)
        self._record_peak("train", pl_module)
        _log(trainer, {**self.throughput(), **self.memory(("train", "val"))})

    def on_test_start(self, trainer, pl_module) -> None:
        self._reset_peak(pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._record_peak("test", pl_module)
        _log(trainer, self.memory(("test",)))


def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
