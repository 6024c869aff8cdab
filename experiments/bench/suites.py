"""Benchmark shapes (``SUITES[kind][suite]``: paper, recsys, long, smoke), lengths and FLOP formulas.

Lengths are uniform integers in [1, 2*density*N] clipped to N, from a generator seeded by the
shape, so a shape gets the same lengths in every suite, run and provider. attention/paper is the
peer table's shapes then N 256-4096 x four densities at B*N = 2^20 padded tokens; smoke is for
the CPU.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field

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


def _grid(ns, densities, H=2, D=64, padded_tokens=2**20) -> list[Shape]:
    return [Shape(max(1, padded_tokens // n), n, H, D, d, tags=("grid",)) for n in ns for d in densities]


# Self-attention shapes of the peer table; the paper's headline shape first.
PEERS_ATTENTION = [
    Shape(1024, 1024, 2, 64, 0.25, tags=("peers", "headline")),
    Shape(1024, 256, 2, 64, 0.25, tags=("peers",)),
    Shape(1024, 512, 2, 64, 0.25, tags=("peers",)),
    Shape(512, 2048, 2, 64, 0.25, tags=("peers",)),
    Shape(1024, 1024, 2, 64, 0.5, tags=("peers",)),
    Shape(1024, 1024, 2, 64, 0.1, tags=("peers",)),
    Shape(256, 1024, 4, 128, 0.25, tags=("peers",)),
    Shape(4096, 128, 4, 32, 0.3, tags=("peers",)),
    Shape(2048, 4096, 1, 64, 0.25, tags=("peers",)),
]

PEERS_DENSE = [
    Shape(1024, 1024, 1, 64, 0.25, Tq=16, tags=("peers",)),
    Shape(4096, 256, 1, 64, 0.3, Tq=1, tags=("peers",)),
    Shape(512, 4096, 1, 128, 0.1, Tq=32, tags=("peers",)),
]


def _merge(*groups: list[Shape]) -> list[Shape]:
    """Concatenate, keeping the first occurrence of a shape but the union of its tags."""
    out: dict[Shape, Shape] = {}
    for group in groups:
        for s in group:
            if s in out:
                old = out[s]
                tags = old.tags + tuple(t for t in s.tags if t not in old.tags)
                out[s] = Shape(old.B, old.N, old.H, old.D, old.density, old.Tq, tags)
            else:
                out[s] = s
    return list(out.values())


SUITES: dict[str, dict[str, list[Shape]]] = {
    "attention": {
        "paper": _merge(PEERS_ATTENTION, _grid((256, 512, 1024, 2048, 4096), (0.1, 0.25, 0.5, 0.75))),
        "recsys": [
            Shape(16384, 64, 2, 32, 0.5),
            Shape(16384, 128, 2, 64, 0.3),
            Shape(8192, 128, 4, 32, 0.3),
            Shape(8192, 256, 2, 64, 0.25),
            Shape(8192, 256, 4, 128, 0.3),
            Shape(4096, 512, 2, 64, 0.25),
            Shape(4096, 512, 4, 128, 0.1),
            Shape(4096, 64, 8, 32, 0.5),
        ],
        "long": [
            Shape(128, 8192, 2, 64, 0.25),
            Shape(64, 8192, 4, 128, 0.5),
            Shape(32, 8192, 2, 64, 0.75),
            Shape(32, 16384, 2, 64, 0.25),
            Shape(16, 16384, 4, 128, 0.1),
        ],
        "smoke": [
            Shape(4, 16, 2, 16, 0.5, tags=("grid",)),
            Shape(2, 32, 2, 16, 0.5, tags=("grid",)),
            Shape(4, 16, 2, 16, 0.25, tags=("grid",)),
        ],
    },
    "dense_attention": {
        "paper": _merge([Shape(1024, 1024, 2, 64, 0.25, Tq=t, tags=("target",)) for t in (1, 16, 64)], PEERS_DENSE),
        "recsys": [
            Shape(8192, 256, 2, 64, 0.3, Tq=1),
            Shape(8192, 256, 2, 64, 0.3, Tq=16),
            Shape(16384, 128, 2, 32, 0.5, Tq=8),
            Shape(4096, 512, 4, 64, 0.25, Tq=64),
        ],
        "long": [
            Shape(256, 8192, 2, 64, 0.25, Tq=16),
            Shape(64, 16384, 2, 128, 0.25, Tq=64),
        ],
        "smoke": [Shape(3, 16, 2, 16, 0.5, Tq=4), Shape(2, 32, 1, 32, 0.25, Tq=1)],
    },
    "ops": {
        "paper": [Shape(1024, 1024, 1, 128, d, tags=("large",)) for d in (0.1, 0.25, 0.5, 0.75)]
        + [Shape(4096, 512, 1, 256, 0.5, tags=("large",))],
        "recsys": [Shape(8192, 256, 1, 64, d) for d in (0.1, 0.3, 0.5)],
        "long": [Shape(64, 8192, 1, 128, d) for d in (0.1, 0.5)],
        "smoke": [Shape(3, 16, 1, 16, 0.5), Shape(2, 8, 1, 16, 0.25)],
    },
}


def get_suite(kind: str, suite: str, max_shapes: int | None = None) -> list[Shape]:
    if kind not in SUITES:
        raise ValueError(f"unknown benchmark kind {kind!r}; one of {KINDS}")
    if suite not in SUITES[kind]:
        raise ValueError(f"unknown suite {suite!r}; one of {tuple(SUITES[kind])}")
    shapes = SUITES[kind][suite]
    return shapes[:max_shapes] if max_shapes else list(shapes)
