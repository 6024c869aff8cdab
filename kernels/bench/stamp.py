"""Where a result came from: GPU, versions, commit, date. Stamped on every JSON, table and plot."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess

import torch


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


def git_commit(explicit: str | None = None) -> str:
    """--commit, else $GIT_COMMIT, else `git rev-parse` (+ '-dirty'), else 'unknown'.

    The GPU machine gets a copy of the working tree without .git: pass the commit there.
    """
    if explicit:
        return explicit
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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
        "commit": git_commit(commit),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def stamp_line(st: dict) -> str:
    return (
        f"{st['gpu']} · torch {st['torch']} · triton {st['triton']} · CUDA {st['cuda']} · "
        f"commit {st['commit']} · {st['date']}"
    )
