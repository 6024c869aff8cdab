"""A profile of the real training loop (``pipeline fit --perf.trace_steps [first, count]``).

Two windows of ``count`` steps from the process's step ``first``: ``torch.profiler`` writes
``loop_trace.json.gz`` (chrome://tracing, ui.perfetto.dev), ``loop_ops.txt`` and
``loop_summary.json`` (per step: wall and device-busy time, launches, attention's time and share,
and :func:`busy_split`'s compute, NCCL, exposed NCCL and idle device time); then ``cProfile`` writes
``loop_python.txt``. Files go to ``trace_dir`` (``rank<k>/`` in it for each of several processes)
and the run's ``trace/``.
Attention is only seen in eager steps: a CUDA-graph replay or a compiled step hides its ranges.
"""

from __future__ import annotations

import cProfile
import gzip
import io
import json
import logging
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pipeline.runenv import device_name, git_commit

log = logging.getLogger(__name__)
ATTENTION_RANGES = ("attention/self", "attention/target")  # models.attention's record_function ranges
_BACKWARD_SCOPE = 1  # at::RecordScope::BACKWARD_FUNCTION


def attention_us(events, cuda: bool) -> tuple[float, float, int]:
    """(forward, backward) microseconds inside attention and the number of forward ranges seen:
    the ranges' GPU kernel time on CUDA, their CPU time otherwise, and the backward autograd nodes
    of the ops inside them (linked by sequence number and forward thread), nesting counted once."""
    t = (lambda e: e.device_time_total) if cuda else (lambda e: e.cpu_time_total)
    cpu = [e for e in events if e.device_type.name == "CPU"]
    ranges = [e for e in cpu if e.name in ATTENTION_RANGES]
    links, todo = set(), [c for r in ranges for c in r.cpu_children]
    while todo:
        e = todo.pop()
        todo += e.cpu_children
        if e.sequence_nr >= 0:
            links.add((e.sequence_nr, e.thread))
    bwd = [e for e in cpu if getattr(e, "scope", 0) == _BACKWARD_SCOPE and e.fwd_thread is not None
           and (e.sequence_nr, e.fwd_thread) in links]
    chosen = {id(e) for e in bwd}

    def nested(e) -> bool:
        p = e.cpu_parent
        while p is not None and id(p) not in chosen:
            p = p.cpu_parent
        return p is not None

    return sum(t(e) for e in ranges), sum(t(e) for e in bwd if not nested(e)), len(ranges)


def busy_split(kernels: list[tuple[str, float, float]], wall_us: float) -> dict[str, float]:
    """Device time of (name, start, end) kernel spans: compute (non-NCCL kernels' union), comm (NCCL
    kernels' union), exposed comm (NCCL time under no compute kernel) and idle (wall minus the union
    of all: the step waiting on its host), in the spans' unit."""
    def union(spans):
        total, end = 0.0, float("-inf")
        for a, b in sorted(spans):
            total, end = total + max(0.0, b - max(a, end)), max(end, b)
        return total
    comm = [(a, b) for n, a, b in kernels if "nccl" in n.lower()]
    compute = [(a, b) for n, a, b in kernels if "nccl" not in n.lower()]
    every = union(comm + compute)
    return {"compute": union(compute), "comm": union(comm), "exposed_comm": every - union(compute),
            "idle": max(0.0, wall_us - every)}


