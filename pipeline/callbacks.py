"""Callbacks of a run: speed and memory (:class:`PerfMonitor`, the ``perf.*`` options), Lightning's
progress bar and model summary made fit for jagged batches.

PerfMonitor logs ``perf/*`` (examples and tokens per second over the steady window after
``warmup_steps``, step times, host time in and between steps, warm-up and GC time), ``mem/*`` peaks
and the artifact ``perf/steps.csv``; global over processes in a distributed run. What each metric
means and how a step is timed without a device sync: docs/training.md#speed-and-memory."""

from __future__ import annotations

import gc
import io
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelSummary as LightningModelSummary
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.utilities.model_summary.model_summary import _format_summary_table

from pipeline.dist import all_gather, all_reduce, world_size
from pipeline.errors import RunError
from pipeline.trace import LoopTrace

_MB = 2**20
SETTLE_WINDOW = 10  # steps in each rolling median of perf/warmup_s
SETTLE_TOLERANCE = 0.10


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / _MB if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux


@dataclass
class _Step:
    start: object  # a CUDA event or a host time (s)
    end: object = None
    host_start: float = 0.0
    host_end: float = 0.0
    examples: int = 0
    tokens: int = 0
    epoch: int = 0
    next_start: object = None  # the next step's start mark, if nothing else ran in between
    host_next: float | None = None


class _Marks:
    """Start/end marks of steps: CUDA events on a GPU (read once completed), host time on CPU."""

    def __init__(self, device: torch.device, clock=time.perf_counter):
        self.cuda = device.type == "cuda"
        self.clock = clock

    def mark(self):
        if not self.cuda:
            return self.clock()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def done(self, mark) -> bool:
        return not self.cuda or mark.query()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else 1000.0 * (b - a)


def settle_steps(durations: np.ndarray, steady_median: float, window: int = SETTLE_WINDOW,
                 tolerance: float = SETTLE_TOLERANCE) -> int:
    """The first step k from which every rolling median of `window` steps stays within
    `tolerance` of `steady_median` (len(durations) if it never settles)."""
    n = len(durations)
    if n == 0:
        return 0
    w = min(window, n)
    rolling = np.array([np.median(durations[j:j + w]) for j in range(n - w + 1)])
    ok = np.abs(rolling - steady_median) <= tolerance * steady_median
    bad = np.flatnonzero(~ok)
    return 0 if bad.size == 0 else (int(bad[-1]) + 1 if bad[-1] + 1 < len(ok) else n)


