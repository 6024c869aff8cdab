# throwaway first-speed probe (not committed): ours vs varlen_attn, bf16, H100
import torch, triton
from kernels import jagged_flash_attention, jagged_dense_attention
from torch.nn.attention.varlen import varlen_attn
torch.manual_seed(0)
def lens(B, N, dens):
    return torch.randint(1, max(2, int(2 * dens * N)) + 1, (B,)).clamp(max=N)
def bench(f):
    return triton.testing.do_bench(f, warmup=25, rep=100)
rows = []
for B, N, H, D, dens in [(1024, 1024, 2, 64, 0.25), (1024, 256, 2, 64, 0.25), (4096, 128, 4, 32, 0.3), (256, 1024, 4, 128, 0.25), (1024, 1024, 2, 64, 0.5)]:
    L = lens(B, N, dens).cuda()
    off = torch.zeros(B + 1, dtype=torch.int64, device="cuda"); off[1:] = L.cumsum(0)
    T = int(off[-1]); off32 = off.int()
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    ours = lambda: jagged_flash_attention(q, k, v, off, N)
    peer = lambda: varlen_attn(q, k, v, off32, off32, N, N)
    def fb(f):
        def g():
            o = f(); o.backward(do)
        return g
    with torch.no_grad():
        err = (ours() - peer()).abs().max().item()
    r = (B, N, H, D, dens, bench(ours), bench(peer), bench(fb(ours)), bench(fb(peer)), err)
    print("flash B=%d N=%d H=%d D=%d dens=%.2f | fwd ours %.3f ms varlen %.3f ms | fwd+bwd ours %.3f ms varlen %.3f ms | maxdiff %.2e" % r, flush=True)
for B, N, H, D, dens, Tq in [(1024, 1024, 2, 64, 0.25, 1), (1024, 1024, 2, 64, 0.25, 16), (1024, 1024, 2, 64, 0.25, 64)]:
    L = lens(B, N, dens).cuda()
    off = torch.zeros(B + 1, dtype=torch.int64, device="cuda"); off[1:] = L.cumsum(0)
    T = int(off[-1]); off32 = off.int()
    k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    q = torch.randn(B, Tq, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cq = (torch.arange(B + 1, device="cuda") * Tq).int()
    do = torch.randn_like(q)
    ours = lambda: jagged_dense_attention(q, k, v, off, N)
    peer = lambda: varlen_attn(q.view(B * Tq, H, D), k, v, cq, off32, Tq, N).view(B, Tq, H, D)
    def fb(f):
        def g():
            o = f(); o.backward(do)
        return g
    print("dense B=%d N=%d H=%d D=%d dens=%.2f Tq=%d | fwd ours %.3f ms varlen %.3f ms | fwd+bwd ours %.3f ms varlen %.3f ms" % (B, N, H, D, dens, Tq, bench(ours), bench(peer), bench(fb(ours)), bench(fb(peer))), flush=True)
