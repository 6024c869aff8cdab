"""The attention ops inside models: torch.compile(fullgraph=True) on the CPU path, autocast."""

import pytest
import torch

from attention_checks import make_offsets
from kernels import jagged_dense_attention, jagged_flash_attention


class _TinyRanker(torch.nn.Module):
    """Self-attention over the user's history, then candidate items attending over it."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.h, self.d = heads, d
        self.qkv = torch.nn.Linear(heads * d, 3 * heads * d)
        self.cand = torch.nn.Linear(heads * d, heads * d)

    def forward(self, x, offsets, items, bias, max_seq_len: int):
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.h, self.d).unbind(1)
        hist = jagged_flash_attention(q, k, v, offsets, max_seq_len, causal=True)
        B, Tq = items.shape[:2]
        cq = self.cand(items).view(B, Tq, self.h, self.d)
        out = jagged_dense_attention(cq, hist, hist, offsets, max_seq_len, bias=bias)
        return out.float().sum(dim=(1, 2, 3))


def _inputs(d=16, heads=2):
    lengths, N, Tq = [5, 0, 9, 3], 8, 3
    off = make_offsets(lengths, "cpu")
    x = torch.randn(sum(lengths), heads * d)
    items = torch.randn(len(lengths), Tq, heads * d)
    bias = torch.randn(len(lengths), heads, Tq, N, requires_grad=True)
    return x, off, items, bias, N


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    torch.manual_seed(0)
    model = _TinyRanker()
    x, off, items, bias, N = _inputs()
    want = model(x, off, items, bias, N)
    g_want = torch.autograd.grad(want.sum(), [bias, *model.parameters()])
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = compiled(x, off, items, bias, N)
    g_got = torch.autograd.grad(got.sum(), [bias, *model.parameters()])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_autocast_bf16_cpu():
    model = _TinyRanker()
    x, off, items, bias, N = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        T = x.shape[0]
        q, k, v = model.qkv(x).view(T, 3, 2, 16).unbind(1)
        assert q.dtype == torch.bfloat16
        # mixed inputs (fp32 k, v next to the bf16 q) are cast to the autocast dtype
        hist = jagged_flash_attention(q, k.float(), v.float(), off, N)
        assert hist.dtype == torch.bfloat16
        cq = torch.randn(4, 3, 2, 16)  # fp32 queries
        out = jagged_dense_attention(cq, hist, hist, off, N, bias=bias)
        assert out.dtype == torch.bfloat16
        loss = out.float().sum()
    loss.backward()
    assert bias.grad is not None and bias.grad.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.qkv.parameters())
    # the op really ran in bf16: compare with an explicit bf16 run
    with torch.no_grad():
        ref = jagged_flash_attention(q.detach(), k.detach().bfloat16(), v.detach().bfloat16(),
                                     off, N)
    torch.testing.assert_close(hist.detach(), ref)


@pytest.mark.gpu
def test_compile_fullgraph_gpu_triton():
    torch.manual_seed(0)
    model = _TinyRanker().cuda()
    x, off, items, bias, N = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _inputs())
    bias = bias.detach().requires_grad_()
    want = model(x, off, items, bias, N)
    g_want = torch.autograd.grad(want.sum(), [bias, *model.parameters()])
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True)(x, off, items, bias, N)
    g_got = torch.autograd.grad(got.sum(), [bias, *model.parameters()])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