class PerfMonitor(pl.Callback):
    """Speed and memory of the run (perf.* options; the metrics: docs/training.md#speed-and-memory).

    Args:
        warmup_steps: training steps excluded from the throughput window (per process).
        trace_steps: [first, count]: profile count steps of the real loop from process step first
            (torch.profiler, then cProfile over the next count); null: no profile.
        trace_dir: where the profile goes (default: <trainer.default_root_dir>/traces); also
            logged as artifacts of the run (trace/)."""

    def __init__(self, warmup_steps: int = 20, trace_steps: list[int] | None = None, trace_dir: str | None = None):
        if warmup_steps < 0:
            raise ValueError(f"perf.warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.trace = LoopTrace(trace_steps, trace_dir) if trace_steps else None
        self.clock = time.perf_counter
        self._marks: _Marks | None = None
        self._steps: list[_Step] = []  # not yet resolved
        self._rows: list[tuple] = []  # resolved: (ms, host_step_ms, host_gap_ms, examples, tokens, epoch)
        self._open: _Step | None = None  # the last step, while nothing else ran after it
        self._gc_s = 0.0
        self._gc_t0: float | None = None
        self._peaks: dict[str, tuple[int, int]] = {}

    # --- step marks ----------------------------------------------------------------------
    def _break(self) -> None:
        """Something other than a training step runs now: the last step ends at its own end mark."""
        self._open = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._marks is None:
            self._marks = _Marks(pl_module.device, self.clock)
        host, mark = self.clock(), self._marks.mark()
        if self._open is not None:
            self._open.next_start, self._open.host_next = mark, host
        step = _Step(start=mark, host_start=host, examples=int(batch["label"].shape[0]),
                     tokens=int(batch["n_tokens"]), epoch=trainer.current_epoch)
        self._steps.append(step)
        self._open = step
        if self.trace is not None:
            self.trace.step_start(len(self._rows) + len(self._steps) - 1, pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = self._steps[-1]
        step.end, step.host_end = self._marks.mark(), self.clock()
        if self.trace is not None:
            self.trace.step_end(len(self._rows) + len(self._steps) - 1, pl_module.device, trainer)
        if len(self._steps) >= 512:
            self._resolve(final=False)

    def _resolve(self, final: bool) -> None:
        """Turn completed marks into durations (all of them when `final`: after a sync)."""
        keep = []
        for i, s in enumerate(self._steps):
            nxt = s.next_start
            last = nxt if nxt is not None else s.end
            if keep or last is None or (s is self._open and not final) or not (final or self._marks.done(last)):
                keep.append(s)
                continue
            ms = self._marks.ms(s.start, last)
            gap = 1000.0 * (s.host_next - s.host_end) if s.host_next is not None else float("nan")
            self._rows.append((ms, 1000.0 * (s.host_end - s.host_start), gap, s.examples, s.tokens, s.epoch))
        self._steps = keep

    # --- the window --------------------------------------------------------------------------
    def table(self) -> np.ndarray:
        """[steps, 6]: ms, host_step_ms, host_gap_ms, examples, tokens, epoch (resolved steps)."""
        return np.array(self._rows, dtype=np.float64).reshape(-1, 6)

    def throughput(self) -> dict[str, float]:
        rows = self.table()
        window = rows[self.warmup_steps:]
        if len(window) == 0 or window[:, 0].sum() <= 0:
            return {}
        ms = window[:, 0]
        total_s = ms.sum() / 1000.0
        median = float(np.median(ms))
        k = settle_steps(rows[:, 0], median)
        out = {
            "perf/train_examples_per_s": window[:, 3].sum() / total_s,
            "perf/train_tokens_per_s": window[:, 4].sum() / total_s,
            "perf/step_time_ms": float(ms.mean()),
            "perf/step_time_median_ms": median,
            "perf/step_time_p90_ms": float(np.percentile(ms, 90)),
            "perf/steady_steps": float(len(window)),
            "perf/host_step_ms": float(np.median(window[:, 1])),
            "perf/gc_ms": 1000.0 * self._gc_s / len(window),
        }
        gaps = window[:, 2][np.isfinite(window[:, 2])]
        if gaps.size:
            out["perf/host_gap_ms"] = float(np.median(gaps))
        if k < len(rows):
            out["perf/warmup_s"] = float(rows[:k, 0].sum() / 1000.0)
        return out

    def global_throughput(self, device: torch.device) -> dict[str, float]:
        """Throughput over every process and the token balance of their batches; every process
        must call it, after the same number of steps."""
        window = self.table()[self.warmup_steps:]
        if len(window) == 0:
            return {}
        sums = all_reduce(torch.tensor([window[:, 3].sum(), window[:, 4].sum()], dtype=torch.float64, device=device))
        slowest = float(all_reduce(torch.tensor([window[:, 0].sum() / 1000.0], dtype=torch.float64, device=device),
                                   "max"))
        tokens = all_gather(torch.tensor(window[:, 4], dtype=torch.float64, device=device))  # [W, steps]
        ratio = tokens.max(dim=0).values / tokens.mean(dim=0).clamp(min=1.0)
        return {"perf/train_examples_per_s": float(sums[0]) / slowest,
                "perf/train_tokens_per_s": float(sums[1]) / slowest,
                "perf/rank_tokens_max_over_mean": float(ratio.mean()),
                "perf/rank_tokens_max_over_mean_worst": float(ratio.max())}

    def steps_csv(self) -> str:
        buf = io.StringIO()
        buf.write("step,epoch,ms,host_step_ms,host_gap_ms,examples,tokens,in_window\n")
        for i, (ms, hs, hg, ex, tok, ep) in enumerate(self._rows):
            buf.write(f"{i},{int(ep)},{ms:.4f},{hs:.4f},{hg:.4f},{int(ex)},{int(tok)},{int(i >= self.warmup_steps)}\n")
        return buf.getvalue()

    # --- garbage collection inside the window ----------------------------------------------
    def _gc_callback(self, phase: str, info: dict) -> None:
        if len(self._rows) + len(self._steps) <= self.warmup_steps:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_t0 = None

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

    def memory(self, phases: tuple[str, ...], device: torch.device | None = None) -> dict[str, float]:
        """Peak memory (the largest over the processes: every process must call it then)."""
        out = {"mem/peak_rss_mb": peak_rss_mb()}
        for phase in phases:
            if phase in self._peaks:
                alloc, reserved = self._peaks[phase]
                out[f"mem/{phase}_peak_allocated_mb"] = alloc / _MB
                out[f"mem/{phase}_peak_reserved_mb"] = reserved / _MB
        if world_size() > 1:
            peaks = all_reduce(torch.tensor(list(out.values()), dtype=torch.float64, device=device), "max")
            out = dict(zip(out, peaks.tolist()))
        return out

    # --- phases ------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._reset_peak(pl_module)
        gc.callbacks.append(self._gc_callback)
        left = trainer.estimated_stepping_batches - trainer.global_step  # this process's steps (inf: unknown)
        if self.trace is not None and self.trace.first + self.trace.count > left:
            logging.getLogger(__name__).warning("perf.trace_steps [%d, %d] ends past this run's %d steps: no trace "
                                                "is written", self.trace.first, self.trace.count, left)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._break()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._break()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._break()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._break()
        if trainer.state.fn == "fit":  # validation inside fit
            self._record_peak("train", pl_module)
        self._reset_peak(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._record_peak("val", pl_module)
        self._reset_peak(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._break()
        if self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        if self._steps:
            self._resolve(final=True)
        self._record_peak("train", pl_module)
        speed = self.throughput()
        if world_size() > 1:
            speed.update(self.global_throughput(pl_module.device))
        _log(trainer, {**speed, **self.memory(("train", "val"), pl_module.device)})
        if self._rows:
            log_text(trainer, self.steps_csv(), "perf/steps.csv")

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)

    def on_test_start(self, trainer, pl_module) -> None:
        self._reset_peak(pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._record_peak("test", pl_module)
        _log(trainer, self.memory(("test",), pl_module.device))


def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def log_text(trainer: pl.Trainer, text: str, artifact_file: str) -> None:
    """A text artifact in the run of every MLflow logger of the trainer."""
    for logger in trainer.loggers:
        run_id = getattr(logger, "run_id", None)
        log_fn = getattr(getattr(logger, "experiment", None), "log_text", None)
        if run_id and log_fn is not None:
            log_fn(run_id, text, artifact_file)


class RunChecks(pl.Callback):
    """Validation that would mislead fails the run instead: a NaN/inf training loss before validation
    logs metrics of that model, and a metric that EarlyStopping or the checkpoint monitors but that is
    undefined (NaN; val/auc on examples of one class) before it reaches them as a value."""

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and hasattr(pl_module, "check_finite_loss"):
            pl_module.check_finite_loss()  # every process calls it: a collective

    def on_validation_end(self, trainer, pl_module) -> None:
        for key in sorted({getattr(c, "monitor", None) for c in trainer.callbacks} - {None}):
            value = trainer.callback_metrics.get(key)
            if value is not None and math.isnan(float(value)):
                why = (": AUC needs examples of both classes and these validation examples hold one (the warning "
                       "above counts them)" if key.endswith("auc") else "")
                raise RunError(f"{key} is undefined (NaN) at step {trainer.global_step}{why}; EarlyStopping and "
                               f"checkpoint.monitor cannot compare it: validate on more examples "
                               f"(trainer.limit_val_batches, data.eval_batch_size) or monitor another metric")


class ProgressBar(TQDMProgressBar):
    """Lightning's progress bar, reading the last logged ``train/loss_step`` only when it redraws
    (a ``prog_bar=True`` value is read after every step: a device sync)."""

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        loss = trainer.callback_metrics.get("train/loss_step")
        if loss is not None:
            items["loss"] = f"{float(loss):.4f}"
        return items


class ModelSummary(LightningModelSummary):
    """Lightning's model summary without its FLOPs column, which reads 0 for a jagged batch."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops=0, **summarize_kwargs) -> None:
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      0, *columns)
        lines = [line for line in table.splitlines() if not line.rstrip().endswith("Total Flops")]
        logging.getLogger("pytorch_lightning.callbacks.model_summary").info("\n" + "\n".join(lines))
