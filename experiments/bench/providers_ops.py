"""Jagged ops (forward) against their padded torch equivalents and aten's jagged<->padded ops.

Memory-bound ops report GB/s of the bytes they must move; the bmm ops TFLOP/s of real tokens
(2*T*K*M). Providers: ``jagged`` (ours), ``torch_padded`` and ``aten``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from experiments.bench.base import OURS, Prepared, Provider, RunConfig, op_kwargs
from experiments.bench.layouts import Jagged, from_padded, to_padded


@dataclass
class OpSpec:
    name: str
    make_inputs: Callable[[Jagged], dict]  # dense inputs, shared by every provider of the op
    reference: Callable[[Jagged], torch.Tensor]  # fp32, in the layout of ours' output
    providers: list[Provider]
    bytes_moved: Callable[[Jagged], float] | None = None
    flops: Callable[[Jagged], float] | None = None


def _es(j: Jagged) -> int:
    return j.q.element_size()


def _pad(j: Jagged, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    return to_padded(x, j.pos, j.shape.B, j.shape.N, fill)


def _kernel(name: str):
    import kernels

    return getattr(kernels, name)


def _ours(op_name: str, args: Callable[[Jagged], tuple]) -> Provider:
    def prepare(j: Jagged, cfg: RunConfig) -> Prepared:
        fn = _kernel(op_name)
        tensors = args(j)
        kw = op_kwargs(fn, len(tensors), max_seq_len=j.shape.N, total=j.T, backend=cfg.ours_backend)
        fwd = lambda: fn(*tensors, **kw)  # noqa: E731
        return Prepared(fwd, [], list(t for t in tensors if isinstance(t, torch.Tensor)), lambda o: o)

    return Provider(OURS, prepare)


def _torch(fwd_of: Callable[[Jagged], tuple[Callable, list]], to_ref: str = "jagged") -> Provider:
    """A padded torch peer: `fwd_of(j)` gives (fwd, held); padded outputs are un-padded to check."""

    def prepare(j: Jagged, cfg: RunConfig) -> Prepared:
        fwd, held = fwd_of(j)
        conv = (lambda o: from_padded(o, j.pos)) if to_ref == "jagged" else (lambda o: o)
        return Prepared(fwd, [], held, conv)

    return Provider("torch_padded", prepare)


def _aten_skip(op: str):
    def skip(j: Jagged, cfg: RunConfig) -> str | None:
        return None if hasattr(torch.ops.aten, op) else f"unavailable (no aten.{op} in torch {torch.__version__})"

    return skip


def _aten_j2p(j: Jagged, cfg: RunConfig) -> Prepared:
    v, off, N = j.q, j.offsets, j.shape.N
    fwd = lambda: torch.ops.aten._jagged_to_padded_dense_forward(v, [off], [N], 0.0)  # noqa: E731
    return Prepared(fwd, [], [v, off], lambda o: o)


def _aten_p2j(j: Jagged, cfg: RunConfig) -> Prepared:
    p, off, T = j.extra["padded"], j.offsets, j.T
    fwd = lambda: torch.ops.aten._padded_dense_to_jagged_forward(p, [off], T)  # noqa: E731
    return Prepared(fwd, [], [p, off], lambda o: o)


def _padded_softmax(j: Jagged) -> tuple[Callable, list]:
    p = j.extra["padded_neg_inf"]
    return (lambda: torch.softmax(p, dim=1)), [p]


def _padded_dense_bmm(j: Jagged) -> tuple[Callable, list]:
    pa, d = j.extra["padded"], j.extra["dense_km"]
    return (lambda: torch.bmm(pa, d)), [pa, d]


def _padded_jagged_bmm(j: Jagged) -> tuple[Callable, list]:
    pa, pb = j.extra["padded"], j.extra["padded_b"]
    return (lambda: torch.bmm(pa.transpose(1, 2), pb)), [pa, pb]


def _padded_elementwise(op: Callable) -> Callable[[Jagged], tuple[Callable, list]]:
    def fwd_of(j: Jagged):
        pa, d = j.extra["padded"], j.extra["dense"]
        return (lambda: op(pa, d)), [pa, d]

    return fwd_of


def _rand_like_dense(j: Jagged, *size) -> torch.Tensor:
    gen = torch.Generator(device=j.q.device).manual_seed(j.T + 7)
    return torch.randn(*size, device=j.q.device, dtype=j.q.dtype, generator=gen)


_INPUTS = {  # the dense inputs of the ops, by name
    "padded": lambda j: _pad(j, j.q), "padded_b": lambda j: _pad(j, j.k),
    "padded_neg_inf": lambda j: _pad(j, j.q, float("-inf")),
    "dense": lambda j: _rand_like_dense(j, j.shape.B, j.shape.N, j.shape.D),
    "dense_km": lambda j: _rand_like_dense(j, j.shape.B, j.shape.D, j.shape.D),
}


def _inputs(*names: str) -> Callable[[Jagged], dict]:
    return lambda j: {name: _INPUTS[name](j) for name in names}


def _softmax_ref(j: Jagged) -> torch.Tensor:
    return from_padded(torch.softmax(_pad(j, j.q.float(), float("-inf")), dim=1), j.pos)


def _bytes(factor_t: float, factor_padded: float = 0.0) -> Callable[[Jagged], float]:
    return lambda j: (factor_t * j.T + factor_padded * j.shape.B * j.shape.N) * j.shape.D * _es(j)


def _bmm_flops(j: Jagged) -> float:
    return 2.0 * j.T * j.shape.D * j.shape.D


def _op(name: str, inputs: tuple[str, ...], reference, ours_args, *peers: Provider, **work) -> OpSpec:
    """One op: its dense inputs (by name), fp32 reference, ours' positional arguments, its peers and
    its useful work (bytes_moved or flops)."""
    return OpSpec(name, _inputs(*inputs), reference, [_ours(name, ours_args), *peers], **work)


OPS: list[OpSpec] = [
    _op("jagged_to_padded", (), lambda j: _pad(j, j.q.float()), lambda j: (j.q, j.offsets, j.shape.N),
        _torch(lambda j: ((lambda: _pad(j, j.q)), [j.q, j.pos]), to_ref="same"),
        Provider("aten", _aten_j2p, _aten_skip("_jagged_to_padded_dense_forward")), bytes_moved=_bytes(1.0, 1.0)),
    _op("padded_to_jagged", ("padded",), lambda j: j.q.float(), lambda j: (j.extra["padded"], j.offsets),
        _torch(lambda j: ((lambda: from_padded(j.extra["padded"], j.pos)), [j.extra["padded"], j.pos]), "same"),
        Provider("aten", _aten_p2j, _aten_skip("_padded_dense_to_jagged_forward")), bytes_moved=_bytes(2.0)),
    _op("jagged_softmax", ("padded_neg_inf",), _softmax_ref, lambda j: (j.q, j.offsets, j.shape.N),
        _torch(_padded_softmax), bytes_moved=_bytes(2.0)),
    _op("jagged_dense_elementwise_add", ("padded", "dense"),
        lambda j: j.q.float() + from_padded(j.extra["dense"].float(), j.pos), lambda j: (j.q, j.offsets, j.extra["dense"]),
        _torch(_padded_elementwise(torch.add)), bytes_moved=_bytes(3.0)),
    _op("jagged_dense_elementwise_mul", ("padded", "dense"),
        lambda j: j.q.float() * from_padded(j.extra["dense"].float(), j.pos), lambda j: (j.q, j.offsets, j.extra["dense"]),
        _torch(_padded_elementwise(torch.mul)), bytes_moved=_bytes(3.0)),
    _op("jagged_dense_bmm", ("padded", "dense_km"),
        lambda j: from_padded(torch.bmm(j.extra["padded"].float(), j.extra["dense_km"].float()), j.pos),
        lambda j: (j.q, j.offsets, j.extra["dense_km"]), _torch(_padded_dense_bmm), flops=_bmm_flops),
    _op("jagged_jagged_bmm", ("padded", "padded_b"),
        lambda j: torch.bmm(j.extra["padded"].float().transpose(1, 2), j.extra["padded_b"].float()),
        lambda j: (j.q, j.k, j.offsets), _torch(_padded_jagged_bmm, "same"), flops=_bmm_flops),
]

MEMORY_BOUND_OPS = tuple(op.name for op in OPS if op.bytes_moved is not None)
BMM_OPS = tuple(op.name for op in OPS if op.flops is not None)
