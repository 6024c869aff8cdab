"""S2 attention's layout (kernels/s2.py): the spec as a brute-force loop against the masked
reference, the layout's checks, coverage, and what the public op does with shards today."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import S2Shards, jagged_flash_attention, offsets_from_lengths, s2_coverage
from kernels._attention_reference import flash_attention_reference
from kernels.s2 import s2_attention_reference

F64 = torch.float64


def brute_force(q, k, v, lengths, max_seq_len, shards, causal, scale):
    """The issue's definition, one (sequence, head, query, key) at a time."""
    out = torch.zeros_like(q)
    H = q.shape[1]
    offs = shards.offsets_for(H)
    start = 0
    for length in lengths:
        n = min(length, max_seq_len)
        for h in range(H):
            for s in range(n):
                keys = []
                for t in range(n):
                    if causal:
                        j, i = t // shards.block, s // shards.block
                        ok = t <= s and (i - j < shards.local_blocks or (j + offs[h]) % shards.stride == 0)
                    else:
                        j = (n - 1 - t) // shards.block
                        ok = j < shards.local_blocks or (j + offs[h]) % shards.stride == 0
                    if ok:
                        keys.append(start + t)
                if keys:
                    sc = torch.stack([q[start + s, h] @ k[t, h] for t in keys]) * scale
                    p = torch.softmax(sc, 0)
                    out[start + s, h] = sum(pi * v[t, h] for pi, t in zip(p, keys))
        start += length
    return out


CASES = [  # lengths, max_seq_len, shards, H, causal
    ([0, 1, 5, 40, 70], 64, S2Shards(16, 1, 2), 3, False),
    ([0, 1, 5, 40, 70], 64, S2Shards(16, 1, 2), 3, True),
    ([33, 48, 16], 48, S2Shards(16, 0, 3, head_offsets=(0, 2)), 2, False),  # some queries see nothing
    ([33, 48, 16], 48, S2Shards(16, 0, 3, head_offsets=(1, 2)), 2, True),
    ([100], 96, S2Shards(32, 2, 4), 1, True),
]


@pytest.mark.parametrize("lengths,N,shards,H,causal", CASES)
def test_masked_reference_is_the_spec(lengths, N, shards, H, causal):
    T, D = sum(lengths), 16
    q, k, v = (torch.randn(T, H, D, dtype=F64) for _ in range(3))
    off = offsets_from_lengths(lengths)
    got = s2_attention_reference(q, k, v, off, N, shards, causal)
    want = brute_force(q, k, v, lengths, N, shards, causal, 1 / math.sqrt(D))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_stride_one_sees_everything_like_dense_attention(causal):
    lengths, N, H, D = [0, 3, 17, 50], 40, 2, 16
    q, k, v = (torch.randn(sum(lengths), H, D, dtype=F64) for _ in range(3))
    off = offsets_from_lengths(lengths)
    got = jagged_flash_attention(q, k, v, off, N, causal=causal, backend="torch", shards=S2Shards(16, 0, 1))
    want = flash_attention_reference(q, k, v, off, N, causal, 1 / math.sqrt(D))[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_gradients_are_those_of_the_masked_math():
    lengths, N, H, D = [5, 0, 21], 20, 2, 16
    off = offsets_from_lengths(lengths)
    xs = [torch.randn(sum(lengths), H, D, dtype=F64, requires_grad=True) for _ in range(3)]
    shards = S2Shards(16, 0, 2)
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda *a: s2_attention_reference(*a, off, N, shards, causal), xs,
                                        fast_mode=True)
    out = jagged_flash_attention(*xs, off, N, backend="torch", shards=shards)
    grads = torch.autograd.grad(out.sum(), xs)
    assert all((g[5 + N:] == 0).all() for g in grads)  # rows past max_seq_len: zero gradient


