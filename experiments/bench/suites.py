"""Benchmark shapes (``get_suite(kind, suite)``: paper, recsys, long, smoke; data in suites.csv),
lengths and FLOP formulas.

Lengths are uniform integers in [1, 2*density*N] clipped to N, from a generator seeded by the
shape, so a shape gets the same lengths in every suite, run and provider. attention/paper is the
peer table's shapes (the paper's headline first) then N 256-4096 x four densities at B*N = 2^20
padded tokens; smoke is for the CPU."""

from __future__ import annotations

import csv
import functools
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

KINDS = ("attention", "dense_attention", "ops")
SUITE_NAMES = ("paper", "recsys", "long", "smoke")
BWD_FLOP_FACTOR = 2.5  # backward = 2.5x the forward FLOPs (FlashAttention's benchmark convention)


@dataclass(frozen=True)
class Shape:
    """One benchmark case. For ``ops``, D is the feature width (K = M = D for the bmm ops)."""

    B: int
    N: int  # max_seq_len: the padded length
    H: int
    D: int
    density: float
    Tq: int = 0  # dense queries per sequence (dense_attention only)
    tags: tuple[str, ...] = field(default=(), compare=False)

    @property
    def id(self) -> str:
        tq = f"-Tq{self.Tq}" if self.Tq else ""
        return f"B{self.B}-N{self.N}-H{self.H}-D{self.D}-d{self.density:g}{tq}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tags"] = list(self.tags)
        return d


def seed_for(shape: Shape, base_seed: int = 0) -> int:
    return (zlib.crc32(f"B{shape.B}-N{shape.N}-d{shape.density:g}".encode()) + base_seed) % 2**31


def make_lengths(B: int, N: int, density: float, seed: int) -> torch.Tensor:
    """[B] int64 on the CPU: uniform in [1, max(1, round(2*density*N))], clipped to N."""
    hi = max(1, round(2 * density * N))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, hi + 1, (B,), generator=gen, dtype=torch.int64)
    return lengths.clamp_(max=N)


def attention_flops(lengths: torch.Tensor, H: int, D: int, mode: str) -> float:
    """Useful FLOPs of jagged self-attention: fwd 4*H*D*sum(L^2); fwd_bwd adds 2.5x that."""
    fwd = 4.0 * H * D * float((lengths.double() ** 2).sum())
    return fwd if mode == "fwd" else fwd * (1.0 + BWD_FLOP_FACTOR)


def dense_attention_flops(lengths: torch.Tensor, Tq: int, H: int, D: int, mode: str) -> float:
    """Tq dense queries over L_b keys: fwd 4*H*D*Tq*sum(L); fwd_bwd adds 2.5x that."""
    fwd = 4.0 * H * D * Tq * float(lengths.double().sum())
    return fwd if mode == "fwd" else fwd * (1.0 + BWD_FLOP_FACTOR)


@functools.cache
def _suites() -> dict[str, dict[str, list[Shape]]]:
    """{kind: {suite: shapes}} of suites.csv, in file order."""
    out: dict[str, dict[str, list[Shape]]] = {}
    with open(Path(__file__).with_name("suites.csv"), newline="") as f:
        for r in csv.DictReader(f):
            shape = Shape(int(r["B"]), int(r["N"]), int(r["H"]), int(r["D"]), float(r["density"]), int(r["Tq"]),
                          tuple(filter(None, r["tags"].split("+"))))
            out.setdefault(r["kind"], {}).setdefault(r["suite"], []).append(shape)
    return out


def get_suite(kind: str, suite: str, max_shapes: int | None = None) -> list[Shape]:
    suites = _suites()
    if kind not in suites:
        raise ValueError(f"unknown benchmark kind {kind!r}; one of {KINDS}")
    if suite not in suites[kind]:
        raise ValueError(f"unknown suite {suite!r}; one of {tuple(suites[kind])}")
    shapes = suites[kind][suite]
    return shapes[:max_shapes] if max_shapes else list(shapes)
