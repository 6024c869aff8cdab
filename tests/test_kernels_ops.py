"""Jagged feature-interaction ops: Triton kernels vs the fp32 references, forward and backward.

Every op, its output and every input gradient, over awkward shapes (length 0 and 1, lengths that
are no multiple of any block, sequences longer than max_seq_len, B = 1, non-power-of-two dims)
and all dtypes, with the flash-attn rule of tests/tolerance.py: the kernel's error against an
fp64 oracle is at most 2x the error of the torch backend in the same dtype, plus a small floor.
Kernel outputs are NaN-poisoned before launch, so an unwritten element fails the finite check.
On CPU the kernels run in the Triton interpreter (small shapes); `gpu` cases add big ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from kernels import (
    jagged_dense_bmm,
    jagged_dense_elementwise_add,
    jagged_dense_elementwise_mul,
    jagged_jagged_bmm,
    jagged_softmax,
    jagged_to_padded,
    offsets_from_lengths,
    padded_to_jagged,
)
from kernels._jagged_common import set_poison_outputs
from kernels.bmm import jagged_dense_bmm_reference, jagged_jagged_bmm_reference
from kernels.conversions import jagged_to_padded_reference, padded_to_jagged_reference
from kernels.elementwise import jagged_dense_elementwise_reference
from kernels.softmax import jagged_softmax_reference
from tolerance import assert_close_to_oracle, max_abs_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _poison():
    set_poison_outputs(True)
    yield
    set_poison_outputs(False)


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    N: int  # max_seq_len
    D: int  # feature dim (the K of the bmm ops)
    M: int  # the other bmm dim


def _power_law_lengths(B: int, top: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(B, generator=gen)
    return tuple(int(x) for x in (top * u**3).long())  # many short, a few long, some 0


CPU_CASES = [
    Case("mixed", (0, 1, 127, 129, 5), N=128, D=48, M=16),  # 129 is truncated to 128
    Case("b1", (129,), N=160, D=16, M=64),  # B = 1, padding past the length
    Case("trunc", (3, 0, 40, 17), N=16, D=64, M=48),  # most sequences longer than N
]
GPU_CASES = [
    Case("long", (1000, 0, 1, 999, 513), N=1000, D=128, M=96),
    Case("many", _power_law_lengths(300, 1200, seed=1), N=1024, D=96, M=128),
    Case("many_d48", _power_law_lengths(200, 600, seed=2), N=256, D=48, M=40),
]
DEVICE_CASES = [pytest.param("cpu", c, id=f"cpu-{c.name}") for c in CPU_CASES] + [
    pytest.param("cuda", c, id=f"cuda-{c.name}", marks=pytest.mark.gpu) for c in CPU_CASES + GPU_CASES
]


def make_offsets(lengths, device="cpu", dtype=torch.int64) -> torch.Tensor:
    return offsets_from_lengths(lengths, device, dtype)


def randn(*shape, dtype, device, scale=1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape)).to(device=device, dtype=dtype)


# ---- one description per op: inputs, the public call, the plain reference (the oracle) ----


@dataclass
class OpCase:
    inputs: list[torch.Tensor]  # the float inputs, all differentiated
    call: Callable[[list[torch.Tensor], str], torch.Tensor]  # (inputs, backend) -> output
    oracle: Callable[[list[torch.Tensor]], torch.Tensor]  # plain torch reference, autograd


def _op_to_padded(c: Case, off, dt, dev) -> OpCase:
    T, pad = int(off[-1]), -1.5
    return OpCase(
        [randn(T, c.D, dtype=dt, device=dev)],
        lambda x, be: jagged_to_padded(x[0], off, c.N, pad, backend=be),
        lambda x: jagged_to_padded_reference(x[0], off, c.N, pad),
    )


def _op_to_jagged(c: Case, off, dt, dev) -> OpCase:
    T, B = int(off[-1]), off.numel() - 1
    total = T if c.name != "b1" else None  # both ways of getting T
    return OpCase(
        [randn(B, c.N, c.D, dtype=dt, device=dev)],
        lambda x, be: padded_to_jagged(x[0], off, total=total, backend=be),
        lambda x: padded_to_jagged_reference(x[0], off, T),
    )


def _op_softmax(c: Case, off, dt, dev) -> OpCase:
    return OpCase(
        [randn(int(off[-1]), c.D, dtype=dt, device=dev, scale=3.0)],
        lambda x, be: jagged_softmax(x[0], off, c.N, backend=be),
        lambda x: jagged_softmax_reference(x[0], off, c.N),
    )


def _op_dense_bmm(c: Case, off, dt, dev) -> OpCase:
    B = off.numel() - 1
    return OpCase(
        [randn(int(off[-1]), c.D, dtype=dt, device=dev), randn(B, c.D, c.M, dtype=dt, device=dev)],
        lambda x, be: jagged_dense_bmm(x[0], off, x[1], c.N, backend=be),
        lambda x: jagged_dense_bmm_reference(x[0], off, x[1], c.N),
    )


def _op_jagged_bmm(c: Case, off, dt, dev) -> OpCase:
    T = int(off[-1])
    return OpCase(
        [randn(T, c.D, dtype=dt, device=dev), randn(T, c.M, dtype=dt, device=dev)],
        lambda x, be: jagged_jagged_bmm(x[0], x[1], off, c.N, backend=be),
        lambda x: jagged_jagged_bmm_reference(x[0], x[1], off, c.N),
    )


def _op_elementwise(fn, is_mul) -> Callable:
    def make(c: Case, off, dt, dev) -> OpCase:
        B = off.numel() - 1
        return OpCase(
            [randn(int(off[-1]), c.D, dtype=dt, device=dev), randn(B, c.N, c.D, dtype=dt, device=dev)],
            lambda x, be: fn(x[0], off, x[1], backend=be),
            lambda x: jagged_dense_elementwise_reference(x[0], off, x[1], is_mul),
        )

    return make


OPS = {
    "jagged_to_padded": _op_to_padded,
    "padded_to_jagged": _op_to_jagged,
    "jagged_softmax": _op_softmax,
    "jagged_dense_bmm": _op_dense_bmm,
    "jagged_jagged_bmm": _op_jagged_bmm,
    "elementwise_add": _op_elementwise(jagged_dense_elementwise_add, is_mul=False),
    "elementwise_mul": _op_elementwise(jagged_dense_elementwise_mul, is_mul=True),
}


def _run(op: OpCase, inputs: list[torch.Tensor], grad: torch.Tensor, fn) -> tuple:
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(xs)
    grads = torch.autograd.grad(out, xs, grad.to(out.dtype))
    return out.detach(), grads


def check_op(op: OpCase) -> float:
    """Triton output and gradients vs the fp64 oracle, bounded by the torch backend's error.

    Returns the worst max|kernel - oracle| / max(1, max|oracle|) over the output and gradients.
    """
    probe = op.call(op.inputs, "torch")
    grad = torch.randn(probe.shape).to(device=probe.device, dtype=probe.dtype)
    out, grads = _run(op, op.inputs, grad, lambda x: op.call(x, "triton"))
    out_t, grads_t = _run(op, op.inputs, grad, lambda x: op.call(x, "torch"))
    out_o, grads_o = _run(op, [x.double() for x in op.inputs], grad.double(), op.oracle)
    assert out.dtype == op.inputs[0].dtype
    assert_close_to_oracle(out, out_o, out_t, "output")
    for i, (g, g_t, g_o) in enumerate(zip(grads, grads_t, grads_o)):
        assert g.dtype == op.inputs[i].dtype
        assert_close_to_oracle(g, g_o, g_t, f"grad of input {i}")
    pairs = [(out, out_o), *zip(grads, grads_o)]
    return max(max_abs_err(a, o) / max(1.0, o.abs().max().item() if o.numel() else 0.0) for a, o in pairs)


@pytest.mark.parametrize("device,case", DEVICE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", list(OPS))
def test_op_matches_reference(op_name, dtype, device, case):
    off = make_offsets(case.lengths, device)
    check_op(OPS[op_name](case, off, dtype, device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op_name", list(OPS))
def test_int32_offsets_empty_and_all_zero_lengths(op_name, device):
    # int32 offsets; B with only empty sequences (T = 0); max_seq_len 0 (everything truncated)
    for lengths, N in (((5, 0, 33), 20), ((0, 0), 8), ((4, 2), 0)):
        case = Case("edge", lengths, N=N, D=24, M=40)
        off = make_offsets(lengths, device, torch.int32)
        check_op(OPS[op_name](case, off, torch.float32, device))


def _strided(x: torch.Tensor) -> torch.Tensor:
    """Same values, non-unit innermost stride (a non-contiguous view)."""
    y = torch.empty(*x.shape, 2, dtype=x.dtype, device=x.device)[..., 0]
    return y.copy_(x)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op_name", list(OPS))
def test_non_contiguous_inputs(op_name, device):
    case = Case("strided", (7, 0, 40), N=32, D=40, M=24)
    off = make_offsets(case.lengths, device)
    op = OPS[op_name](case, off, torch.float32, device)
    call = op.call
    op.call = lambda x, be: call([_strided(t) for t in x], be)
    check_op(op)
    # and the other way round: transposed views (column-major values, transposed dense)
    op.call = lambda x, be: call([t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in x], be)
    check_op(op)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_conversions_exact_and_padding_value(device):
    off = make_offsets((3, 0, 9, 1), device)
    values = torch.randn(13, 20, device=device)
    for be in ("torch", "triton"):
        padded = jagged_to_padded(values, off, 6, float("-inf"), backend=be)
        assert torch.isneginf(padded[0, 3:]).all() and torch.isneginf(padded[1]).all()
        back = padded_to_jagged(padded, off, backend=be)
        keep = torch.tensor([1, 1, 1] + [1] * 6 + [0] * 3 + [1], dtype=torch.bool, device=device)
        assert torch.equal(back[keep], values[keep]) and (back[~keep] == 0).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_softmax_extreme_values(device):
    # huge logits (a naive exp overflows) and -inf entries (masked items) stay finite
    off = make_offsets((4, 70, 1), device)
    x = torch.randn(75, 3, device=device) * 1e4
    x[5:30, 1] = float("-inf")
    for be in ("torch", "triton"):
        y = jagged_softmax(x, off, 128, backend=be)
        assert torch.isfinite(y).all()
        sums = torch.stack([y[0:4].sum(0), y[4:74].sum(0), y[74:].sum(0)])
        torch.testing.assert_close(sums, torch.ones_like(sums))
        assert (y[5:30, 1] == 0).all()


# ---- launch configurations: every path of the slot layout and of the softmax tiles ---------


def _small_tiles(monkeypatch) -> None:
    """Shrink the launchers' tiles so that short CPU cases take every path: several work slots
    per sequence, truncated tails over several slots, and softmax's small single tile, large
    single tile and two-pass stream in one batch."""
    from kernels import _bmm_triton, _conversions_triton, _elementwise_triton, _softmax_triton

    monkeypatch.setitem(_conversions_triton.P2J_CONFIG, "BLOCK_N", 16)
    monkeypatch.setitem(_elementwise_triton.FWD_CONFIG, "BLOCK_N", 16)
    monkeypatch.setitem(_softmax_triton.SOFTMAX_CONFIG, "BLOCK_N", 32)
    monkeypatch.setitem(_softmax_triton.SOFTMAX_CONFIG, "SMALL_N", 16)
    monkeypatch.setitem(_softmax_triton.SOFTMAX_CONFIG, "STREAM_N", 16)
    for table in (_bmm_triton.DENSE_BMM_CONFIGS, _bmm_triton.JAGGED_BMM_CONFIGS):
        for cfg in table.values():
            monkeypatch.setitem(cfg, "BLOCK_T", 16)


TILE_CASES = [
    # softmax: 0-16 one small tile, 17-32 one large tile, longer ones streamed; 90 > N
    Case("tiles", (0, 1, 15, 16, 17, 32, 33, 70, 0, 90), N=80, D=20, M=24),
    Case("tiles_b1", (61,), N=20, D=16, M=16),  # B = 1, the truncated tail spans 3 slots
    Case("tiles_many", _power_law_lengths(70, 40, seed=3), N=24, D=16, M=16),  # > 64 sequences
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("op_name", list(OPS))
def test_small_tiles_every_path(op_name, case, device, monkeypatch):
    _small_tiles(monkeypatch)
    off = make_offsets(case.lengths, device)
    for dtype in (torch.float32, torch.bfloat16) if case.name == "tiles" else (torch.float32,):
        check_op(OPS[op_name](case, off, dtype, device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_jagged_jagged_bmm_split_t(splits, device, monkeypatch):
    """T_SPLITS > 1 (split-T): each sequence's rows cut in chunks of whole BLOCK_T steps whose
    partial products are added atomically in fp32: empty sequences, chunks past a short
    sequence's end, truncated tails and uneven chunks; forward and both gradients (the backward
    runs jagged_dense_bmm and jagged_jagged_bmm too)."""
    from kernels import _bmm_triton

    _small_tiles(monkeypatch)
    for cfg in _bmm_triton.JAGGED_BMM_CONFIGS.values():
        monkeypatch.setitem(cfg, "T_SPLITS", splits)
    case = Case("split_t", (0, 1, 16, 17, 70, 5, 0, 90), N=80, D=24, M=40)
    off = make_offsets(case.lengths, device)
    for dtype in (torch.float32, torch.bfloat16):
        check_op(OPS["jagged_jagged_bmm"](case, off, dtype, device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_softmax_default_tiles_long_and_short(device):
    # the shipped tile sizes: one batch with sequences at both edges of every rung of the tile
    # ladder (small, 2 * small, ..., big rows) and streamed ones
    from kernels._softmax_triton import SOFTMAX_CONFIG

    big, small = SOFTMAX_CONFIG["BLOCK_N"], SOFTMAX_CONFIG["SMALL_N"]
    rungs = [small << k for k in range((big // small).bit_length())]
    assert rungs[-1] == big
    edges = [n for rows in rungs for n in (rows // 2 + 1, rows)]
    lengths = (big + 37, 2, 0, *edges, 2 * big + 9)  # the 2 * big + 9 one is truncated
    case = Case("softmax_tiles", lengths, N=2 * big, D=20, M=16)
    check_op(_op_softmax(case, make_offsets(lengths, device), torch.float32, device))


# ---- references: fp64 gradcheck of every op's torch backend (its custom-op backward) --------


def _gradcheck_inputs(op_name: str):
    lengths, N, D, M = (2, 0, 3), 2, 3, 2  # the 3-long sequence is truncated
    case = Case("tiny", lengths, N=N, D=D, M=M)
    off = make_offsets(lengths)
    return OPS[op_name](case, off, torch.float64, "cpu")


@pytest.mark.parametrize("op_name", list(OPS))
def test_reference_gradcheck_fp64(op_name):
    op = _gradcheck_inputs(op_name)
    xs = [x.clone().requires_grad_() for x in op.inputs]
    assert torch.autograd.gradcheck(lambda *x: op.call(list(x), "torch"), xs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("op_name", ["jagged_to_padded", "padded_to_jagged", "jagged_dense_bmm", "jagged_jagged_bmm"])
def test_reference_gradgradcheck_fp64(op_name):
    # these ops' backwards are made of the forward ops, so they are twice differentiable
    op = _gradcheck_inputs(op_name)
    xs = [x.clone().requires_grad_() for x in op.inputs]
    assert torch.autograd.gradgradcheck(lambda *x: op.call(list(x), "torch"), xs, eps=1e-6, atol=1e-8)


# ---- GPU: a larger randomized sweep (every dtype, any dims) ---------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
def test_random_sweep_gpu(op_name):
    gen = torch.Generator().manual_seed(1234)
    worst = {dtype: 0.0 for dtype in DTYPES}
    for i in range(12):
        B = int(torch.randint(1, 512, (1,), generator=gen))
        top = int(torch.randint(1, 2048, (1,), generator=gen))
        N = int(torch.randint(1, 1536, (1,), generator=gen))
        D = int(torch.randint(1, 257, (1,), generator=gen))
        M = int(torch.randint(1, 257, (1,), generator=gen))
        dtype = DTYPES[i % 3]
        case = Case(f"sweep{i}", _power_law_lengths(B, top, seed=i), N=N, D=D, M=M)
        off = make_offsets(case.lengths, "cuda")
        worst[dtype] = max(worst[dtype], check_op(OPS[op_name](case, off, dtype, "cuda")))
    print(f"\n{op_name}: 12 random cases passed; worst relative error " + ", ".join(
        f"{str(dt).removeprefix('torch.')} {err:.2e}" for dt, err in worst.items()))


@pytest.mark.parametrize("name", ["jagged_dense_bmm", "jagged_jagged_bmm"])
def test_bmm_eager_triton_path_double_backward(name):
    """The eager Triton path (an autograd.Function over the launchers) records its backward when
    asked (create_graph=True): second derivatives match the torch reference's."""
    from kernels import jagged_dense_bmm, jagged_jagged_bmm

    torch.manual_seed(0)
    lengths, N, K, M = [3, 0, 7, 20], 16, 16, 24
    off = make_offsets(lengths, "cpu", torch.int64)
    T, B = sum(lengths), len(lengths)
    a = torch.randn(T, K, dtype=torch.float64)
    other = torch.randn(B, K, M, dtype=torch.float64) if name == "jagged_dense_bmm" else torch.randn(T, M, dtype=torch.float64)
    fn = jagged_dense_bmm if name == "jagged_dense_bmm" else jagged_jagged_bmm

    def second(backend):
        x, y = (t.float().requires_grad_() for t in (a, other))
        out = fn(x, off, y, N, backend=backend) if name == "jagged_dense_bmm" else fn(x, y, off, N, backend=backend)
        gx, gy = torch.autograd.grad((out * out.detach().cos()).sum(), (x, y), create_graph=True)
        return torch.autograd.grad((gx.sin().sum() + (gy * gy).sum()), (x, y))

    for got, ref in zip(second("triton"), second("torch")):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_conversions_eager_triton_path_double_backward():
    """As for the bmm ops: jagged_to_padded / padded_to_jagged record their backward on request."""
    from kernels import jagged_to_padded, padded_to_jagged

    torch.manual_seed(0)
    lengths, N, D = [3, 0, 7, 20], 16, 16
    off = make_offsets(lengths, "cpu", torch.int64)
    x0 = torch.randn(sum(lengths), D)

    def second(backend):
        x = x0.clone().requires_grad_()
        p = jagged_to_padded(x, off, N, backend=backend)
        back = padded_to_jagged(p * p, off, total=x.shape[0], backend=backend)
        (gx,) = torch.autograd.grad((back * back.detach().cos()).sum(), x, create_graph=True)
        return torch.autograd.grad((gx * gx).sum(), x)

    torch.testing.assert_close(second("triton")[0], second("torch")[0], rtol=1e-5, atol=1e-5)


