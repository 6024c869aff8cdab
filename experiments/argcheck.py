"""Would ``python -m pipeline fit`` accept these arguments? Asked without starting a process.

The sweep asks for every point before it runs any (and ``--dry-run`` shows the answer): a grid
value of the wrong type or an unknown key is an error of the ablation file, not a run that
fails later. Only the parser is consulted (types, keys, config files): what needs the data or
the tracking store is the fit's own pre-flight.
"""

from __future__ import annotations

import contextlib
import io
import warnings

from jsonargparse import ArgumentError

_PARSER = None  # the fit CLI's parser, built once per process (a second or so)


class _Parsed(Exception):
    pass


def _parser():
    global _PARSER
    if _PARSER is None:
        from pipeline.cli import RankerCLI

        class ParseOnly(RankerCLI):
            def parse_arguments(self, parser, args) -> None:
                global _PARSER
                _PARSER = parser
                raise _Parsed

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # LightningCLI warns about args beside sys.argv
                ParseOnly(args=["fit"], run=True)
        except _Parsed:
            pass
    return _PARSER


def fit_args_error(args: list[str]) -> str | None:
    """None if the fit parser accepts `args` (what follows ``fit``), else its error message."""
    parser = _parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(["fit", *args])
    except ArgumentError as error:  # the fit parser raises its errors (exit_on_error=False)
        return "error: " + " ".join(str(error).split())[:500]
    except SystemExit:
        lines = [ln.strip() for ln in err.getvalue().splitlines() if ln.strip()]
        found = [ln for ln in lines if ln.startswith("error:")] or lines[-1:] or ["rejected by the fit parser"]
        return found[0][:500]
    return None
