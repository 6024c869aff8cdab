"""The lab: many runs of the library and the evidence they produce.

    python -m experiments <verb> [options]      # `python -m experiments --help` lists the verbs

Sweeps, ablations, reports, the results summary, reproduction, profiles, DDP and loader
measurements; `experiments.bench` (kernels against peers) and `experiments.tuning` (launch
configs). Imports the library (pipeline, models, kernels, data_gen); nothing there imports this."""

from __future__ import annotations

import argparse


def parser(verb: str, doc: str, **kwargs) -> argparse.ArgumentParser:
    """The parser of `python -m experiments <verb>`: no abbreviated options, the module docstring's
    first line as its description."""
    return argparse.ArgumentParser(allow_abbrev=False, prog=f"python -m experiments {verb}",
                                   description=doc.split("\n")[0], **kwargs)
