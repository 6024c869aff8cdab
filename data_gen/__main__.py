"""Command line: `python -m data_gen generate|validate|report ...` (see --help).

Exit status: 0 on success, 1 for data that fails validation, 2 for bad arguments (all checked
before any work starts, an estimate of the output's size and time included) and for an output
directory that cannot be written (read-only, full): then no data set is left behind."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .config import PRESETS, ConfigError, DataConfig, option_pairs, resolve_config
from .schema import DataValidationError


def _config_help() -> str:
    import dataclasses

    keys = ", ".join(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(DataConfig))
    return ("Any config field can be overridden as --key value (dashes or underscores), "
            f"e.g. --rows 100000 --alpha 0.8 --max-len 4096. Fields: {keys}. "
            "See data_gen/config.py for their meaning and defaults.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m data_gen",
                                description="Synthetic long-tail sequence data for rankers.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", allow_abbrev=False, help="generate a data set", epilog=_config_help())
    g.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)}")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workers", type=int, default=None, help="processes (default: CPUs)")
    g.add_argument("--overwrite", action="store_true", help="replace a data set in --out")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser("validate", allow_abbrev=False, help="check a data set: files, checksums, schema, values")
    v.add_argument("data_dir")
    v.add_argument("--no-digest", action="store_true", help="skip the sha256 checks")
    v.add_argument("--shallow", action="store_true", help="footers only, not the values")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    r = sub.add_parser("report", allow_abbrev=False, help="length/popularity plots and a markdown summary")
    r.add_argument("data_dir")
    r.add_argument("--out", default=None, help="output directory (default DATA_DIR/report)")
    return p


def _generate(args: argparse.Namespace, extra: list[str]) -> None:
    cfg = resolve_config(args.preset, option_pairs(extra))
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    from .generate import check_room, generate_dataset  # after the argument checks: polars

    check_room(cfg, Path(args.out), args.workers)
    start = time.perf_counter()
    try:
        meta = generate_dataset(cfg, args.seed, args.out, preset=args.preset,
                                workers=args.workers, progress=not args.quiet,
                                overwrite=args.overwrite)
    except OSError as err:  # a read-only directory, a full disk: no data set was completed
        raise ConfigError(f"cannot write {err.filename or args.out}: {err.strerror or err}") \
            from None
    seconds = time.perf_counter() - start
    tr = meta["splits"]["train"]
    o = tr["oracle"]
    recent = ", ".join(f"last {k}: {o[f'auc_recent_{k}']:.3f}" for k in cfg.oracle_ks)
    rows = sum(split["rows"] for split in meta["splits"].values())
    print(f"wrote {rows:,} rows to {args.out} in {seconds:.1f} s; digest {meta['digest']}")
    print(f"train: mean length {tr['length_stats']['mean']:.1f}, CTR {tr['ctr']:.3f}, "
          f"oracle AUC {o['auc']:.3f} ({recent})")
    if cfg.is_timeline:
        from .timeline import seen_users_line

        print(seen_users_line(meta))


def main(argv: list[str] | None = None) -> int:
    """Run one command; return the exit status (errors are printed, not raised)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command != "generate" and extra:
            raise ConfigError(f"unexpected arguments {extra}")
        if args.command == "generate":
            _generate(args, extra)
        elif args.command == "validate":
            from .schema import validate_dataset

            meta = validate_dataset(args.data_dir, check_digest=not args.no_digest,
                                    deep=not args.shallow, progress=not args.quiet)
            n = sum(len(meta["splits"][s]["files"]) for s in meta["splits"])
            print(f"{args.data_dir}: valid ({n} files, digest {meta['digest']})")
        else:
            from .report import write_report

            paths = write_report(args.data_dir, args.out, progress=True)
            print("wrote " + ", ".join(str(p) for p in paths.values()))
    except DataValidationError as err:
        print(f"invalid data: {err}", file=sys.stderr)
        return 1
    except (ConfigError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    return 0


if __name__ == "__main__":  # the guard matters: spawned workers re-import this module
    sys.exit(main())
