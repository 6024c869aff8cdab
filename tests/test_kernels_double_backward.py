"""Second derivatives through every public op, on every path: right, or a clear error.

A gradient penalty differentiates an op's gradient (torch.autograd.grad(..., create_graph=True),
then a backward through a function of that gradient). Each op, on the torch backend, the eager
Triton path (its autograd.Function over the launchers) and through the Triton custom ops (what
torch.compile and functorch transforms see), must either give the second-order gradients of
the float64 references or raise a RuntimeError that names the op and what to use instead,
at the second backward. A first gradient that silently leaves the graph (the penalty then
backpropagates zeros) fails here. On the CPU the Triton kernels run in the interpreter.
"""

from __future__ import annotations

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
from kernels import _jagged_common
from kernels._attention_reference import dense_attention_reference, flash_attention_reference
from kernels.bmm import jagged_dense_bmm_reference, jagged_jagged_bmm_reference
from kernels.conversions import jagged_to_padded_reference, padded_to_jagged_reference
from kernels.elementwise import jagged_dense_elementwise_reference
from kernels.softmax import jagged_softmax_reference

LENGTHS, N = (3, 0, 5, 1), 4  # the 5-long sequence is truncated to N
T, B = sum(LENGTHS), len(LENGTHS)
# ops whose Triton backward has no derivative: they must raise, naming the op
NO_DOUBLE_BACKWARD_ON_TRITON = {"flash_attention", "dense_attention"}


@dataclass
class Op:
    shapes: list[tuple[int, ...]]  # the float inputs, all differentiated
    call: Callable  # (inputs, offsets, backend) -> one tensor
    oracle: Callable  # (inputs, offsets) -> the same through the plain torch references


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _flash(xs, off, be):  # out and lse, both differentiated (the lse gradient has its own path)
    out, lse = jagged_flash_attention(*xs, off, N, causal=True, return_lse=True, backend=be)
    return out + _finite(lse).t()[..., None]


def _flash_out(xs, off, be):
    return jagged_flash_attention(*xs, off, N, causal=True, backend=be)


def _flash_oracle(xs, off):
    out, lse = flash_attention_reference(*xs, off, N, True)
    return out + _finite(lse).t()[..., None]


OPS = {
    "flash_attention": Op([(T, 1, 16)] * 3, _flash, _flash_oracle),
    "dense_attention": Op(
        [(B, 2, 1, 16), (T, 1, 16), (T, 1, 16), (B, 1, 2, N)],
        lambda x, off, be: jagged_dense_attention(x[0], x[1], x[2], off, N, bias=x[3], backend=be),
        lambda x, off: dense_attention_reference(x[0], x[1], x[2], off, N, x[3])[0]),
    "softmax": Op([(T, 3)], lambda x, off, be: jagged_softmax(x[0], off, N, backend=be),
                  lambda x, off: jagged_softmax_reference(x[0], off, N)),
    "jagged_dense_bmm": Op([(T, 3), (B, 3, 2)],
                           lambda x, off, be: jagged_dense_bmm(x[0], off, x[1], N, backend=be),
                           lambda x, off: jagged_dense_bmm_reference(x[0], off, x[1], N)),
    "jagged_jagged_bmm": Op([(T, 3), (T, 2)],
                            lambda x, off, be: jagged_jagged_bmm(x[0], x[1], off, N, backend=be),
                            lambda x, off: jagged_jagged_bmm_reference(x[0], x[1], off, N)),
    "elementwise_add": Op([(T, 3), (B, N, 3)],
                          lambda x, off, be: jagged_dense_elementwise_add(x[0], off, x[1], backend=be),
                          lambda x, off: jagged_dense_elementwise_reference(x[0], off, x[1], False)),
    "elementwise_mul": Op([(T, 3), (B, N, 3)],
                          lambda x, off, be: jagged_dense_elementwise_mul(x[0], off, x[1], backend=be),
                          lambda x, off: jagged_dense_elementwise_reference(x[0], off, x[1], True)),
    "jagged_to_padded": Op([(T, 3)],
                           lambda x, off, be: jagged_to_padded(x[0], off, N, -1.0, backend=be),
                           lambda x, off: jagged_to_padded_reference(x[0], off, N, -1.0)),
    "padded_to_jagged": Op([(B, N, 3)],
                           lambda x, off, be: padded_to_jagged(x[0], off, total=T, backend=be),
                           lambda x, off: padded_to_jagged_reference(x[0], off, T)),
}
# torch: the op on the torch backend; triton: its autograd.Function over the launchers;
# triton_custom_op: the same Function through the Triton custom ops, as under torch.compile
PATHS = ["torch", "triton", "triton_custom_op"]


