"""Where a result came from: GPU, versions, commit, date. Stamped on every JSON, table and plot."""

from __future__ import annotations

import datetime as _dt
import platform
import re

import torch

from kernels.runenv import git_commit


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; any CPU -> 'cpu'."""
    if name.lower().startswith("cpu"):
        return "cpu"
    s = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


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