class LoopTrace:
    def __init__(self, steps: list[int], out_dir: str | None = None):
        if len(steps) != 2 or steps[0] < 0 or steps[1] < 1:
            raise ValueError(f"perf.trace_steps must be [first >= 0, count >= 1], got {steps}")
        self.first, self.count = int(steps[0]), int(steps[1])
        self.out_dir = out_dir
        self._prof: profile | None = None
        self._py: cProfile.Profile | None = None
        self._t0 = 0.0
        self._summary: dict = {}

    def _sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step_start(self, step: int, device: torch.device) -> None:
        if step == self.first:
            self._sync(device)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        elif step == self.first + self.count:
            self._sync(device)
            self._py = cProfile.Profile()
            self._t0 = time.perf_counter()
            self._py.enable()

    def step_end(self, step: int, device: torch.device, trainer) -> None:
        if step == self.first + self.count - 1 and self._prof is not None:
            self._sync(device)
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self._write_profiler(self._prof, wall, device, trainer)
            self._prof = None
        elif step == self.first + 2 * self.count - 1 and self._py is not None:
            self._py.disable()
            self._sync(device)
            wall = time.perf_counter() - self._t0
            self._write_python(self._py, wall, trainer)
            self._py = None

    # ---- outputs ---------------------------------------------------------------------------
    def _dir(self, trainer) -> Path:
        path = Path(self.out_dir or Path(trainer.default_root_dir) / "traces")
        path = path / f"rank{trainer.global_rank}" if trainer.world_size > 1 else path
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _write_profiler(self, prof: profile, wall_s: float, device: torch.device, trainer) -> None:
        out = self._dir(trainer)
        events = prof.events()
        device_events = [e for e in events if e.device_type.name != "CPU"
                         and not getattr(e, "is_user_annotation", False)]
        launches = sum(1 for e in events if e.device_type.name == "CPU"
                       and e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                      "cuLaunchKernelEx", "cudaGraphLaunch"))
        busy_us = sum(e.self_device_time_total for e in device_events)
        fwd_us, bwd_us, ranges = attention_us(events, device.type == "cuda")
        per_step = (lambda us: us / 1000.0 / self.count) if ranges else (lambda us: None)
        attn_ms, bwd_ms = per_step(fwd_us + bwd_us), per_step(bwd_us)
        wall_ms = 1000.0 * wall_s / self.count
        self._summary = {
            "steps": self.count, "first_step": self.first, "device": str(device),
            "device_name": device_name(device), "commit": git_commit(),
            "attention": (getattr(trainer.lightning_module, "hparams", {}).get("ranker") or {}).get("attention"),
            "batch_size": getattr(trainer.datamodule, "batch_size", None),
            "wall_ms_per_step": wall_ms,
            "device_busy_ms_per_step": busy_us / 1000.0 / self.count,
            "launches_per_step": launches / self.count,
            # what a step spends in attention, of its wall time (null: no attention range was seen)
            "attention_ms_per_step": attn_ms, "attention_bwd_ms_per_step": bwd_ms,
            "attention_share": None if attn_ms is None else attn_ms / wall_ms,
            **{f"{k}_ms_per_step": v / 1000.0 / self.count for k, v in busy_split(
                [(e.name, e.time_range.start, e.time_range.end) for e in device_events], 1e6 * wall_s).items()},
        }
        cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        text = f"# {self.count} steps from step {self.first}: {json.dumps(self._summary)}\n\n"
        text += "## by self CPU time (host)\n" + cpu_table
        if device.type == "cuda":
            text += "\n\n## by self device time\n" + prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=40)
        (out / "loop_ops.txt").write_text(text)
        (out / "loop_summary.json").write_text(json.dumps(self._summary, indent=1) + "\n")
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(out / "loop_trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        self._log(trainer, out, ("loop_ops.txt", "loop_summary.json", "loop_trace.json.gz"))
        log.info("loop profile of %d steps written to %s: %s", self.count, out, self._summary)

    def _write_python(self, py: cProfile.Profile, wall_s: float, trainer) -> None:
        out = self._dir(trainer)
        buf = io.StringIO()
        buf.write(f"# cProfile of {self.count} steps from step {self.first + self.count}: "
                  f"{1000.0 * wall_s / self.count:.2f} ms per step under the profiler\n\n")
        stats = pstats.Stats(py, stream=buf)
        buf.write("## by own time (tottime)\n")
        stats.sort_stats("tottime").print_stats(45)
        buf.write("\n## by cumulative time\n")
        stats.sort_stats("cumulative").print_stats(60)
        (out / "loop_python.txt").write_text(buf.getvalue())
        self._log(trainer, out, ("loop_python.txt",))

    @staticmethod
    def _log(trainer, out: Path, names: tuple[str, ...]) -> None:
        for logger in trainer.loggers:
            run_id = getattr(logger, "run_id", None)
            log_fn = getattr(getattr(logger, "experiment", None), "log_artifact", None)
            if run_id and log_fn is not None:
                for name in names:
                    log_fn(run_id, str(out / name), "trace")
