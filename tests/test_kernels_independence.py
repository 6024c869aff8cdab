"""Sequences stay independent on every path, and the torch path's work follows the real lengths.

A NaN anywhere in one sequence (its rows, its entries of the batch-shaped inputs), in rows past
max_seq_len, or in padding positions nobody reads must leave every other sequence's outputs and
gradients finite and exactly what they are on clean inputs. A batch of a few tokens with a huge
max_seq_len must cost what its tokens cost: it runs under an address-space limit of 1 GiB more
than the process holds, which any buffer sized by max_seq_len would exceed.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from kernels import (
    jagged_dense_attention,
    jagged_dense_bmm,
    jagged_dense_elementwise_add,
    jagged_dense_elementwise_mul,
    jagged_flash_attention,
    jagged_jagged_bmm,
    jagged_softmax,
    jagged_to_padded,
    padded_to_jagged,
)
from kernels import S2Shards
from kernels._jagged_common import set_poison_outputs

pytestmark = [
    # the Triton interpreter computes on the NaN inputs with numpy, which says so
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

LENGTHS, N = (4, 0, 7, 3), 5  # sequence 0 gets the NaN; sequence 2 is longer than N
T, B = sum(LENGTHS), len(LENGTHS)
NAN = float("nan")


@pytest.fixture(autouse=True)
def _poison():
    set_poison_outputs(True)
    yield
    set_poison_outputs(False)


# Each input and output is described by its kind: "jagged" ([T, ...], rows of sequences),
# "batch" ([B, ...]), "batch_n" ([B, N, ...]: position n of sequence b), "bias" ([B, H, Tq, N])
# or "lse" ([H, T]).


@dataclass
class Op:
    inputs: list[tuple[str, tuple[int, ...]]]  # (kind, shape) of the float inputs
    outputs: list[str]  # kinds of the outputs
    call: Callable  # (inputs, offsets, backend) -> tuple of outputs


def _flash(x, off, be):
    return jagged_flash_attention(*x, off, N, causal=True, return_lse=True, backend=be)


def _s2(x, off, be):
    shards = S2Shards(block=16, local_blocks=1, stride=2)
    return (jagged_flash_attention(*x, off, N, shards=shards, backend=be),)


OPS = {
    "flash_attention": Op([("jagged", (T, 2, 16))] * 3, ["jagged", "lse"], _flash),
    "s2_attention": Op([("jagged", (T, 2, 16))] * 3, ["jagged"], _s2),
    "dense_attention": Op(
        [("batch", (B, 2, 2, 16)), ("jagged", (T, 2, 16)), ("jagged", (T, 2, 16)),
         ("bias", (B, 2, 2, N))], ["batch"],
        lambda x, off, be: (jagged_dense_attention(x[0], x[1], x[2], off, N, bias=x[3], backend=be),)),
    "softmax": Op([("jagged", (T, 3))], ["jagged"],
                  lambda x, off, be: (jagged_softmax(x[0], off, N, backend=be),)),
    "jagged_dense_bmm": Op([("jagged", (T, 3)), ("batch", (B, 3, 2))], ["jagged"],
                           lambda x, off, be: (jagged_dense_bmm(x[0], off, x[1], N, backend=be),)),
    "jagged_jagged_bmm": Op([("jagged", (T, 3)), ("jagged", (T, 2))], ["batch"],
                            lambda x, off, be: (jagged_jagged_bmm(x[0], x[1], off, N, backend=be),)),
    "elementwise_add": Op([("jagged", (T, 3)), ("batch_n", (B, N, 3))], ["jagged"],
                          lambda x, off, be: (jagged_dense_elementwise_add(x[0], off, x[1], backend=be),)),
    "elementwise_mul": Op([("jagged", (T, 3)), ("batch_n", (B, N, 3))], ["jagged"],
                          lambda x, off, be: (jagged_dense_elementwise_mul(x[0], off, x[1], backend=be),)),
    "jagged_to_padded": Op([("jagged", (T, 3))], ["batch"],
                           lambda x, off, be: (jagged_to_padded(x[0], off, N, backend=be),)),
    "padded_to_jagged": Op([("batch_n", (B, N, 3))], ["jagged"],
                           lambda x, off, be: (padded_to_jagged(x[0], off, total=T, backend=be),)),
}


def _row_seq() -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and position of every jagged row."""
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor(LENGTHS))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    return seq, pos


def _poisoned(kind: str, x: torch.Tensor) -> torch.Tensor:
    """NaN in sequence 0, in the rows past N and in the padding positions nobody reads."""
    x = x.clone()
    lengths = torch.tensor(LENGTHS)
    if kind == "jagged":
        seq, pos = _row_seq()
        x[(seq == 0) | (pos >= N)] = NAN
        return x
    x[0] = NAN
    if kind in ("batch_n", "bias"):
        past = torch.arange(N)[None, :] >= lengths[:, None]  # [B, N]
        if kind == "batch_n":
            x[past] = NAN
        else:
            x.permute(0, 3, 1, 2)[past] = NAN
    return x