def _offsets(device) -> torch.Tensor:
    return torch.tensor((0, *LENGTHS), device=device).cumsum(0)


def _first_and_second(fn, xs, weight, dtype):
    """Gradients of loss = sum(w * y + y^2 / 2) (its gradient reads y, so even a linear op has
    a second derivative), recorded; then the gradients of the penalty sum(g^2) of them."""
    xs = [x.detach().to(dtype).requires_grad_() for x in xs]
    y = fn(xs)
    loss = (weight.to(y.dtype) * y).sum() + 0.5 * (y * y).sum()
    first = torch.autograd.grad(loss, xs, create_graph=True)
    penalty = sum((g * g).sum() for g in first)
    return first, lambda: torch.autograd.grad(penalty, xs, allow_unused=True)


def _close(got, want, what):
    assert got is not None, f"{what}: no gradient"
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * scale, msg=what)


def check_double_backward(name: str, path: str, device: str, monkeypatch) -> None:
    op = OPS[name]
    backend = "torch" if path == "torch" else "triton"
    if path == "triton_custom_op":  # what torch.compile and functorch see: the custom ops
        monkeypatch.setattr(_jagged_common, "traced", lambda: True)
    dtype = torch.float64 if backend == "torch" else torch.float32
    off = _offsets(device)
    xs = [torch.randn(s, dtype=torch.float64, device=device) for s in op.shapes]
    weight = torch.randn_like(op.oracle(xs, off))
    want_first, want_second = _first_and_second(lambda x: op.oracle(x, off), xs, weight, torch.float64)
    got_first, got_second = _first_and_second(lambda x: op.call(x, off, backend), xs, weight, dtype)
    for i, (g, w) in enumerate(zip(got_first, want_first)):
        _close(g, w, f"{name} {path}: first gradient of input {i}")
    if backend == "triton" and name in NO_DOUBLE_BACKWARD_ON_TRITON:
        public = f"jagged_{name}"
        with pytest.raises(RuntimeError, match=rf"{public}: double backward .* use backend='torch'"):
            got_second()
        return
    for i, (g, w) in enumerate(zip(got_second(), want_second())):
        _close(g, w, f"{name} {path}: second-order gradient of input {i}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(OPS))
def test_double_backward_matches_fp64_or_raises(name, path, monkeypatch):
    check_double_backward(name, path, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(OPS))
def test_double_backward_matches_fp64_or_raises_gpu(name, path, monkeypatch):
    check_double_backward(name, path, "cuda", monkeypatch)


@pytest.mark.parametrize("name", list(OPS))
def test_torch_backend_gradgradcheck_fp64(name):
    # the torch backend's recorded backward, against finite differences of its first one
    op, off = OPS[name], _offsets("cpu")
    # lse is fp32 on every backend: too coarse for finite differences in fp64 (the test above
    # covers its gradient's derivative)
    call = _flash_out if name == "flash_attention" else op.call
    xs = [torch.randn(s, dtype=torch.float64).requires_grad_() for s in op.shapes]
    assert torch.autograd.gradgradcheck(lambda *x: call(list(x), off, "torch"), xs,
                                        eps=1e-6, atol=1e-6, fast_mode=True)
