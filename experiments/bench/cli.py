"""Kernel benchmarks against every peer: ``python -m experiments bench attention|dense_attention|ops|all|report``.

    python -m experiments bench all --suite paper                                   # GPU, minutes
    python -m experiments bench all --suite smoke --device cpu --out /tmp/bench     # CPU, seconds
    python -m experiments bench report                                              # tables + plots from JSON
    python -m experiments bench dense_attention --force dense_bwd:SPLIT_DQ=0        # a launch-config A/B
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
import time
import warnings

import torch

from experiments import parser
from experiments.bench.base import OURS
from experiments.bench.suites import KINDS, SUITE_NAMES
from pipeline.errors import ConfigError, command

# `all` runs the quick kinds first, so that a --deadline-s cut lands on self-attention shapes
ALL_ORDER = ("ops", "dense_attention", "attention")
OUT = "runs/kernels/<gpu>"  # experiments/results/kernels/<gpu>: the committed results
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser("bench", __doc__)
    p.add_argument("what", choices=KINDS + ("all", "report"))
    p.add_argument("--suite", default="paper", help=f"one or more of {SUITE_NAMES}, comma-separated")
    p.add_argument("--providers", default=None, help="peers to run, comma-separated (ours always runs)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--out", default=OUT, help="folder (<gpu>: the GPU's slug; report: every GPU's), or a .json file")
    p.add_argument("--modes", default="fwd,fwd_bwd", help="fwd and/or fwd_bwd (ops run fwd only)")
    p.add_argument("--max-shapes", type=int, default=None, help="only the first N shapes of each suite")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--flex-max-tokens", type=int, default=300_000, help="skip FlexAttention above this many tokens")
    p.add_argument("--flex-budget-s", type=float, default=120.0, help="wall seconds FlexAttention may use per run")
    p.add_argument("--deadline-s", type=float, default=None, help="start no new shape after this many seconds")
    p.add_argument("--commit", default=None, help="git commit to stamp (the GPU machine has no .git)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-report", action="store_true", help="write the JSON only")
    p.add_argument("--graph-ms", action="store_true", help="also time each row as a CUDA-graph replay: gpu_ms")
    p.add_argument("--force", action="append", default=[], metavar="FAMILY:KEY=VALUE[,KEY=VALUE]",
                   help="every launch of FAMILY (e.g. dense_bwd) takes these keys; repeatable, stamped")
    args = p.parse_args(argv)
    try:
        args.force = parse_force(args.force)
    except ValueError as err:
        p.error(str(err))
    return args


def parse_force(specs: list[str]) -> dict[str, dict[str, int]]:
    """['dense_bwd:SPLIT_DQ=0,M_KV=32'] -> {'dense_bwd': {'SPLIT_DQ': 0, 'M_KV': 32}}; unknown
    families and keys are refused with the known ones named."""
    from experiments.tuning.families import MODULE_DICTS, TUNABLE

    families = [f for f in TUNABLE if f not in MODULE_DICTS]  # the launch table's, which forced() knows
    out: dict[str, dict[str, int]] = {}
    for spec in specs:
        family, _, pairs = spec.partition(":")
        if family not in families:
            raise ValueError(f"--force {spec}: unknown kernel family {family!r}; known: {', '.join(families)}")
        for pair in filter(None, pairs.split(",")):
            key, eq, value = pair.partition("=")
            if not eq or key not in TUNABLE[family] or not value.lstrip("-").isdigit():
                raise ValueError(f"--force {spec}: {pair!r} is not KEY=integer with KEY one of "
                                 f"{', '.join(TUNABLE[family])}")
            out.setdefault(family, {})[key] = int(value)
        if family not in out:
            raise ValueError(f"--force {spec}: no KEY=VALUE after {family}:")
    return out


def _paths(out: str, slug: str, what: str, suites: list[str]) -> tuple[str, str]:
    out = out.replace("<gpu>", slug)
    if out.endswith(".json"):
        return out, os.path.dirname(os.path.abspath(out))
    # '_' joins suites: result files keep to [A-Za-z0-9._-] so every copier and transfer keeps them
    return os.path.join(out, f"bench-{what}-{'_'.join(suites)}.json"), out


def print_summary(rows: list[dict], ceilings: dict | None) -> None:
    from experiments.bench.targets import evaluate, geomean_table

    print("\n== geometric-mean speedup of ours (peer time / ours) ==")
    for g in geomean_table(rows):
        op = f" {g['op']}" if g["op"] else ""
        print(f"  {g['kind']}{op} [{g['suite']}] {g['mode']:<8} vs {g['peer']:<18} {g['geomean']:.2f}x  ({g['n']} shapes)")
    print("\n== targets ==")
    for t in evaluate(rows, ceilings):
        print(f"  {t['status']:<10} {t['target']}\n             {t['detail']}")
    sys.stdout.flush()


def run(args, device: torch.device, suites: list[str], modes: tuple[str, ...], argv) -> tuple[str, str, list[dict]]:
    """Every kind and suite of `args`, rows saved after each shape; (folder, GPU slug, the rows)."""
    from kernels._launch_configs import forced
    from experiments.bench import runner
    from experiments.bench.base import RunConfig
    from experiments.bench.measure import measure_ceilings
    from experiments.bench.report import SCHEMA, write_json
    from experiments.bench.stamp import make_stamp, stamp_line

    start = time.monotonic()
    cfg = RunConfig(device=device, dtype=DTYPES[args.dtype], modes=modes, warmup_ms=args.warmup, rep_ms=args.rep,
                    ours_backend="triton" if device.type == "cuda" else "torch", max_shapes=args.max_shapes,
                    providers=frozenset(args.providers.split(",")) if args.providers else None, seed=args.seed,
                    flex_max_tokens=args.flex_max_tokens, flex_budget_s=args.flex_budget_s, graph_ms=args.graph_ms,
                    deadline=start + args.deadline_s if args.deadline_s else None)
    stamp = make_stamp(device, args.commit)
    if args.force:
        forced_text = "; ".join(f"{fam} " + ",".join(f"{k}={v}" for k, v in kv.items()) for fam, kv in args.force.items())
        stamp["launch_table"] = f"{stamp['launch_table']} + forced {forced_text}"
    print(stamp_line(stamp), flush=True)
    ceilings = measure_ceilings(device, cfg.dtype, cfg.warmup_ms, cfg.rep_ms)
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, {ceilings['matmul_dtype']} matmul "
          f"{ceilings['matmul_tflops']:.1f} TFLOP/s", flush=True)
    kinds = list(ALL_ORDER) if args.what == "all" else [args.what]
    json_path, folder = _paths(args.out, stamp["gpu_slug"], args.what, suites)
    config = {
        "kinds": kinds, "suites": suites, "dtype": args.dtype, "modes": list(modes), "warmup_ms": cfg.warmup_ms,
        "rep_ms": cfg.rep_ms, "ours_backend": cfg.ours_backend, "max_shapes": args.max_shapes,
        "providers": args.providers, "seed": args.seed, "graph_ms": args.graph_ms, "force": args.force,
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    rows: list[dict] = []

    def save(partial: list[dict]) -> None:
        write_json(json_path, {"schema": SCHEMA, "stamp": stamp, "ceilings": ceilings, "config": config,
                               "rows": rows + partial, "wall_s": round(time.monotonic() - start, 1)})

    with contextlib.ExitStack() as stack:
        for family, keys in args.force.items():
            stack.enter_context(forced(family, keys))
        for suite in suites:
            for kind in kinds:
                rows += runner.run_kind(kind, suite, cfg, on_shape=save)
    save([])
    print(f"\nwrote {json_path} ({len(rows)} rows, {time.monotonic() - start:.0f} s)")
    print_summary(rows, ceilings)
    return folder, stamp["gpu_slug"], rows


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    from experiments.bench import runner
    from experiments.bench.report import write_report

    if args.what == "report":
        folders = sorted(glob.glob(args.out.replace("<gpu>", "*"))) if "<gpu>" in args.out else [args.out]
        for path in (p for folder in folders for p in write_report(folder)):
            print(f"wrote {path}")
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here (--device cpu times the torch path)")
    suites, modes = args.suite.split(","), tuple(m for m in args.modes.split(",") if m)
    unknown = set(args.providers.split(",")) - runner.provider_names() if args.providers else set()
    if set(suites) - set(SUITE_NAMES):
        raise ConfigError(f"unknown suite {sorted(set(suites) - set(SUITE_NAMES))}; one of {SUITE_NAMES}")
    if unknown:
        raise ConfigError(f"unknown providers {sorted(unknown)}; known: {sorted(runner.provider_names())}")
    if not set(modes) <= {"fwd", "fwd_bwd"}:
        raise ConfigError(f"--modes takes fwd and/or fwd_bwd, got {args.modes!r}")
    folder, slug, rows = run(args, device, suites, modes, argv)
    if not args.no_report:
        for path in write_report(folder, slug):
            print(f"wrote {path}")
    failed = [r for r in rows if r["provider"] == OURS and (r["status"] == "FAILED" or r["status"].startswith("error"))]
    for r in failed:  # a result file that holds them is written, but the command failed
        print(f"error: ours {r['status']} at {r['kind']} {r.get('op') or ''} {r['suite']} {r['shape_id']} {r['mode']}: "
              f"{r.get('error', '')}", file=sys.stderr)
    return 1 if failed else 0