def test_coverage_counts_the_residues_the_heads_see():
    assert s2_coverage(S2Shards(64, 4, 8), 8) == 1.0  # default offsets spread over 8 residues
    assert s2_coverage(S2Shards(64, 4, 8), 2) == 0.25  # offsets 0, 4: two residues of eight
    assert s2_coverage(S2Shards(64, 4, 8, head_offsets=(1, 1)), 2) == 0.125
    assert S2Shards(64, 4, 8).offsets_for(2) == (0, 4) and S2Shards(64, 4, 3).offsets_for(4) == (0, 1, 2, 0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(block=24, local_blocks=1, stride=2), "block must be a positive multiple of 16"),
    (dict(block=0, local_blocks=1, stride=2), "block must be a positive multiple of 16"),
    (dict(block=16, local_blocks=-1, stride=2), "local_blocks must be >= 0"),
    (dict(block=16, local_blocks=1, stride=0), "stride must be >= 1"),
    (dict(block=16, local_blocks=1, stride=4, head_offsets=(0, 4)), r"head_offsets must be ints in \[0, stride=4\)"),
])
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S2Shards(**kwargs)


def test_the_public_op_refuses_bad_shards():
    off = offsets_from_lengths([3, 4])
    q = k = v = torch.randn(7, 2, 16)
    with pytest.raises(ValueError, match="head_offsets has 3 entries for 2 heads"):
        jagged_flash_attention(q, k, v, off, 8, backend="torch", shards=S2Shards(16, 1, 4, head_offsets=(0, 1, 2)))
    with pytest.raises(NotImplementedError, match="return_lse is not available with shards"):
        jagged_flash_attention(q, k, v, off, 8, backend="torch", return_lse=True, shards=S2Shards(16, 1, 4))
    with pytest.raises(TypeError, match="kernels.S2Shards"):
        jagged_flash_attention(q, k, v, off, 8, backend="torch", shards=(16, 1, 4))


def _ranker_inputs(lengths, N):
    off = offsets_from_lengths(lengths)
    T = sum(lengths)
    return dict(hist_item=torch.randint(0, 50, (T,)), hist_action=torch.zeros(T, dtype=torch.long),
                hist_age=torch.rand(T) * 30, offsets=off, max_seq_len=N,
                cand_item=torch.randint(0, 50, (len(lengths),)), dense=torch.randn(len(lengths), 2))


def test_the_ranker_with_s2_layers():
    from models import Ranker, RankerConfig
    from models.config import S2Config

    base = dict(embed_dim=32, num_heads=2, num_layers=2, mlp_dims=[16], kernel_backend="torch")
    dense = Ranker(RankerConfig(**base), vocab_size=50, n_actions=3, n_dense=2).double()
    for p in dense.parameters():  # the blocks start as the identity: give their outputs weights to check
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.05)
    inputs = _ranker_inputs([0, 5, 40, 64, 70], 64)
    inputs["hist_age"] = inputs["hist_age"].double()
    inputs["dense"] = inputs["dense"].double()
    want = dense(**inputs)

    def with_s2(**s2):
        model = Ranker(RankerConfig(**base, s2=S2Config(**s2)), vocab_size=50, n_actions=3, n_dense=2).double()
        model.load_state_dict(dense.state_dict())  # S2 adds no parameters
        return model(**inputs)

    torch.testing.assert_close(with_s2(block=16, local_blocks=0, stride=1, dense_every=0), want)  # sees all
    sparse = with_s2(block=16, local_blocks=1, stride=2, dense_every=0)
    hybrid = with_s2(block=16, local_blocks=1, stride=2, dense_every=2)
    assert not torch.allclose(sparse, want) and not torch.allclose(hybrid, sparse)
    # a history within the local window sees every key: the same logit as the dense ranker
    torch.testing.assert_close(sparse[1], want[1])


def test_ranker_s2_settings_that_cannot_work_are_refused():
    from models import RankerConfig
    from models.config import InvalidConfig, S2Config

    with pytest.raises(InvalidConfig, match="2 heads see 50% of the block residues of stride 4"):
        RankerConfig(s2=S2Config(block=16, local_blocks=1, stride=4))
    RankerConfig(s2=S2Config(block=16, local_blocks=1, stride=4, allow_partial_context=True))
    with pytest.raises(InvalidConfig, match="needs attention jagged"):
        RankerConfig(attention="sdpa", s2=S2Config(block=16, local_blocks=1, stride=2))
    with pytest.raises(InvalidConfig, match="multiple of 16"):
        S2Config(block=8)


