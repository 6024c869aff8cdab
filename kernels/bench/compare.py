"""Two benchmark runs of ours side by side: did a change (a launch table, a kernel) slow any row?

    python -m kernels.bench.compare BASE.json NEW.json [--noise 0.05] [--out compare.md]

BASE and NEW are result files of ``python -m kernels.bench`` (e.g. one run with
``JFA_LAUNCH_TABLE=off``, the hand rules, and one with the table; each in its own --out folder,
since a report folder keeps only the newest row of each shape). For every row that ours timed
in both (kind, suite, op, shape, mode): new / base time of the call and, where both runs had
``--graph-ms``, of the kernels alone. Verdicts, never relaxed:

- no row slower than before by more than ``--noise`` (relative: 0.05 = 5%; by call time);
- the geometric mean of ours' speedup over ``varlen_attn`` (attention fwd+bwd, every suite both
  runs measured) not lower than before.

Both runs' stamps are printed (GPU, versions, commit, launch table): times from different GPUs
are refused. Exit status 0 (printed PASS or MISS), 2 for unreadable or incomparable files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernels.bench.base import OURS
from kernels.bench.stamp import stamp_line
from kernels.bench.targets import geomean, pairs


def _key(r: dict) -> tuple:
    return r["kind"], r["suite"], r.get("op") or "", r["shape_id"], r["mode"]


def _ours(doc: dict) -> dict[tuple, dict]:
    return {_key(r): r for r in doc["rows"] if r["provider"] == OURS and r["status"] == "ok"}


def varlen_geomean(doc: dict, suites: set[str]) -> float | None:
    """Geometric mean of ours' fwd+bwd speedup over varlen_attn on the attention rows of `suites`."""
    ps = pairs(doc["rows"], "attention", "varlen_attn", "fwd_bwd", suites=suites)
    return geomean([r["ms"] / o["ms"] for r, o in ps if o is not None])


def compare(base: dict, new: dict, noise: float) -> tuple[list[str], bool]:
    """(markdown lines, every verdict PASS)."""
    if base["stamp"]["gpu_slug"] != new["stamp"]["gpu_slug"]:
        raise ValueError(f"different GPUs: {base['stamp']['gpu']} and {new['stamp']['gpu']}")
    b, n = _ours(base), _ours(new)
    both = sorted(b.keys() & n.keys())
    if not both:
        raise ValueError("no row that ours timed in both runs")
    lines = ["# Ours, before and after", "", f"- base: {base['_file']}: {stamp_line(base['stamp'])}",
             f"- new: {new['_file']}: {stamp_line(new['stamp'])}", "",
             "| kind | suite | op | shape | mode | base ms | new ms | new / base | kernels new / base |",
             "|---|---|---|---|---|---:|---:|---:|---:|"]
    slower = []
    for k in both:
        rb, rn = b[k], n[k]
        ratio = rn["ms"] / rb["ms"]
        gpu = (f"{rn['gpu_ms'] / rb['gpu_ms']:.3f}" if rb.get("gpu_ms") and rn.get("gpu_ms") else "-")
        flag = " **slower**" if ratio > 1 + noise else ""
        slower += [k] if flag else []
        lines.append(f"| {' | '.join(map(str, k))} | {rb['ms']:.4g} | {rn['ms']:.4g} | {ratio:.3f}{flag} | {gpu} |")
    suites = {k[1] for k in both if k[0] == "attention"}
    gb, gn = varlen_geomean(base, suites), varlen_geomean(new, suites)
    ok_rows = not slower
    ok_varlen = gb is None or (gn is not None and gn >= gb)
    lines += ["", "| verdict | measured | result |", "|---|---|---|",
              f"| no row slower than before by more than {noise:.0%} | {len(slower)} of {len(both)} rows slower "
              f"(geometric mean new / base {geomean([n[k]['ms'] / b[k]['ms'] for k in both]):.3f}) | "
              f"{'PASS' if ok_rows else 'MISS'} |",
              f"| attention fwd+bwd geomean over varlen_attn not lower ({', '.join(sorted(suites)) or '-'}) | "
              f"base {_x(gb)}, new {_x(gn)} | {'PASS' if ok_varlen else 'MISS'} |"]
    return lines, ok_rows and ok_varlen


def _x(g: float | None) -> str:
    return "-" if g is None else f"{g:.3f}x"


def _load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
        doc["rows"], doc["stamp"]  # noqa: B018 - a result file has both
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a kernels.bench result file ({type(exc).__name__}: {exc})") from None
    doc["_file"] = Path(path).name
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m kernels.bench.compare",
                                description=__doc__.split("\n")[0])
    p.add_argument("base", help="the result file before the change")
    p.add_argument("new", help="the result file after it")
    p.add_argument("--noise", type=float, default=0.05, help="relative slowdown still counted as noise (0.05: 5%%)")
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    if not 0 <= args.noise < 1:
        p.error("--noise must be in [0, 1)")
    try:
        lines, _ = compare(_load(args.base), _load(args.new), args.noise)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
