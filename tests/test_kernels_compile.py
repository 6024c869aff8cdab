"""The jagged feature-interaction ops under torch.compile(fullgraph=True) and under autocast."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    jagged_dense_bmm,
    jagged_dense_elementwise_add,
    jagged_dense_elementwise_mul,
    jagged_jagged_bmm,
    jagged_softmax,
    jagged_to_padded,
    padded_to_jagged,
)

pytestmark = [
    # torch's own jit imports under inductor (the interpreter's scalar loads: pyproject.toml)
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
LENGTHS, N, D = (0, 1, 13, 40, 5), 32, 24
B = len(LENGTHS)


def _offsets(device="cpu") -> torch.Tensor:
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = torch.tensor(LENGTHS).cumsum(0)
    return off.to(device)


class Tiny(torch.nn.Module):
    """Every op once: softmax -> bmm with a per-user matrix -> mul/add -> both conversions."""

    def __init__(self, backend: str, total_known: bool = True):
        super().__init__()
        self.backend, self.total_known = backend, total_known
        self.w = torch.nn.Parameter(torch.randn(B, D, D) / D**0.5)  # [B, D, D]
        self.pos = torch.nn.Parameter(torch.randn(B, N, D))  # [B, N, D]

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        be = self.backend
        s = jagged_softmax(values, offsets, N, backend=be)  # [T, D]
        y = jagged_dense_bmm(s, offsets, self.w, N, backend=be)  # [T, D]
        y = jagged_dense_elementwise_mul(y, offsets, self.pos, backend=be)
        y = jagged_dense_elementwise_add(y, offsets, self.pos, backend=be)
        g = jagged_jagged_bmm(y, values, offsets, N, backend=be)  # [B, D, D]
        p = jagged_to_padded(y, offsets, N, backend=be)  # [B, N, D]
        total = values.shape[0] if self.total_known else None
        j = padded_to_jagged(p, offsets, total=total, backend=be)  # [T, D]
        return g.square().mean() + j.sum() + p.mean()


def _loss_and_grads(model, values, offsets):
    x = values.detach().clone().requires_grad_()
    loss = model(x, offsets)
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    return loss.detach(), grads


def _compare(model, compiled, values, offsets):
    loss_e, grads_e = _loss_and_grads(model, values, offsets)
    loss_c, grads_c = _loss_and_grads(compiled, values, offsets)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compile_fullgraph_inductor_matches_eager():
    torch._dynamo.reset()
    model, values = Tiny("auto"), torch.randn(sum(LENGTHS), D)
    _compare(model, torch.compile(model, fullgraph=True), values, _offsets())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("total_known", [True, False])
@pytest.mark.slow
def test_compile_sees_one_opaque_op_per_call(backend, total_known):
    # Each public call is a single jagged:: node (the torch reference's loops stay inside it),
    # including padded_to_jagged with a data-dependent T; fwd+bwd run through AOTAutograd. A call
    # that autograd records is the op's autograd.Function: its forward and backward bodies are
    # subgraphs, and the backward's work is jagged:: nodes too.
    torch._dynamo.reset()
    seen, backward = [], []

    def record(gm, example_inputs):
        for name, graph in [("", gm.graph), *((n, m.graph) for n, m in gm.named_children())]:
            calls = [str(n.target) for n in graph.nodes if n.op == "call_function"]
            (backward if name.startswith("bwd_body") else seen).extend(calls)
        return gm.forward

    model, values = Tiny(backend, total_known), torch.randn(sum(LENGTHS), D)
    torch.compile(model, backend=record, fullgraph=True)(values, _offsets())
    jagged = sorted(t.removesuffix(".default") for t in seen if t.startswith("jagged."))
    assert jagged == sorted(
        f"jagged.{name}"
        for name in ("jagged_softmax", "jagged_dense_bmm", "jagged_dense_elementwise_mul",
                     "jagged_dense_elementwise_add", "jagged_jagged_bmm", "jagged_to_padded",
                     "padded_to_jagged")
    )
    glue = {"_set_grad_enabled", "getitem"}
    assert backward and all(t.startswith("jagged.") or t.split()[-1].strip(">") in glue for t in backward), backward
    _compare(model, torch.compile(model, backend="aot_eager", fullgraph=True), values, _offsets())


# ---- autocast -------------------------------------------------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_autocast_dtypes(device, backend):
    off = _offsets(device)
    T = sum(LENGTHS)
    x = torch.randn(T, D, device=device, requires_grad=True)
    w = torch.randn(B, D, 16, device=device, requires_grad=True)
    dense = torch.randn(B, N, 16, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = jagged_dense_bmm(x, off, w, N, backend=backend)  # like torch.bmm: bf16
        g = jagged_jagged_bmm(x, y, off, N, backend=backend)  # mixed fp32/bf16 in: bf16
        z = jagged_dense_elementwise_add(y, off, dense, backend=backend)  # bf16 + fp32: fp32
        m = jagged_dense_elementwise_mul(y, off, dense.bfloat16(), backend=backend)  # bf16
        s = jagged_softmax(y, off, N, backend=backend)  # keeps its input dtype
        p = jagged_to_padded(y, off, N, backend=backend)
        j = padded_to_jagged(p, off, total=T, backend=backend)
    assert (y.dtype, g.dtype, z.dtype, m.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)
    assert (s.dtype, p.dtype, j.dtype) == (torch.bfloat16,) * 3
    (g.float().sum() + z.sum() + m.float().sum() + s.float().sum() + j.float().sum()).backward()
    for t in (x, w, dense):
        assert t.grad is not None and t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all()
    # the result equals casting by hand outside autocast
    y_ref = jagged_dense_bmm(x.detach().bfloat16(), off, w.detach().bfloat16(), N, backend=backend)
    torch.testing.assert_close(y.detach(), y_ref)


def test_autocast_under_compile():
    torch._dynamo.reset()
    model, values = Tiny("auto"), torch.randn(sum(LENGTHS), D)

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(values, _offsets())

    eager = run(model)
    compiled = run(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(compiled, eager)


@pytest.mark.slow  # about 45 s on 2 cores with a cold Triton cache (127 kernels through ptxas)
def test_every_kernel_compiles_for_sm90_without_a_gpu():
    """`python -m experiments gpu-check`: the launchers' real configurations (attention and row-wise
    kernels) through Triton's compiler to a Hopper cubin on this CPU machine (outside the
    interpreter, whose configurations differ)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "experiments", "gpu-check", "--dtypes", "bf16,fp32", "--dims", "64,128"],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and " 0 failures" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    for kernel in ("_flash_fwd_kernel", "_flash_bwd_kernel", "_dense_fwd_kernel", "_dense_bwd_kernel",
                   "_s2_fwd", "_s2_bwd_dq", "_s2_bwd_dkdv", "_jagged_softmax_fwd_kernel", "_jagged_softmax_bwd_kernel",
                   "_jagged_to_padded_kernel", "_padded_to_jagged_kernel", "_jagged_dense_elementwise_fwd_kernel",
                   "_jagged_dense_elementwise_bwd_kernel", "_jagged_dense_bmm_kernel", "_jagged_jagged_bmm_kernel"):
        assert f" {kernel} " in proc.stdout, kernel
    assert " dense split_dq bias=False _dense_bwd_kernel " in proc.stdout  # the SPLIT_DQ variant too