def _others(kind: str, t: torch.Tensor) -> torch.Tensor:
    """The entries of t that belong to sequences 1..B-1."""
    if kind == "jagged":
        return t[_row_seq()[0] != 0]
    if kind == "lse":
        return t[:, _row_seq()[0] != 0]
    return t[1:]


def _run(op: Op, xs, off, backend, grads_out):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    outs = op.call(xs, off, backend)
    grads = torch.autograd.grad(outs, xs, [g.to(o.dtype) for g, o in zip(grads_out, outs)])
    return [o.detach() for o in outs], grads


def check_nan_stays(name: str, backend: str, device: str) -> None:
    op = OPS[name]
    off = torch.tensor((0, *LENGTHS)).cumsum(0).to(device)
    clean = [torch.randn(shape) for _, shape in op.inputs]
    dirty = [_poisoned(kind, x).to(device) for (kind, _), x in zip(op.inputs, clean)]
    clean = [x.to(device) for x in clean]
    probe = op.call(clean, off, backend)
    # the lse of rows that take no part is -inf: its upstream gradient is zero there
    grads_out = [torch.where(torch.isinf(o), 0.0, torch.randn_like(o)) for o in probe]
    want_out, want_grads = _run(op, clean, off, backend, grads_out)
    got_out, got_grads = _run(op, dirty, off, backend, grads_out)
    pairs = [(f"output {i}", kind, g, w) for i, (kind, g, w) in enumerate(zip(op.outputs, got_out, want_out))]
    pairs += [(f"grad of input {i}", kind, g, w)
              for i, ((kind, _), g, w) in enumerate(zip(op.inputs, got_grads, want_grads))]
    for what, kind, got, want in pairs:
        got, want = _others(kind, got.cpu()), _others(kind, want.cpu())
        assert not bool(torch.isnan(got).any()), f"{name} {backend}: NaN leaked into {what}"
        if device == "cpu":
            assert torch.equal(got, want), f"{name} {backend}: {what} of the clean sequences changed"
        else:  # atomics may add in another order
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{name} {backend}: {what}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(OPS))
def test_nan_in_one_sequence_stays_there(name, backend):
    check_nan_stays(name, backend, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(OPS))
def test_nan_in_one_sequence_stays_there_gpu(name, backend):
    check_nan_stays(name, backend, "cuda")


# ---- a few tokens, a huge max_seq_len ----------------------------------------------------------


@contextlib.contextmanager
def _address_space_headroom(nbytes: int):
    """Cap this process's address space at what it maps now plus nbytes (Linux)."""
    try:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        pytest.skip("needs /proc/self/status")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + nbytes if hard == resource.RLIM_INFINITY else min(hard, vm + nbytes)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


HUGE = 10**9
FEW = (3, 0, 4)


def _huge_case(name: str):
    t, b = sum(FEW), len(FEW)
    shapes = {"flash_attention": [(t, 2, 16)] * 3,
              "dense_attention": [(b, 2, 2, 16), (t, 2, 16), (t, 2, 16)],
              "softmax": [(t, 3)], "jagged_dense_bmm": [(t, 3), (b, 3, 2)],
              "jagged_jagged_bmm": [(t, 3), (t, 2)]}[name]
    calls = {
        "flash_attention": lambda x, n, be: jagged_flash_attention(*x, off, n, causal=True, backend=be),
        "dense_attention": lambda x, n, be: jagged_dense_attention(*x, off, n, backend=be),
        "softmax": lambda x, n, be: jagged_softmax(x[0], off, n, backend=be),
        "jagged_dense_bmm": lambda x, n, be: jagged_dense_bmm(x[0], off, x[1], n, backend=be),
        "jagged_jagged_bmm": lambda x, n, be: jagged_jagged_bmm(x[0], x[1], off, n, backend=be),
    }
    off = torch.tensor((0, *FEW)).cumsum(0)
    return [torch.randn(s) for s in shapes], calls[name]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["flash_attention", "dense_attention", "softmax", "jagged_dense_bmm",
                                  "jagged_jagged_bmm"])
def test_huge_max_seq_len_costs_what_the_tokens_cost(name, backend):
    inputs, call = _huge_case(name)

    def run(n):
        xs = [x.clone().requires_grad_() for x in inputs]
        out = call(xs, n, backend)
        return [out.detach(), *torch.autograd.grad(out, xs, torch.ones_like(out))]

    want = run(max(FEW))  # nothing is truncated at either max_seq_len
    with _address_space_headroom(2**30):
        got = run(HUGE)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