# --- the Triton kernels (in the interpreter on CPU; compiled on a GPU) -------------------------
TRITON_CASES = CASES + [
    ([0, 200, 31, 64], 160, S2Shards(32, 1, 4), 4, False),  # keys past max_seq_len, H=4
    ([0, 200, 31, 64], 160, S2Shards(32, 1, 4), 4, True),
    ([50, 17], 64, S2Shards(48, 1, 2), 2, False),  # a block of 48 rows (not a power of 2)
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,N,shards,H,causal", TRITON_CASES)
def test_triton_kernels_match_the_masked_reference(lengths, N, shards, H, causal, dtype, device):
    from tolerance import assert_close_to_oracle

    D = 48 if shards.block == 48 else 16
    off = offsets_from_lengths(lengths, device)
    xs = [torch.randn(sum(lengths), H, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    out = jagged_flash_attention(*xs, off, N, causal=causal, backend="triton", shards=shards)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, xs, dout)

    def reference(dt):
        ys = [x.detach().to(dt).requires_grad_() for x in xs]
        o = s2_attention_reference(*ys, off, N, shards, causal)
        return o, torch.autograd.grad(o, ys, dout.to(dt))

    (o64, g64), (olow, glow) = reference(F64), reference(dtype)
    tag = f"s2 L={lengths} N={N} {shards} H={H} causal={causal} {dtype}"
    assert_close_to_oracle(out, o64, olow, f"{tag} out")
    for name, g, w, lw in zip(("dq", "dk", "dv"), grads, g64, glow):
        floor = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype] * max(1.0, max(t.abs().max().item() for t in g64))
        assert_close_to_oracle(g, w, lw, f"{tag} {name}", floor=floor)
    past = torch.cat([torch.arange(n, device=device) >= N for n in lengths])
    assert all((g[past] == 0).all() for g in grads), f"{tag}: rows past max_seq_len have gradients"


def _s2_matches_the_reference(causal: bool, tag: str) -> None:
    for lengths, N, shards, H in (([0, 200, 31, 64], 160, S2Shards(32, 1, 4), 2),
                                  ([70, 1, 129], 128, S2Shards(64, 0, 3), 2),
                                  ([96, 40], 96, S2Shards(32, 2, 2, head_offsets=(1,)), 1)):
        off = offsets_from_lengths(lengths)
        xs = [torch.randn(sum(lengths), H, 16, requires_grad=True) for _ in range(3)]
        out = jagged_flash_attention(*xs, off, N, causal=causal, backend="triton", shards=shards)
        ys = [x.detach().double().requires_grad_() for x in xs]
        want = s2_attention_reference(*ys, off, N, shards, causal)
        dout = torch.randn_like(out)
        got_g = torch.autograd.grad(out, xs, dout)
        want_g = torch.autograd.grad(want, ys, dout.double())
        where = f"{tag} {shards} causal={causal}"
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4, msg=where)
        for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=f"{where} {name}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.slow
def test_triton_kernels_with_tall_tiles(causal):
    """The GPU's bf16 tiles (key chunks as tall as the query tile, several chunks a block or one,
    dK/dV query steps shorter than its key rows) in fp32 in the interpreter, where the kernels
    otherwise run 16-row tiles only; set through the route a launch table takes
    (kernels/_launch_configs.py, families s2_fwd and s2_bwd). A config that does not fit a block
    (key chunks of 64 rows in blocks of 32) is ignored there: the hand rule runs, as correct."""
    from kernels import _launch_configs as lc

    for m, n, kv, step in ((32, 32, 32, 16), (16, 16, 32, 16), (32, 16, 16, 32), (64, 64, 64, 64)):
        fwd, bwd = dict(BLOCK_M=m, BLOCK_N=n), dict(BLOCK_M=m, BLOCK_N=n, M_KV=step, N_KV=kv)
        with lc.forced("s2_fwd", fwd), lc.forced("s2_bwd", bwd):
            _s2_matches_the_reference(causal, f"fwd {fwd} bwd {bwd}")


