"""Where a result came from: GPU, versions, commit, date. Stamped on every JSON, table and plot."""

from __future__ import annotations

import datetime as _dt
import platform

import torch

from kernels.launch_table import slug  # noqa: F401  (one slug function: re-exported)
from kernels.runenv import git_commit


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def make_stamp(device: torch.device, commit: str | None = None) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    name = gpu_name(device)
    return {
        "gpu": name,
        "gpu_slug": slug(name),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "commit": git_commit(commit, short=True),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def stamp_line(st: dict) -> str:
    return (
        f"{st['gpu']} · torch {st['torch']} · triton {st['triton']} · CUDA {st['cuda']} · "
        f"commit {st['commit']} · {st['date']}"
    )
