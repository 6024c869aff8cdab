"""``fit --help`` without the wait: the CLI's help text cached under a key of what produces it.

The first ``--help`` of a subcommand writes it to ``$XDG_CACHE_HOME/jagged-attn/`` (default
``~/.cache``), keyed by the project's code and the versions of the packages that describe options;
later ones print it from there."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "pytorch-lightning", "jsonargparse", "mlflow-skinny", "mlflow")


def is_help_request(argv: list[str]) -> bool:
    """`fit --help` and the like: a subcommand and one help flag, nothing else."""
    return len(argv) == 2 and argv[0] in ("fit", "validate", "test") and argv[1] in ("--help", "-h")


def cache_key(argv: list[str]) -> str:
    h = hashlib.sha256(" ".join(argv).encode())
    for folder in ("pipeline", "models", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            h.update(f"{name}=={metadata.version(name)}".encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:24]


def cache_file(argv: list[str]) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jagged-attn" / f"help-{argv[0]}-{cache_key(argv)}.txt"


def print_help(argv: list[str], build) -> None:
    """Print the help of `argv` from the cache, or build it with `build()` (which prints it and
    exits 0, as argparse does) and cache what it printed."""
    path = cache_file(argv)
    if path.is_file():
        sys.stdout.write(path.read_text())
        raise SystemExit(0)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            build()
    except SystemExit as err:
        text = out.getvalue()
        sys.stdout.write(text)
        if err.code in (0, None) and text:
            with contextlib.suppress(OSError):  # a read-only home: no cache, same help
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(text)
                tmp.replace(path)
        raise
    sys.stdout.write(out.getvalue())