def test_no_grad_triton_calls_match_the_reference():
    """Without autograd to record, the public ops call their Triton launchers directly (no custom
    op dispatch); the results are those of the torch reference."""
    from kernels import (jagged_dense_bmm, jagged_dense_elementwise_add, jagged_dense_elementwise_mul,
                         jagged_jagged_bmm, jagged_softmax, jagged_to_padded, padded_to_jagged)

    torch.manual_seed(0)
    lengths, N, D = [3, 0, 7, 20, 1], 16, 16
    off = make_offsets(lengths, "cpu", torch.int64)
    T, B = sum(lengths), len(lengths)
    x, y, w, dense = torch.randn(T, D), torch.randn(T, D), torch.randn(B, D, D), torch.randn(B, N, D)
    calls = {
        "softmax": lambda be: jagged_softmax(x, off, N, backend=be),
        "add": lambda be: jagged_dense_elementwise_add(x, off, dense, backend=be),
        "mul": lambda be: jagged_dense_elementwise_mul(x, off, dense, backend=be),
        "dense_bmm": lambda be: jagged_dense_bmm(x, off, w, N, backend=be),
        "jagged_bmm": lambda be: jagged_jagged_bmm(x, y, off, N, backend=be),
        "to_padded": lambda be: jagged_to_padded(x, off, N, backend=be),
        "to_jagged": lambda be: padded_to_jagged(dense, off, total=T, backend=be),
    }
    with torch.no_grad():
        for name, call in calls.items():
            torch.testing.assert_close(call("triton"), call("torch"), rtol=1e-5, atol=1e-5, msg=name)


