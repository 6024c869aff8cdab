"""User embeddings learned offline from long histories (ALURE), served a little stale to the ranker.

    python -m pipeline.user_embeddings fit --data data/timeline [--cutoff-day D] [--max-seq-len 4096] [--out ENC.pt]
    python -m pipeline.user_embeddings export --data data/timeline --encoder ENC.pt --out FILE [--as-of all|DAY]

fit trains the encoder (:mod:`models.user_encoder`) on the impressions of the days before the
cut-off, export writes each user's embedding as of each day (:mod:`pipeline.user_features`); both
log to MLflow (experiment ``user-embeddings``; export continues the encoder's run). How and why:
docs/training.md#the-user-encoder. Errors are one line and exit 2; Ctrl-C/SIGTERM end the run KILLED.
"""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"error: {message}; `{self.prog} --help` lists the options", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(allow_abbrev=False, prog="python -m pipeline.user_embeddings", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", allow_abbrev=False, help="train the user encoder on the days before a cut-off")
    f.add_argument("--data", required=True, help="a timeline data set (python -m data_gen generate --preset timeline)")
    f.add_argument("--out", default=None, help="encoder checkpoint (default DATA/user_embeddings/encoder-L<len>-d<dim>.pt)")
    f.add_argument("--cutoff-day", type=int, default=None, help="train on impressions of the days before it "
                   "(default: the first validation day)")
    f.add_argument("--max-seq-len", type=_positive, default=4096, help="most recent history items the encoder reads")
    f.add_argument("--dim", type=_positive, default=64, help="user embedding width")
    f.add_argument("--embed-dim", type=_positive, default=64)
    f.add_argument("--num-heads", type=_positive, default=2)
    f.add_argument("--num-layers", type=_count, default=2)
    f.add_argument("--batch-size", type=_positive, default=256)
    f.add_argument("--lr", type=_rate, default=1e-3)
    f.add_argument("--epochs", type=_positive, default=1)
    f.add_argument("--max-steps", type=_count, default=0, help="stop after this many steps (0: the epochs)")
    f.add_argument("--log-every", type=_positive, default=100, help="steps between progress lines")
    f.add_argument("--seed", type=_count, default=0)
    f.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    e = sub.add_parser("export", allow_abbrev=False, help="write the embeddings as of each day (Parquet + manifest)")
    e.add_argument("--data", required=True, help="the timeline data set the encoder was trained on")
    e.add_argument("--encoder", required=True, help="checkpoint written by fit")
    e.add_argument("--out", required=True, help="the Parquet file (its manifest goes to OUT.json)")
    e.add_argument("--as-of", default="all", help="'all' (daily: one row per user and day with impressions, as of "
                   "the next day) or a day d (every user's embedding as of day d)")
    e.add_argument("--batch-size", type=_positive, default=512)
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit:  # --help (0) or a bad argument (2, said in one line)
        return int(exit.code or 0)
    from pipeline import encoder  # Lightning, torch, MLflow: seconds of imports, not for --help
    from pipeline.tracking import run_command

    return run_command(lambda: (encoder.fit if args.cmd == "fit" else encoder.export)(args))


if __name__ == "__main__":
    raise SystemExit(main())