def test_a_launch_config_that_does_not_fit_the_block_is_ignored():
    from kernels import _launch_configs as lc
    from kernels._s2_attention_triton import _launch_args, fits, s2_tiles

    assert fits(dict(BLOCK_M=128, BLOCK_N=64), 64, causal=False) and not fits(dict(BLOCK_M=128, BLOCK_N=64), 64, True)
    assert fits(dict(BLOCK_M=16, BLOCK_N=32, N_KV=64), 32, causal=False)  # non-causal dK/dV tiles may straddle
    assert not fits(dict(BLOCK_M=16, BLOCK_N=64), 32, causal=False)  # a key chunk beyond its block
    q = torch.randn(10, 2, 16)
    with lc.forced("s2_fwd", dict(BLOCK_M=32, BLOCK_N=32)), lc.forced("s2_bwd", dict(N_KV=64, M_KV=16)):
        fwd, dq, dkdv = _launch_args(q, S2Shards(32, 1, 2), True, 2, 16)
    hand_fwd, hand_bwd = s2_tiles(torch.float32, 16, 32)
    assert (fwd["BLOCK_M"], fwd["BLOCK_N"]) == (32, 32)  # fits the block of 32
    assert (dkdv["BLOCK_N"], dkdv["BLOCK_M"]) == (hand_bwd["N_KV"], hand_bwd["M_KV"])  # 64 keys: not in causal blocks of 32
    assert (dq["BLOCK_M"], dq["BLOCK_N"]) == (hand_bwd["BLOCK_M"], hand_bwd["BLOCK_N"])


def test_triton_never_reads_a_key_block_no_head_sees():
    # blocks that no head sees hold NaN: a kernel that loaded them (even times p = 0) would
    # return NaN; the result must equal the reference on clean inputs
    lengths, N, H, D = [96, 40], 96, 1, 16
    shards = S2Shards(16, 1, 2)  # one head, offset 0: blocks 1, 3, 5 (from the end) unseen
    off = offsets_from_lengths(lengths)
    q, k, v = (torch.randn(sum(lengths), H, D) for _ in range(3))
    want = s2_attention_reference(q, k, v, off, N, shards)
    kp, vp = k.clone(), v.clone()
    for start, n in ((0, 96), (96, 40)):
        for t in range(n):
            j = (n - 1 - t) // 16
            if j >= 1 and j % 2 == 1:
                kp[start + t] = float("nan")
                vp[start + t] = float("nan")
    assert torch.isnan(kp).any()
    qg = q.clone().requires_grad_()
    kg, vg = kp.requires_grad_(), vp.requires_grad_()
    got = jagged_flash_attention(qg, kg, vg, off, N, backend="triton", shards=shards)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dq, dk, dv = torch.autograd.grad(got.sum(), (qg, kg, vg))
    qr = q.clone().requires_grad_()
    (dq_want,) = torch.autograd.grad(s2_attention_reference(qr, k, v, off, N, shards).sum(), (qr,))
    torch.testing.assert_close(dq, dq_want, rtol=1e-5, atol=1e-5)
    unseen = torch.isnan(kp[:, 0, 0])
    assert (dk[unseen] == 0).all() and (dv[unseen] == 0).all() and torch.isfinite(dk).all()


def test_bench_ideal_speedup_and_report(tmp_path):
    from experiments.bench import s2 as bench

    lengths = torch.tensor([0, 64, 100, 250])
    assert bench.visible_fraction(lengths, S2Shards(16, 0, 1), 2) == 1.0  # stride 1: every block
    # non-causal, one head, offset 0, 4 blocks (n=64): local block 0 and strided blocks 0, 2 of 4
    assert bench.visible_fraction(torch.tensor([64]), S2Shards(16, 1, 2), 1) == 0.5
    # causal: 3 blocks, pairs (i>=j) 6; seen: diagonal (local 1) 3 + strided j=0 below it 2 = 5
    assert bench.visible_fraction(torch.tensor([48]), S2Shards(16, 1, 2), 1, causal=True) == 5 / 6
    rows = [dict(N=4096, B=64, T=1, stride=s, dense_ms=2.0, varlen_ms=None if s == 8 else 3.0, s2_ms=2.0 / s,
                 speedup_dense=float(s), speedup_varlen=None if s == 8 else 1.5 * s, ideal=s * 1.2,
                 efficiency=1 / 1.2, max_err=1e-3) for s in (2, 8)]
    stamp = dict(gpu="Test GPU", gpu_slug="test-gpu", torch="x", triton="y", cuda="z", python="p", commit="abc",
                 date="d")
    md = bench.write(rows, stamp, tmp_path, type("A", (), {"dtype": "bfloat16"}))
    text = md.read_text()
    assert "| 4096 | 64 | 8 | 2.000 | - | 0.250 | 8.00x | - | 9.60x | 0.83 | 1.0e-03 |" in text
    assert md.name == "s2.md" and (tmp_path / "s2.png").is_file() and "commit abc" in text


