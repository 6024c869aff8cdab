"""Where a result came from: GPU, versions, commit, date. Stamped on every JSON, table and plot."""

from __future__ import annotations

import ast
import datetime as _dt
import functools
import hashlib
import io
import platform
import tokenize

import torch

from pipeline.runenv import REPO_ROOT, device_name, git_commit


def code_text(source: str) -> str:
    """Python source without its comments, docstrings, blank lines and trailing spaces: what runs
    (positions from the tokenizer and the parse tree, which agree across Python versions)."""
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
    """12 hex digits of kernels/*.py as `code_text` and the torch and triton versions (default: the
    installed ones): what a kernel's timing depends on besides the GPU, the same without .git."""
    h = hashlib.sha256()
    for path in sorted((REPO_ROOT / "kernels").glob("*.py")):
        h.update(f"{path.name}\n{code_text(path.read_text())}\n".encode())
    triton_version = _triton_version() if triton_version is None else triton_version
    if triton_version:
        h.update(f"triton {triton_version}".encode())
    h.update(f"torch {torch_version or torch.__version__}".encode())
    return h.hexdigest()[:12]


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return ""
    return triton.__version__


def make_stamp(device: torch.device, commit: str | None = None) -> dict:
    from kernels import _launch_configs
    from kernels.launch_table import describe, device_slug

    cuda = device.type == "cuda"
    name = device_name(device) if cuda else "CPU: " + device_name(device)
    return {
        "gpu": name,
        "gpu_slug": device_slug(name),
        "torch": torch.__version__,
        "triton": _triton_version() or "absent",
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "commit": git_commit(commit, short=True),
        "kernel_code": kernel_code(),  # kernels/*.py + torch + triton: timings of another code are stale
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        # the launch configs the kernels ran with: a measured table's picks, or the hand rules
        "launch_table": describe(_launch_configs.current_table() if cuda else None),
    }


def stamp_line(st: dict) -> str:
    return (f"{st['gpu']} · torch {st['torch']} · triton {st['triton']} · CUDA {st['cuda']} · commit {st['commit']} · "
            f"{st['date']}" + (f" · launch table {st['launch_table']}" if st.get("launch_table") else ""))
