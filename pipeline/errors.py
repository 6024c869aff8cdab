"""The error types of the pipeline's pre-flight checks (ConfigError) and of a run that cannot go on
(RunError), the commands' handling of the first, and the check of an output directory."""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path


class ConfigError(ValueError):
    """A configuration, data set or tracking server that cannot work; the message says what to fix.

    Raised before training starts; the CLI prints the message alone (no traceback) and exits 2.
    """


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