@pytest.mark.slow
def test_triton_s2_compiles_as_one_opaque_op_per_call():
    """Under torch.compile(fullgraph=True) the Triton route is the op's custom ops (no graph break),
    and the compiled forward and gradients equal the eager ones."""
    torch._dynamo.reset()
    lengths, N, shards, H, D = [0, 40, 17, 64], 64, S2Shards(16, 1, 2), 2, 16
    off = offsets_from_lengths(lengths)
    xs = [torch.randn(sum(lengths), H, D) for _ in range(3)]
    seen = []

    def record(gm, example_inputs):
        for _, graph in [("", gm.graph), *((n, m.graph) for n, m in gm.named_children())]:
            seen.extend(str(n.target) for n in graph.nodes if n.op == "call_function")
        return gm.forward

    def attend(q, k, v):
        return jagged_flash_attention(q, k, v, off, N, causal=True, backend="triton", shards=shards)

    def loss_and_grads(fn):
        ys = [x.clone().requires_grad_() for x in xs]
        out = fn(*ys)
        return out.detach(), torch.autograd.grad(out.square().sum(), ys)

    torch.compile(attend, backend=record, fullgraph=True)(*[x.clone().requires_grad_() for x in xs])
    assert [t for t in seen if t.startswith("jagged.")] == ["jagged.s2_attention_fwd.default",
                                                            "jagged.s2_attention_bwd.default"], seen
    (out_e, g_e), (out_c, g_c) = loss_and_grads(attend), loss_and_grads(torch.compile(attend, backend="aot_eager",
                                                                                         fullgraph=True))
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_triton_s2_double_backward_raises_a_clear_error():
    lengths, N = [5, 12], 16
    off = offsets_from_lengths(lengths)
    xs = [torch.randn(sum(lengths), 1, 16, requires_grad=True) for _ in range(3)]
    out = jagged_flash_attention(*xs, off, N, backend="triton", shards=S2Shards(16, 1, 2))
    (gq,) = torch.autograd.grad(out.square().sum(), xs[:1], create_graph=True)
    with pytest.raises(RuntimeError, match=r"jagged_flash_attention \(shards\): double backward .* use backend='torch'"):
        gq.sum().backward()


def test_the_head_offsets_reach_the_device_once():
    """The kernels' [H] head offsets are made once per (offsets, device) and reused: a tensor built
    from host ints on every call is a host-to-device copy, which CUDA graph capture refuses."""
    from kernels._s2_attention_triton import _head_offsets

    a, b = _head_offsets(S2Shards(16, 1, 4), 4, "cpu"), _head_offsets(S2Shards(16, 2, 4), 4, torch.device("cpu"))
    assert a is b and a.tolist() == [0, 1, 2, 3] and a.dtype == torch.int32
    assert _head_offsets(S2Shards(16, 1, 4, head_offsets=(3, 2, 1, 0)), 4, "cpu").tolist() == [3, 2, 1, 0]


@pytest.mark.gpu
def test_s2_forward_and_backward_replay_in_a_cuda_graph():
    """The training loop's CUDA graphs (pipeline.cuda_graphs: warm up, then capture) take S2 layers:
    the replay gives the eager forward and gradients."""
    lengths, N, shards, H, D = [0, 300, 17, 129], 256, S2Shards(32, 1, 4), 4, 64
    off = offsets_from_lengths(lengths, "cuda")
    xs = [torch.randn(sum(lengths), H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(sum(lengths), H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        out = jagged_flash_attention(*xs, off, N, backend="triton", shards=shards)
        return (out, *torch.autograd.grad(out, xs, dout))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = [t.clone() for t in step()]  # the warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
