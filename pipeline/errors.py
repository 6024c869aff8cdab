"""The error types of the pipeline's pre-flight checks (ConfigError) and of a run that cannot go on
(RunError), the commands' handling of the first and of a reader that goes away, and the check of an
output directory."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


class ConfigError(ValueError):
    """A configuration, data set or tracking server that cannot work; the message says what to fix.

    Raised before training starts; the CLI prints the message alone (no traceback) and exits 2."""


class RunError(RuntimeError):
    """A run that cannot go on for a reason its message says (the run FAILED, exit status 1)."""


def command(main):
    """A command's ``main(argv) -> exit status``: a ConfigError raised anywhere in it is printed
    alone on stderr (``error: <message>``, no traceback) and the status is 2."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return run


def check_writable(option: str, path: str | None) -> None:
    """ConfigError unless files can be created in `path` (or where it would be created)."""
    target = Path(path or ".").resolve()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{option} {path}: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot write into {existing} ({err.strerror or err}); "
                          f"choose a writable directory with {option}") from None


class _Unread:
    """stdout or stderr whose reader may go away (``| head``): Python ignores SIGPIPE, so the next
    write would raise BrokenPipeError and fail a run that trains on; from the first broken pipe on
    its descriptor points at /dev/null and the command goes on."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def _call(self, name: str, *args):
        try:
            return getattr(self._stream, name)(*args)
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
            return 0

    def write(self, text: str) -> int:
        return self._call("write", text) or len(text)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def outliving_readers() -> Iterator[None]:
    """sys.stdout and sys.stderr outlive their readers while the block runs (see _Unread)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Unread(sys.stdout), _Unread(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
