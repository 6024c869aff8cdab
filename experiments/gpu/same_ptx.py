"""Did a refactor of Triton kernels change the code they compile to? The PTX of two Triton caches,
kernel by kernel.

    TRITON_DISABLE_LINE_INFO=1 TRITON_CACHE_DIR=/tmp/before  <run the kernels at the old code>
    TRITON_DISABLE_LINE_INFO=1 TRITON_CACHE_DIR=/tmp/after   <run the same kernels at the new code>
    python experiments/gpu/same_ptx.py /tmp/before /tmp/after [--kernels _s2_]

Each cache holds one PTX file per compiled specialization (dtypes, constexprs, config). Without
line info (the variable above) a PTX names no source line, so equal sets of PTX texts per kernel
name mean the refactor compiles to the same machine code. Exit status 0: every kernel whose name
starts with --kernels has the same PTX texts in both caches, and each cache has at least one;
1 otherwise (the differences are listed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path


def ptx_by_kernel(cache: Path, prefix: str) -> dict[str, set[str]]:
    """Kernel name -> the sha256 of each of its PTX texts in a Triton cache directory."""
    out: dict[str, set[str]] = defaultdict(set)
    for ptx in cache.rglob("*.ptx"):
        meta = ptx.with_suffix(".json")
        name = json.loads(meta.read_text()).get("name", ptx.stem) if meta.is_file() else ptx.stem
        if name.startswith(prefix):
            out[name].add(hashlib.sha256(ptx.read_bytes()).hexdigest())
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python experiments/gpu/same_ptx.py", description=__doc__.split("\n")[0])
    p.add_argument("before", type=Path, help="the Triton cache of the old code")
    p.add_argument("after", type=Path, help="the Triton cache of the new code")
    p.add_argument("--kernels", default="", help="compare only kernels whose name starts with this")
    args = p.parse_args(argv)
    before, after = ptx_by_kernel(args.before, args.kernels), ptx_by_kernel(args.after, args.kernels)
    same = bool(before) and before == after
    for name in sorted(before.keys() | after.keys()):
        b, a = before.get(name, set()), after.get(name, set())
        verdict = "same" if a == b else f"DIFFERENT ({len(b - a)} only before, {len(a - b)} only after)"
        print(f"{name}: {len(b)} PTX before, {len(a)} after: {verdict}")
    if not before:
        print(f"no PTX of kernels named {args.kernels!r}* in {args.before}", file=sys.stderr)
    print("same PTX" if same else "the PTX differs")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
