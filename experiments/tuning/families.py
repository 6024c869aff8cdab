"""Kernel families of the launch-config sweep: shape grids, config spaces, hand rules, cases.

A family is one launcher of kernels/_*_triton.py: those of ``kernels._launch_configs.FAMILIES``
and the elementwise ops' forward, whose launcher reads its module's dict (``MODULE_DICTS``).
``grid(family, level)`` gives the shapes, ``space`` the configs to time (hand rule's first),
``hand_config`` the launcher's own rule, ``make_case`` a call on fresh inputs and ``launching``
puts a config in force. docs/tuning.md ("Launch configs from a measured cost model") says why."""

from __future__ import annotations

import contextlib
import csv
import functools
import importlib
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import yaml

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LEVELS = ("tiny", "small", "medium", "full")
ENERGY_SLACK = 1.05  # the energy-aware choice: least energy among the configs within 5% of the fastest
_SPEC = yaml.safe_load(Path(__file__).with_name("families.yaml").read_text())  # every family: keys, grid, ...
TUNABLE = {family: tuple(spec["keys"]) for family, spec in _SPEC.items()}  # the keys the sweep varies
KERNELS = {family: tuple(spec["kernels"]) for family, spec in _SPEC.items()}  # module, @triton.jit functions
FAMILIES = tuple(TUNABLE)
# families whose launcher reads a module-level dict, not the launch table: (module, dict name);
# a config is put in force by updating that dict, and the cost model exports no entry for them
MODULE_DICTS = {"elementwise_add": ("_elementwise_triton", "FWD_CONFIG"),
                "elementwise_mul": ("_elementwise_triton", "FWD_CONFIG")}
FLAGS = ("SPLIT_DQ",)  # tunable keys that are 0/1 switches (the others are powers of two)
# the families whose hand rules were retuned on the small grid's shapes (docs/tuning.md, "First
# GPU sweep"): on those shapes the rules are in-sample, so the cost model's comparison with them
# counts only the other shapes (costmodel --judge-on new)
RETUNED_ON_SMALL = ("dense_fwd", "dense_bwd", "softmax_fwd", "softmax_bwd", "padded_to_jagged")


@dataclass(frozen=True)
class SweepShape:
    """B sequences of lengths ~U[1, 2*fill*N] clipped to N (max_seq_len); H heads (softmax:
    columns); D head dim (feature width; K = M = D for the bmm ops); Tq dense queries."""

    B: int
    N: int
    fill: float
    H: int = 1
    D: int = 0
    dtype: str = "bfloat16"
    Tq: int = 0

    @property
    def id(self) -> str:
        return f"B{self.B}-N{self.N}-f{self.fill:g}-H{self.H}-D{self.D}-Tq{self.Tq}-{self.dtype}"


SHAPES_CSV = Path(__file__).with_name("shapes.csv")  # tiny, small and medium's shapes beyond small's
_FULL = {  # kind: (N, fill, (H, D), Tq) products; B = 2^20 padded tokens / N (S2: 2^18)
    "attn": ([128, 256, 512, 1024, 2048, 4096], [0.1, 0.25, 0.5, 0.75], [(2, 64), (4, 32), (4, 128)], [0], 1 << 20),
    "dense": ([256, 1024, 4096], [0.1, 0.25, 0.5], [(2, 64), (4, 128)], [1, 4, 16, 64], 1 << 20),
    "softmax": ([256, 512, 1024, 2048, 4096], [0.1, 0.25, 0.5, 0.75], [(h, 0) for h in (32, 64, 128, 256)], [0],
                1 << 20),
    "ops": ([256, 512, 1024, 2048], [0.1, 0.25, 0.5, 0.75], [(1, d) for d in (64, 128, 256)], [0], 1 << 20),
    "s2": ([2048, 4096, 8192, 16384], [0.25, 0.5, 0.75], [(8, 64), (4, 128)], [0], 1 << 18),
}
@functools.cache
def _listed() -> dict[tuple[str, str], list[SweepShape]]:
    """{(level, kind): shapes} of shapes.csv, in file order."""
    out: dict[tuple[str, str], list[SweepShape]] = {}
    with open(SHAPES_CSV, newline="") as f:
        for r in csv.DictReader(f):
            s = SweepShape(int(r["B"]), int(r["N"]), float(r["fill"]), int(r["H"]), int(r["D"]), r["dtype"],
                           int(r["Tq"]))
            out.setdefault((r["level"], r["kind"]), []).append(s)
    return out


