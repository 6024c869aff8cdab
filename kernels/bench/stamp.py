"""Where a result came from: GPU, versions, commit, date. Stamped on every JSON, table and plot."""

from __future__ import annotations

import datetime as _dt
import platform

import torch

from kernels.runenv import device_name, device_slug, git_commit, kernel_code


def make_stamp(device: torch.device, commit: str | None = None) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    from kernels import _launch_configs
    from kernels.launch_table import describe

    cuda = device.type == "cuda"
    name = device_name(device) if cuda else "CPU: " + device_name(device)
    return {
        "gpu": name,
        "gpu_slug": device_slug(name),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "commit": git_commit(commit, short=True),
        "kernel_code": kernel_code(),  # kernels/*.py + torch + triton: timings of another code are stale
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        # the launch configs the kernels ran with: a measured table's picks, or the hand rules
        "launch_table": describe(_launch_configs.current_table() if cuda else None),
    }


def stamp_line(st: dict) -> str:
    return (
        f"{st['gpu']} · torch {st['torch']} · triton {st['triton']} · CUDA {st['cuda']} · "
        f"commit {st['commit']} · {st['date']}" + (f" · launch table {st['launch_table']}" if st.get("launch_table") else "")
    )
