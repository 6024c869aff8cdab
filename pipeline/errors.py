"""The one error type of the pipeline's pre-flight checks, and the commands' handling of it."""

from __future__ import annotations

import functools
import sys


class ConfigError(ValueError):
    """A configuration, data set or tracking server that cannot work; the message says what to fix.

    Raised before training starts; the CLI prints the message alone (no traceback) and exits 2.
    """


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
