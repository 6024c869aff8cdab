"""Where a result was produced: the code's commit and the device's name. One implementation for
the trainer's MLflow tags, the profile, the DDP reports and the kernel benchmarks."""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import os
import platform
import re
import subprocess
import tokenize
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


def code_text(source: str) -> str:
    """Python source without its comments, docstrings, blank lines and trailing spaces: what runs.
    Positions come from the tokenizer (comments) and the parse tree (docstrings), which agree
    across Python versions, so two machines give one text for one code."""
    lines = source.splitlines()
    cut: list[tuple[int, int, int, int]] = []  # (first line, column, last line, end column), 1-based lines
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            cut.append((*tok.start, *tok.end))
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            d = body[0]
            cut.append((d.lineno, d.col_offset, d.end_lineno, d.end_col_offset))
    for l0, c0, l1, c1 in sorted(cut, reverse=True):  # from the end: earlier positions stay valid
        head, tail = lines[l0 - 1][:c0], lines[l1 - 1][c1:]
        lines[l0 - 1:l1] = [head + tail]
    return "\n".join(line.rstrip() for line in lines if line.strip())


@functools.lru_cache(maxsize=None)
def kernel_code(torch_version: str | None = None, triton_version: str | None = None) -> str:
    """12 hex digits of the kernels' code (kernels/*.py but this module and the bench, as
    `code_text`: comments and docstrings may change) and the torch and triton versions (default:
    the installed ones): what a kernel's timing depends on besides the GPU. Unlike a commit id it
    ignores every other file and is the same on a machine without .git."""
    h = hashlib.sha256()
    for path in sorted((REPO_ROOT / "kernels").glob("*.py")):
        if path.name != "runenv.py":
            h.update(f"{path.name}\n{code_text(path.read_text())}\n".encode())
    if triton_version is None:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = ""
    if triton_version:
        h.update(f"triton {triton_version}".encode())
    h.update(f"torch {torch_version or torch.__version__}".encode())
    return h.hexdigest()[:12]


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


def device_slug(name: str | None = None) -> str:
    """A GPU's name as a file-name part: 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; a name
    starting with 'CPU', or no name and no CUDA device -> 'cpu'."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if name.lower().startswith("cpu"):
        return "cpu"
    s = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"