def test_split_t_is_off_under_deterministic_algorithms(monkeypatch):
    """Split-T adds fp32 partial products in arrival order: with torch asked for deterministic
    algorithms the launcher runs one program per output tile instead."""
    from kernels import _bmm_triton
    from experiments.bench import gpu_check

    monkeypatch.setattr(_bmm_triton, "split_t", lambda *a: 4)  # the hand rule asks for split-T
    a = torch.empty(64, 32, device="meta", dtype=torch.bfloat16)
    off = torch.empty(3, device="meta", dtype=torch.int64)

    def splits() -> int:
        (call,) = gpu_check._record(lambda: _bmm_triton.jagged_jagged_bmm_triton(a, a, off, 32))
        return call[2]["T_SPLITS"]

    assert splits() == 4
    torch.use_deterministic_algorithms(True)
    try:
        assert splits() == 1
    finally:
        torch.use_deterministic_algorithms(False)


def test_split_t_hand_rule_only_where_few_output_tiles_meet_long_sequences():
    """The hand rule splits the reduction (T_SPLITS 4) where B x output tiles leave half the SMs
    idle and the mean length is long (the long suite's B64 N8192 D128 fill 0.5 on an H200: kernels
    1.38x faster; fill 0.1, mean 819, 0.85x: not split); a launch table's or forced config wins."""
    from kernels import _bmm_triton as bt
    from kernels import _launch_configs as lc

    bf16 = torch.bfloat16
    assert bt.bmm_config("jagged", 128, 128, bf16, B=64, N=8192, T=64 * 4096, sms=132)["T_SPLITS"] == 4
    assert bt.bmm_config("jagged", 128, 128, bf16, B=64, N=8192, T=64 * 819, sms=132)["T_SPLITS"] == 1  # short
    assert bt.bmm_config("jagged", 128, 128, bf16, B=256, N=8192, T=256 * 4096, sms=132)["T_SPLITS"] == 1  # SMs busy
    assert bt.bmm_config("jagged", 256, 256, bf16, B=64, N=8192, T=64 * 4096, sms=132)["T_SPLITS"] == 1  # 4 tiles each
    assert bt.bmm_config("jagged", 128, 128, bf16, B=64, N=8192, T=64 * 4096, sms=0)["T_SPLITS"] == 1  # unknown SMs
    assert "T_SPLITS" not in bt.bmm_config("dense", 128, 128, bf16, B=64, N=8192, T=64 * 4096, sms=132)
    with lc.forced("jagged_jagged_bmm", {"T_SPLITS": 2}):
        assert bt.bmm_config("jagged", 128, 128, bf16, B=64, N=8192, T=64 * 4096, sms=132)["T_SPLITS"] == 2


def test_softmax_hand_rule_streams_in_large_tiles_only_where_most_sequences_stream():
    from kernels._softmax_triton import SOFTMAX_CONFIG, softmax_config

    big = SOFTMAX_CONFIG["BLOCK_N"]
    assert softmax_config(B=10, T=10 * big)["STREAM_N"] == SOFTMAX_CONFIG["STREAM_N"] < big  # mean fits one tile
    assert softmax_config(B=10, T=10 * big + 10)["STREAM_N"] == big  # mean longer than the largest tile
    assert softmax_config(B=0, T=0) is SOFTMAX_CONFIG
