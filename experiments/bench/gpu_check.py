"""Compile every Triton kernel for a GPU target on any machine, no GPU needed.

    python -m experiments gpu-check [--arch 90] [--dtypes bf16,fp16,fp32] [--dims 16,48,...] [--ptxas]

The launchers run on "meta" tensors with their kernels swapped for recorders; the launches they
would make are compiled down to a cubin, specialised as Triton's launcher does. --ptxas prints
registers and spills per kernel."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import time
from unittest import mock

import torch

from experiments import parser

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}


class _Recorder:
    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def _record(run) -> list:
    """Run `run()` with every kernel replaced by a recorder; return the launches."""
    from kernels import (_bmm_triton, _conversions_triton, _dense_attention_triton, _elementwise_triton,
                         _flash_attention_triton, _s2_attention_triton, _softmax_triton)

    calls: list = []
    with contextlib.ExitStack() as stack:
        for mod in (_flash_attention_triton, _dense_attention_triton, _s2_attention_triton, _softmax_triton,
                    _conversions_triton, _elementwise_triton, _bmm_triton):
            for name in dir(mod):
                obj = getattr(mod, name)
                if (name.endswith("_kernel") or name.startswith("_s2_")) and hasattr(obj, "arg_names"):
                    stack.enter_context(mock.patch.object(mod, name, _Recorder(obj, calls)))
        run()
    return calls


def _signature(fn, args, kwargs):
    """(signature, constexprs, attrs) as Triton's launcher specialises a real call: an int
    argument equal to 1 becomes a constant and one divisible by 16 is marked so, unless the
    kernel says do_not_specialize; tensors are taken as 16-byte aligned (torch's allocations)."""
    sig, const, attrs = {}, {}, {}
    dns = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    positional = iter(args)
    for i, p in enumerate(fn.params):
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
            const[name] = kwargs[name]
            continue
        a = kwargs[name] if name in kwargs else next(positional)  # S2 passes LOCAL, STRIDE by name
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPES[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            if a == 1 and name not in dns:
                sig[name], const[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            if a % 16 == 0 and name not in dns:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, const, attrs


def _ptxas_report(ptx: str, arch: int) -> str:
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:  # a private name: nothing planted is written
        f.write(ptx)
        f.flush()
        res = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True)
    text = res.stderr + res.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"regs={regs.group(1) if regs else '?'} "
            f"spill={spill.group(1) + '/' + spill.group(2) if spill else '?'}")


def _forced(family: str, config: dict, run):
    from kernels import _launch_configs

    with _launch_configs.forced(family, config):
        return run()


def _workloads(dtype, D):
    """(label, thunk) pairs that call every launcher once on meta tensors; D is the head dim, or
    the row-wise ops' feature width (softmax: the number of columns)."""
    from kernels._bmm_triton import jagged_dense_bmm_triton, jagged_jagged_bmm_triton
    from kernels._conversions_triton import jagged_to_padded_triton, padded_to_jagged_triton
    from kernels._dense_attention_triton import dense_attention_bwd, dense_attention_fwd
    from kernels._elementwise_triton import jagged_dense_elementwise_bwd_triton, jagged_dense_elementwise_fwd_triton
    from kernels._flash_attention_triton import flash_attention_bwd, flash_attention_fwd
    from kernels._s2_attention_triton import s2_attention_bwd, s2_attention_fwd
    from kernels._softmax_triton import jagged_softmax_bwd_triton, jagged_softmax_fwd_triton
    from kernels.s2 import S2Shards

    T, H, B, N, Tq = 64, 2, 2, 32, 8
    m = dict(device="meta", dtype=dtype)
    q, k, v = (torch.empty(T, H, D, **m) for _ in range(3))
    off = torch.empty(B + 1, device="meta", dtype=torch.int64)
    lse = torch.empty(H, T, device="meta", dtype=torch.float32)
    qd = torch.empty(B, Tq, H, D, **m)
    bias = torch.empty(B, H, Tq, N, **m)
    lse_d = torch.empty(H, B, Tq, device="meta", dtype=torch.float32)
    for causal in (False, True):
        yield f"flash causal={causal}", lambda c=causal: (
            flash_attention_fwd(q, k, v, off, N, c, 0.1),
            flash_attention_bwd(q, None, q, k, v, q, lse, off, N, c, 0.1))
    for b in (None, bias):
        yield f"dense bias={b is not None}", lambda b=b: (
            dense_attention_fwd(qd, k, v, off, N, b, 0.1),
            dense_attention_bwd(qd, qd, k, v, qd, lse_d, off, N, b, 0.1, b is not None))
    for b in (None, bias):  # SPLIT_DQ forced on, the fp32 and bias cases too
        yield f"dense split_dq bias={b is not None}", lambda b=b: _forced("dense_bwd", {"SPLIT_DQ": 1},
            lambda: dense_attention_bwd(qd, qd, k, v, qd, lse_d, off, N, b, 0.1, False))
    x, dense, w = torch.empty(T, D, **m), torch.empty(B, N, D, **m), torch.empty(B, D, D, **m)
    yield "softmax", lambda: (jagged_softmax_fwd_triton(x, off, N), jagged_softmax_bwd_triton(x, x, off, N))
    yield "conversions", lambda: (jagged_to_padded_triton(x, off, N, 0.0), padded_to_jagged_triton(dense, off, T))
    for is_mul in (False, True):
        yield f"elementwise mul={is_mul}", lambda mul=is_mul: (
            jagged_dense_elementwise_fwd_triton(x, off, dense, mul),
            jagged_dense_elementwise_bwd_triton(x, off, x if mul else None, dense if mul else None, N))
    yield "bmm", lambda: (jagged_dense_bmm_triton(x, off, w, N), jagged_jagged_bmm_triton(x, x, off, N))
    yield "bmm split-T", lambda: _forced("jagged_jagged_bmm", {"T_SPLITS": 4},
                                         lambda: jagged_jagged_bmm_triton(x, x, off, N))
    lse2 = torch.empty(T, H, device="meta", dtype=torch.float32)
    for block in (64, 48):
        for causal in (False, True):
            shards = S2Shards(block, 1, 4)
            yield f"s2 block={block} causal={causal}", lambda c=causal, s=shards: (
                s2_attention_fwd(q, k, v, off, N, s, c, 0.1),
                s2_attention_bwd(q, q, k, v, q, lse2, off, N, s, c, 0.1))


def main(argv=None) -> int:
    ap = parser("gpu-check", __doc__)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--dims", default="16,24,48,64,96,128,136,200,256")
    ap.add_argument("--ptxas", action="store_true", help="report registers and spills")
    a = ap.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    target = GPUTarget("cuda", a.arch, 32)
    failures, seen = 0, set()
    for dt in a.dtypes.split(","):
        for D in (int(x) for x in a.dims.split(",")):
            for label, thunk in _workloads(names[dt], D):
                for fn, args, kwargs in _record(thunk):
                    sig, const, attrs = _signature(fn, args, kwargs)
                    key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(const.items())), str(attrs),
                           kwargs.get("num_warps"), kwargs.get("num_stages"))
                    if key in seen:
                        continue
                    seen.add(key)
                    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
                    t0 = time.time()
                    try:
                        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                           target=target, options=opts)
                    except Exception as e:  # report and go on: the point is the full list
                        failures += 1
                        print(f"FAIL {dt} D={D} {label} {fn.__name__}: {str(e)[:2000]}")
                        continue
                    extra = _ptxas_report(k.asm["ptx"], a.arch) if a.ptxas else ""
                    blocks = {c: v for c, v in const.items() if c.startswith("BLOCK")}
                    print(f"ok   {dt} D={D} {label} {fn.__name__} {blocks} {opts} "
                          f"smem={k.metadata.shared} {extra} ({time.time() - t0:.1f}s)",
                          flush=True)
    print(f"{len(seen)} kernels compiled for sm_{a.arch}, {failures} failures")
    return 1 if failures else 0

