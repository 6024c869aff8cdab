"""Where a result was produced: the code's commit, the device's name, a digest of files.
Used for MLflow tags and for the stamps of the lab's results."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _head() -> str:
    """HEAD of the repo ('-dirty' when tracked files differ), or 'unknown' without git."""
    try:
        run = functools.partial(subprocess.run, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        head = run(["git", "rev-parse", "--verify", "--quiet", "HEAD"])
        sha = head.stdout.strip() if head.returncode == 0 else ""
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip() if sha else ""
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if re.fullmatch(r"[0-9a-f]{40}", sha):
        return sha + ("-dirty" if dirty else "")
    return "unknown"


def files_digest(paths: list[Path], root: Path):
    """sha256 (a hashlib object, for more updates) over each file's path relative to `root` and
    its bytes, in the order given: a version of source code that holds without .git."""
    h = hashlib.sha256()
    for path in paths:
        h.update(f"{path.relative_to(root).as_posix()}\n".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h


def git_commit(explicit: str | None = None, short: bool = False) -> str:
    """`explicit` (a --commit flag), else $GIT_COMMIT (a copy of the code whose .git is absent or
    stale, e.g. on a remote GPU machine: pass `GIT_COMMIT=$(git rev-parse HEAD)`), else HEAD
    (12 characters when short), else 'unknown'."""
    if explicit:
        return explicit
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    head = _head()
    if short and head != "unknown":
        sha, dirty = head[:40], head[40:]
        return sha[:12] + dirty
    return head


def device_name(device: torch.device | None = None) -> str:
    """The CUDA device's name (`device`, default the first one when there is a GPU), else the
    CPU's model and core count."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", 0)
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return (platform.processor() or platform.machine()) + f" ({os.cpu_count()} cores)"

