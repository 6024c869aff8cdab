"""Two benchmark runs of ours side by side: did a change (a launch table, a kernel) slow any row?

    python -m experiments bench-compare BASE.json[.gz] NEW.json[.gz] [--noise 0.05] [--out compare.md]

Either side may be several runs (comma-separated; each row's median). Verdicts, never relaxed: no
row of ours slower by more than --noise (by the kernels' time where both runs have --graph-ms,
else by the call's), and the fwd+bwd geomean over varlen_attn not lower. Exit 0, 2 on bad input."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from experiments import parser
from experiments.bench.base import OURS
from experiments.bench.report import read_json
from experiments.bench.stamp import stamp_line
from experiments.bench.targets import geomean, pairs
from experiments.runs import fmt


def _key(r: dict) -> tuple:
    return r["kind"], r["suite"], r.get("op") or "", r["shape_id"], r["mode"]


def _ours(doc: dict) -> dict[tuple, dict]:
    return {_key(r): r for r in doc["rows"] if r["provider"] == OURS and r["status"] == "ok"}


def varlen_speedups(doc: dict, key: str = "ms") -> dict[tuple[str, str], float]:
    """Ours' fwd+bwd speedup over varlen_attn per attention shape ((suite, shape id)), by `key`
    ('ms' the call, 'gpu_ms' the kernels: shapes without it left out)."""
    return {(r["suite"], r["shape_id"]): r[key] / o[key] for r, o in pairs(doc["rows"], "attention", "varlen_attn", "fwd_bwd")
            if o is not None and r.get(key) and o.get(key)}


def _run_geomeans(doc: dict, shapes: set) -> str:
    """Each run's geomean over varlen_attn by call on `shapes`, for a side of several runs."""
    runs = doc.get("_runs", [doc])
    return ", ".join(fmt(geomean([s[k] for k in shapes if k in s]), ".3f", "x") for s in map(varlen_speedups, runs))


def _common_geomeans(base: dict, new: dict, key: str) -> tuple[set, float | None, float | None]:
    """(the shapes both runs timed by `key`, base's and new's geomean over varlen_attn on them)."""
    sb, sn = varlen_speedups(base, key), varlen_speedups(new, key)
    both = sb.keys() & sn.keys()
    return both, geomean([sb[s] for s in both]), geomean([sn[s] for s in both])


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
    slower, call_slower, kernel_ratios = [], [], []
    for k in both:
        rb, rn = b[k], n[k]
        ratio = rn["ms"] / rb["ms"]
        kernels = rn["gpu_ms"] / rb["gpu_ms"] if rb.get("gpu_ms") and rn.get("gpu_ms") else None
        kernel_ratios += [kernels] if kernels is not None else []
        call_slower += [k] if ratio > 1 + noise else []
        is_slower = (kernels if kernels is not None else ratio) > 1 + noise
        slower += [k] if is_slower else []
        flag = " **slower**" if is_slower else ""
        call_cell, kernel_cell = (f"{ratio:.3f}", f"{kernels:.3f}{flag}") if kernels is not None else \
            (f"{ratio:.3f}{flag}", "-")
        lines.append(f"| {' | '.join(map(str, k))} | {rb['ms']:.4g} | {rn['ms']:.4g} | {call_cell} | {kernel_cell} |")
    (shapes, gb, gn), (_, kb, kn) = _common_geomeans(base, new, "ms"), _common_geomeans(base, new, "gpu_ms")
    suites = {suite for suite, _ in shapes}
    ok_rows = not slower
    ok_varlen = gb is None or (gn is not None and gn >= gb)
    lines += ["", "| verdict | measured | result |", "|---|---|---|",
              f"| no row slower than before by more than {noise:.0%} | {len(slower)} of {len(both)} rows slower "
              f"({len(kernel_ratios)} judged by the kernels' time, geometric mean new / base "
              f"{fmt(geomean(kernel_ratios), '.3f')}; the others "
              f"by the call's; by the call's time alone {len(call_slower)} rows, geometric mean "
              f"{geomean([n[k]['ms'] / b[k]['ms'] for k in both]):.3f}) | {'PASS' if ok_rows else 'MISS'} |",
              f"| attention fwd+bwd geomean over varlen_attn not lower ({', '.join(sorted(suites)) or '-'}; "
              f"{len(shapes)} shapes timed in both) | "
              f"base {fmt(gb, '.3f', 'x')}, new {fmt(gn, '.3f', 'x')} "
              f"(by the kernels' time: base {fmt(kb, '.3f', 'x')}, new {fmt(kn, '.3f', 'x')}) | "
              f"{'N/A' if gb is None else 'PASS' if ok_varlen else 'MISS'} |"]
    if gb is not None and ("_runs" in base or "_runs" in new):
        lines += ["", f"Each run's geomean over varlen_attn by call: base {_run_geomeans(base, shapes)}; "
                      f"new {_run_geomeans(new, shapes)} (rows above: medians over the runs)."]
    return lines, ok_rows and ok_varlen


def _load(path: str) -> dict:
    doc = read_json(path)
    if not {"rows", "stamp"} <= doc.keys():
        raise ValueError(f"{path}: not an experiments.bench result file (no rows and stamp)")
    return {**doc, "_file": Path(path).name}


def _load_runs(paths: str) -> dict:
    """One result file, or several (comma-separated) merged: each row's ms and gpu_ms the median
    over them (its other fields the first run's)."""
    files = [p for p in paths.split(",") if p] or [paths]
    docs = [_load(p) for p in files]
    if len(docs) == 1:
        return docs[0]
    tables = {d["stamp"].get("launch_table") for d in docs}
    if len({d["stamp"]["gpu_slug"] for d in docs}) > 1 or len(tables) > 1:
        raise ValueError(f"{paths}: the runs of one side must share their GPU and launch table")
    times: dict[tuple, dict] = {}
    for d in docs:
        for r in d["rows"]:
            if r["status"] == "ok":
                t = times.setdefault((*_key(r), r["provider"]), {"row": r, "ms": [], "gpu_ms": []})
                t["ms"].append(r["ms"])
                t["gpu_ms"] += [r["gpu_ms"]] if r.get("gpu_ms") else []
    rows = [dict(t["row"], ms=statistics.median(t["ms"]),
                 gpu_ms=statistics.median(t["gpu_ms"]) if len(t["gpu_ms"]) == len(t["ms"]) else None)
            for t in times.values()]
    return {"rows": rows, "stamp": docs[0]["stamp"], "_runs": docs,
            "_file": f"{len(docs)} runs ({', '.join(_run_names(files))})"}


def _run_names(files: list[str]) -> list[str]:
    """The files' names, or folder/name where names repeat (kernels.sh table_ab: hand/, hand-2/, ...)."""
    names = [Path(p).name for p in files]
    return names if len(set(names)) == len(names) else [f"{Path(p).parent.name}/{Path(p).name}" for p in files]


def main(argv=None) -> int:
    p = parser("bench-compare", __doc__)
    p.add_argument("base", help="the result file before the change (or several, comma-separated)")
    p.add_argument("new", help="the result file after it (or several, comma-separated)")
    p.add_argument("--noise", type=float, default=0.05, help="relative slowdown still counted as noise (0.05: 5%%)")
    p.add_argument("--out", default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    if not 0 <= args.noise < 1:
        p.error("--noise must be in [0, 1)")
    try:
        lines, _ = compare(_load_runs(args.base), _load_runs(args.new), args.noise)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0