def grid(family: str, level: str) -> list[SweepShape]:
    """The shapes of `family` at `level`; medium is small's shapes and then more."""
    kind = _SPEC[family]["shapes"]
    if level == "full":
        Ns, fills, HDs, Tqs, tokens = _FULL[kind]
        return [SweepShape(max(1, tokens // N), N, f, H, D, Tq=tq)
                for N, f, (H, D), tq in itertools.product(Ns, fills, HDs, Tqs)]
    listed = _listed()
    if level == "medium":
        return listed[("small", kind)] + listed[("medium", kind)]
    return list(listed[(level, kind)])


# keys a family gained after sweeps were recorded -> the value its kernel ran with before them
# (softmax streamed in BLOCK_N-row tiles; jagged_jagged_bmm had no split-T)
_ADDED_KEYS: dict[str, dict[str, Callable[[dict], int]]] = {
    "softmax_fwd": {"STREAM_N": lambda c: c["BLOCK_N"]},
    "softmax_bwd": {"STREAM_N": lambda c: c["BLOCK_N"]},
    "jagged_jagged_bmm": {"T_SPLITS": lambda c: 1},
}


def complete(family: str, cfg: dict) -> dict:
    """A config as a sweep recorded it, with the keys added to its family since then set to what
    the kernel ran with at the time (older rows stay comparable and replayable)."""
    added = {k: rule(cfg) for k, rule in _ADDED_KEYS.get(family, {}).items() if k not in cfg}
    return {**cfg, **added} if added else cfg


def _product(keys: tuple, *values) -> list[dict]:
    return [dict(zip(keys, v)) for v in itertools.product(*values)]


def _raw_space(family: str, s: SweepShape, level: str) -> list[dict]:
    """All combinations of the level, before the validity rules."""
    k = TUNABLE[family]
    if level == "tiny":  # the interpreter's configs
        return [dict(c) for c in _listed_configs("tiny")[family]]
    full = level == "full"
    warps, stages = [4, 8], ([2, 3, 4] if full else [3])
    if family in ("flash_fwd", "dense_fwd"):
        bm = [16, 32, 64, 128] if family == "dense_fwd" else [32, 64, 128]
        return _product(k, bm, [16, 32, 64, 128] if full else [16, 32, 64], warps, stages)
    if family == "flash_bwd":
        pairs = [(64, 32), (64, 16), (32, 32), (128, 32), (64, 64), (32, 16)] + ([(128, 16), (128, 64)] if full else [])
        return [dict(zip(k, (n1, m1, n1, m1, w, st))) for (n1, m1), w, st in itertools.product(pairs, warps, stages)]
    if family == "dense_bwd":
        tiles = [(16, 64), (32, 64), (64, 64), (16, 32), (64, 32)] + ([(32, 128), (64, 128)] if full else [])
        return [dict(zip(k, (m, n, m, n, w, st, sp)))
                for (m, n), w, st, sp in itertools.product(tiles, warps, stages, [0, 1])]
    if family.startswith("softmax"):  # medium: 64 columns a program too (128-byte rows at fill 0.1)
        block_h = [8, 16, 32, 64] if full else [16, 64] if level == "medium" else [16]
        small_n = [16, 32, 64, 128, 256] if full else [32, 128]  # the tile ladder's first rung
        return _product(k, [256, 512, 1024], small_n, block_h, warps, [64, 128, 256, 512] if full else [64, 256])
    if family == "jagged_dense_bmm":
        return _product(k, [64, 128], [64, 128], [32, 64, 128] if full else [32, 64], warps, stages)
    if family == "jagged_jagged_bmm":
        return _product(k, [64, 128], [64, 128], [32, 64] + ([128] if full else []), warps, stages,
                        [1, 2, 4, 8] if full else [1, 4])
    if family == "s2_fwd":
        return _product(k, [32, 64, 128], [16, 32, 64], warps, stages)
    if family == "s2_bwd":  # dQ (query tile, key chunk) x dK/dV (query step, key tile)
        dq = [(64, 32), (64, 16), (128, 32), (128, 64), (32, 32)]
        kv = [(32, 64), (16, 64), (32, 128), (64, 64)]
        return [dict(zip(k, (*a, *b, w, st))) for a, b, w, st in itertools.product(dq, kv, warps, stages)]
    return _product(k, [32, 64, 128], [64, 128, 256] if full else [128], warps)  # padded_to_jagged, elementwise


def valid(family: str, cfg: dict, s: SweepShape) -> bool:
    """Combinations the kernels cannot run, or that waste a whole tile, are skipped by rule."""
    if family == "flash_fwd":
        return cfg["BLOCK_M"] % cfg["BLOCK_N"] == 0  # the causal split needs whole key blocks
    if family == "flash_bwd":
        return cfg["BLOCK_N1"] % cfg["BLOCK_M1"] == 0 and cfg["BLOCK_M2"] % cfg["BLOCK_N2"] == 0
    if family == "dense_fwd":  # query blocks no larger than twice Tq (the rest is masked work)
        return cfg["BLOCK_M"] <= max(16, 2 * s.Tq)
    if family == "dense_bwd":
        return cfg["BLOCK_M"] <= max(16, 2 * s.Tq) and cfg["M_KV"] <= max(16, 2 * s.Tq)
    if family.startswith("softmax"):
        return cfg["SMALL_N"] <= cfg["BLOCK_N"]
    if family == "padded_to_jagged" or family in MODULE_DICTS:
        return cfg["BLOCK_D"] <= max(16, 2 * s.D)
    if family.startswith("s2"):  # key chunks inside the layout's block (the sweep times non-causal S2)
        from kernels._s2_attention_triton import fits

        return fits(cfg, _s2_layout(s).block, causal=False)
    return True


def config_id(cfg: dict) -> str:
    """'BLOCK_M=64,BLOCK_N=32,num_stages=3,num_warps=4' (keys sorted): one config, one string."""
    return ",".join(f"{k}={cfg[k]}" for k in sorted(cfg))


def _key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def _with_hand_values(raw: list[dict], hand: dict) -> list[dict]:
    """`raw` and, for every key whose hand value is not in it, each raw config with that key set to
    the hand's value: otherwise a model learns the hand rule's wins (or losses) as that value's."""
    out = list(raw)
    for k, v in hand.items():
        if raw and v not in {c[k] for c in raw}:
            out += [{**c, k: v} for c in out]
    return out


def space(family: str, s: SweepShape, level: str) -> list[dict]:
    """The configs to time for (family, shape): the valid ones of the level's space with the hand
    rule's values swept too (_with_hand_values), the hand config first."""
    hand = hand_config(family, s)
    out = {_key(hand): hand}
    for cfg in _with_hand_values(_raw_space(family, s, level), hand):
        if valid(family, cfg, s):
            out.setdefault(_key(cfg), cfg)
    return list(out.values())


# the families whose cost model also sees the launcher's program count (softmax's best warp count
# follows the programs per SM: docs/tuning.md, "A denser softmax_bwd grid")
WITH_PROGRAMS = ("softmax_fwd", "softmax_bwd")


def programs(family: str, B: int, H: int, cfg: dict) -> int:
    """The programs the launcher of a WITH_PROGRAMS family runs for `cfg` on B sequences of H columns."""
    if family not in WITH_PROGRAMS:
        raise ValueError(f"{family}: no program count (only {', '.join(WITH_PROGRAMS)})")
    import triton

    from kernels._triton_common import col_block

    return B * triton.cdiv(H, col_block(H, lo=min(16, cfg["BLOCK_H"]), hi=cfg["BLOCK_H"]))  # softmax's _launch grid


def hand_config(family: str, s: SweepShape) -> dict:
    """The hand rule's launch config for the shape, from the launchers' own functions."""
    from kernels import _bmm_triton, _conversions_triton, _elementwise_triton, _softmax_triton
    from kernels._dense_attention_triton import dense_config
    from kernels._flash_attention_triton import bwd_config, fwd_config

    dt = DTYPES[s.dtype]
    if family == "flash_fwd":
        cfg = fwd_config(s.D, dt, s.fill * s.N < 256)  # the launcher's test: T < 256 B
    elif family == "flash_bwd":
        cfg = bwd_config(s.D, dt)
    elif family in ("dense_fwd", "dense_bwd"):
        cfg = dense_config(s.D, s.Tq, dt, backward=family == "dense_bwd")
    elif family.startswith("softmax"):
        from experiments.bench.suites import make_lengths

        cfg = _softmax_triton.softmax_config(s.B, int(make_lengths(s.B, s.N, s.fill, 0).sum()))  # make_case's T
    elif family == "padded_to_jagged":
        cfg = _conversions_triton.P2J_CONFIG
    elif family in MODULE_DICTS:
        cfg = _elementwise_triton.FWD_CONFIG
    elif family.startswith("s2"):
        from kernels._s2_attention_triton import s2_tiles

        cfg = s2_tiles(dt, s.D, _s2_layout(s).block)[family == "s2_bwd"]
    else:
        cfg = _bmm_triton.bmm_base_config("dense" if family == "jagged_dense_bmm" else "jagged", dt)
    return {k: cfg[k] for k in TUNABLE[family]}


@functools.cache
def _listed_configs(which: str) -> dict[str, list[dict]]:
    """families.yaml's `which` lists ('tiny', 'autotune'): family -> configs."""
    return {f: _product(TUNABLE[f], *spec[which]["product"]) if "product" in spec[which]
            else [dict(zip(TUNABLE[f], v)) for v in spec[which]["configs"]] for f, spec in _SPEC.items()}


AUTOTUNE = _listed_configs("autotune")


def make_case(family: str, s: SweepShape, device: torch.device, seed: int = 0) -> tuple[Callable[[], object], dict]:
    """(fn, info): fn() runs the family's launcher on inputs of shape `s` (fresh, seeded) and
    returns its outputs; info holds T (tokens) and L (mean length T/B)."""
    from experiments.bench.suites import make_lengths
    from kernels.conversions import offsets_from_lengths

    lengths = make_lengths(s.B, s.N, s.fill, seed)
    T = int(lengths.sum())
    offsets = offsets_from_lengths(lengths).to(device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dt = DTYPES[s.dtype]

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dt, generator=gen)

    fn = _BUILDERS[family](s, T, offsets, rand)
    return fn, {"T": T, "L": T / max(s.B, 1)}


def _flash(s, T, off, rand, bwd: bool):
    from kernels._flash_attention_triton import flash_attention_bwd, flash_attention_fwd

    q, k, v = (rand(T, s.H, s.D) for _ in range(3))
    scale = 1 / math.sqrt(s.D)
    if not bwd:
        return lambda: flash_attention_fwd(q, k, v, off, s.N, False, scale)[0]
    out, lse = flash_attention_fwd(q, k, v, off, s.N, False, scale)
    do = rand(T, s.H, s.D)
    return lambda: flash_attention_bwd(do, None, q, k, v, out, lse, off, s.N, False, scale)


def _dense(s, T, off, rand, bwd: bool):
    from kernels._dense_attention_triton import dense_attention_bwd, dense_attention_fwd

    q, k, v = rand(s.B, s.Tq, s.H, s.D), rand(T, s.H, s.D), rand(T, s.H, s.D)
    scale = 1 / math.sqrt(s.D)
    if not bwd:
        return lambda: dense_attention_fwd(q, k, v, off, s.N, None, scale)[0]
    out, lse = dense_attention_fwd(q, k, v, off, s.N, None, scale)
    do = rand(s.B, s.Tq, s.H, s.D)
    return lambda: dense_attention_bwd(do, q, k, v, out, lse, off, s.N, None, scale, False)[:3]


def _softmax(s, T, off, rand, bwd: bool):
    from kernels._softmax_triton import jagged_softmax_bwd_triton, jagged_softmax_fwd_triton

    x = rand(T, s.H)
    if not bwd:
        return lambda: jagged_softmax_fwd_triton(x, off, s.N)
    y, g = jagged_softmax_fwd_triton(x, off, s.N), rand(T, s.H)
    return lambda: jagged_softmax_bwd_triton(g, y, off, s.N)


def _bmm(s, T, off, rand, jagged: bool):
    from kernels._bmm_triton import jagged_dense_bmm_triton, jagged_jagged_bmm_triton

    a = rand(T, s.D)
    if jagged:
        c = rand(T, s.D)
        return lambda: jagged_jagged_bmm_triton(a, c, off, s.N)
    dense = rand(s.B, s.D, s.D)
    return lambda: jagged_dense_bmm_triton(a, off, dense, s.N)


def _s2_layout(s: SweepShape):
    """The S2 layout the s2 families are swept with: the bench's and the ablation's (block 64, 4
    local blocks, stride 8); blocks of 16 (1 local, stride 2) on the interpreter's tiny shapes."""
    from kernels.s2 import S2Shards

    return S2Shards(64, 4, 8) if s.N >= 256 else S2Shards(16, 1, 2)


def _s2(s, T, off, rand, bwd: bool):
    from kernels._s2_attention_triton import s2_attention_bwd, s2_attention_fwd

    q, k, v = (rand(T, s.H, s.D) for _ in range(3))
    shards, scale = _s2_layout(s), 1 / math.sqrt(s.D)
    if not bwd:
        return lambda: s2_attention_fwd(q, k, v, off, s.N, shards, False, scale)[0]
    out, lse2 = s2_attention_fwd(q, k, v, off, s.N, shards, False, scale)
    do = rand(T, s.H, s.D)
    return lambda: s2_attention_bwd(do, q, k, v, out, lse2, off, s.N, shards, False, scale)


def _p2j(s, T, off, rand):
    from kernels._conversions_triton import padded_to_jagged_triton

    padded = rand(s.B, s.N, s.D)
    return lambda: padded_to_jagged_triton(padded, off, T)


def _elementwise(s, T, off, rand, mul: bool):
    from kernels._elementwise_triton import jagged_dense_elementwise_fwd_triton

    x, dense = rand(T, s.D), rand(s.B, s.N, s.D)
    return lambda: jagged_dense_elementwise_fwd_triton(x, off, dense, mul)


_BUILDERS = {
    "flash_fwd": lambda *a: _flash(*a, bwd=False), "flash_bwd": lambda *a: _flash(*a, bwd=True),
    "dense_fwd": lambda *a: _dense(*a, bwd=False), "dense_bwd": lambda *a: _dense(*a, bwd=True),
    "softmax_fwd": lambda *a: _softmax(*a, bwd=False), "softmax_bwd": lambda *a: _softmax(*a, bwd=True),
    "jagged_dense_bmm": lambda *a: _bmm(*a, jagged=False), "jagged_jagged_bmm": lambda *a: _bmm(*a, jagged=True),
    "padded_to_jagged": _p2j,
    "s2_fwd": lambda *a: _s2(*a, bwd=False), "s2_bwd": lambda *a: _s2(*a, bwd=True),
    "elementwise_add": lambda *a: _elementwise(*a, mul=False), "elementwise_mul": lambda *a: _elementwise(*a, mul=True),
}


@contextlib.contextmanager
def launching(family: str, cfg: dict):
    """Within the block, every launch of `family` uses `cfg`'s keys over its hand rule."""
    if family not in MODULE_DICTS:
        from kernels._launch_configs import forced

        with forced(family, cfg):
            yield
        return
    module, name = MODULE_DICTS[family]
    table = getattr(importlib.import_module(f"kernels.{module}"), name)
    with mock.patch.dict(table, {k: v for k, v in cfg.items() if k in table}):
        yield
