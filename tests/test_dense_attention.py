"""jagged_dense_attention: Triton (interpreter on CPU, compiled on GPU) and torch backends
against the fp32/fp64 reference, forward and the q, k, v and bias gradients."""

import random

import pytest
import torch

import attention_checks
from attention_checks import poison_and_debug  # noqa: F401  (autouse fixture)
from attention_checks import check_dense, make_offsets
from kernels import jagged_dense_attention
from kernels._attention_reference import dense_attention_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(scope="module", autouse=True)
def _error_summary():
    start = len(attention_checks.RECORDS)
    yield
    attention_checks.dump_summary(attention_checks.RECORDS[start:], "dense")


CPU_CASES = [
    # lengths, Tq, H, D, max_seq_len, bias, dtype
    ([0, 1, 17, 40], 3, 2, 16, 40, True, F32),
    ([0, 1, 17, 40], 1, 1, 16, 40, False, F32),
    ([33, 0, 5], 17, 1, 48, 33, True, BF16),
    ([33, 0, 5], 2, 3, 48, 33, False, F16),
    ([40, 3, 20], 5, 1, 24, 17, True, BF16),  # keys past max_seq_len
    ([2], 1, 1, 96, 2, True, F16),
    ([0, 0], 4, 1, 16, 6, True, F32),  # only empty sequences: zeros, zero grads
]


@pytest.mark.parametrize("lengths,Tq,H,D,N,bias,dtype", CPU_CASES)
def test_dense_triton_cpu(lengths, Tq, H, D, N, bias, dtype):
    check_dense(lengths, Tq, H, D, N, bias, dtype, "cpu")


@pytest.mark.slow
def test_dense_triton_cpu_many_sequences():
    # B > 64 reaches the coarse level of the dK/dV programs' search for their sequence
    rng = random.Random(7)
    lengths = [rng.choice([0, 1, 16, 17, rng.randint(2, 40)]) for _ in range(80)]
    check_dense(lengths, 3, 1, 16, 33, True, F32, "cpu")


def test_dense_triton_cpu_masked_bias_and_scale():
    # -inf bias entries mask keys; a fully masked row gives zeros, never NaN
    check_dense([20, 0, 9], 3, 2, 16, 20, True, F32, "cpu", scale=0.4, bias_mask=True)


def test_dense_max_seq_len_zero():
    check_dense([3, 0, 2], 2, 1, 16, 0, True, F32, "cpu")


def test_dense_expanded_bias_and_int32_offsets():
    lengths, Tq, H, D, N = [9, 0, 17], 4, 2, 16, 17
    off = make_offsets(lengths, "cpu")
    q = torch.randn(3, Tq, H, D, requires_grad=True)
    k, v = (torch.randn(26, H, D, requires_grad=True) for _ in range(2))
    b0 = torch.randn(1, H, 1, N, requires_grad=True)
    bias = b0.expand(3, H, Tq, N)  # stride 0: read in place
    got = jagged_dense_attention(q, k, v, off.to(torch.int32), N, bias=bias, backend="triton")
    g = torch.autograd.grad(got.sum(), (q, k, v, b0))
    want = dense_attention_reference(q, k, v, off, N, bias)[0]
    w = torch.autograd.grad(want.sum(), (q, k, v, b0))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for a, b in zip(g, w):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_torch_backend(with_bias):
    check_dense([0, 1, 9, 23], 5, 2, 16, 20, with_bias, torch.float64, "cpu", backend="torch")
    check_dense([5, 12], 3, 1, 24, 12, with_bias, BF16, "cpu", backend="torch")


def test_dense_reference_gradcheck():
    off = make_offsets([0, 2, 3], "cpu")
    q = torch.randn(3, 2, 2, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(5, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(3, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda a, b, c, d: dense_attention_reference(a, b, c, off, 2, d)[0], (q, k, v, bias))
    torch.autograd.gradcheck(
        lambda a, b, c, d: jagged_dense_attention(a, b, c, off, 2, bias=d, backend="torch"),
        (q, k, v, bias))


# ---- SPLIT_DQ: dQ summed from the dK/dV programs (kernels/_dense_attention_triton.py) -------


@pytest.fixture
def split_dq(monkeypatch):
    """The hand rules with SPLIT_DQ on, for every shape (the launch-dict caches cleared)."""
    from kernels import _dense_attention_triton as dat
    from kernels import _launch_configs

    hand = dat.dense_config
    monkeypatch.setattr(dat, "dense_config", lambda *a, **k: dict(hand(*a, **k), SPLIT_DQ=1))
    _launch_configs.clear_caches()
    yield
    _launch_configs.clear_caches()


@pytest.fixture
def bwd_launches(monkeypatch):
    """(grid, num_dq_programs, SPLIT_DQ) of every backward launch, the kernel still run."""
    from kernels import _dense_attention_triton as dat

    calls, real = [], dat._dense_bwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append((grid, args[-1], kw["SPLIT_DQ"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(dat, "_dense_bwd_kernel", Spy())
    return calls


SPLIT_CASES = [
    # lengths, Tq, H, D, max_seq_len, bias, bias_grad, dtype
    ([0, 1, 17, 40], 1, 2, 64, 40, False, False, F32),
    ([33, 0, 5], 5, 1, 48, 33, False, False, BF16),
    ([33, 0, 5], 2, 3, 48, 33, False, False, F16),
    ([40, 3, 20, 0], 16, 2, 64, 17, False, False, BF16),  # keys past max_seq_len
    ([19, 0, 50], 33, 1, 48, 24, True, False, F32),  # a constant bias: split
    ([19, 0, 50], 33, 2, 64, 24, True, False, BF16),
    ([9, 0, 30], 16, 2, 48, 25, True, True, BF16),  # a bias gradient: the dQ programs
    ([0, 0], 5, 1, 64, 6, False, False, F32),  # no key at all: the dQ programs write the zeros
]


@pytest.mark.parametrize("lengths,Tq,H,D,N,bias,bias_grad,dtype", SPLIT_CASES)
def test_dense_split_dq_cpu(split_dq, bwd_launches, lengths, Tq, H, D, N, bias, bias_grad, dtype):
    check_dense(lengths, Tq, H, D, N, bias, dtype, "cpu", bias_grad=bias_grad)
    (grid, n_dq, split), = bwd_launches
    if (bias and bias_grad) or sum(lengths) == 0:  # not supported: the default launch
        assert split == 0 and n_dq == (Tq + 15) // 16 * len(lengths) * H
    else:  # only the dK/dV programs: T // N_KV + B slots per head
        assert split == 1 and n_dq == 0 and grid == ((sum(lengths) // 16 + len(lengths)) * H,)


def test_dense_split_dq_off_under_deterministic_algorithms(split_dq, bwd_launches):
    """torch.use_deterministic_algorithms: the dQ programs, whose sums have one writer, not the atomics."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        check_dense([33, 0, 5], 5, 1, 48, 33, False, BF16, "cpu")
    finally:
        torch.use_deterministic_algorithms(False)
    (grid, n_dq, split), = bwd_launches
    assert split == 0 and n_dq == 3


def test_16bit_hand_rules_split_dq_in_the_backward_only(monkeypatch):
    """On a GPU the 16-bit backward takes SPLIT_DQ up to D 128; fp32, the forward and D 256 do not."""
    from kernels import _dense_attention_triton as dat

    monkeypatch.setattr(dat, "INTERPRET", False)
    assert dat.dense_config(64, 16, BF16, backward=True)["SPLIT_DQ"] == 1
    assert dat.dense_config(128, 1, F16, backward=True)["SPLIT_DQ"] == 1
    assert dat.dense_config(64, 16, BF16)["SPLIT_DQ"] == 0
    assert dat.dense_config(64, 16, F32, backward=True)["SPLIT_DQ"] == 0
    assert dat.dense_config(256, 16, BF16, backward=True)["SPLIT_DQ"] == 0


def test_unswept_hand_rules_keep_the_rule_from_before_the_sweep(monkeypatch):
    """The sweep timed 16-bit tiles up to D 128 only: fp32 and D 256 keep 8 warps and their stages."""
    from kernels import _dense_attention_triton as dat

    monkeypatch.setattr(dat, "INTERPRET", False)
    for backward in (False, True):
        fp32 = dat.dense_config(128, 16, F32, backward)
        assert (fp32["num_warps"], fp32["num_stages"]) == (8, 1)
        d256 = dat.dense_config(256, 16, BF16, backward)
        assert (d256["num_warps"], d256["num_stages"]) == (8, 2)
        swept = dat.dense_config(128, 16, BF16, backward)
        assert (swept["num_warps"], swept["num_stages"]) == (4, 3)


def test_dense_split_dq_cpu_masked_bias(split_dq):
    # a constant -inf bias masks keys and whole query rows: zeros, never NaN
    check_dense([20, 0, 9], 3, 2, 16, 20, True, F32, "cpu", scale=0.4, bias_mask=True, bias_grad=False)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # the interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # unstored dK rows
@pytest.mark.parametrize("bias_grad", [False, True])
def test_dense_split_dq_cpu_far_negative_bias(split_dq, bias_grad):
    # lse < -88: exp2 of the zero scores of the key rows past a sequence's end overflows, and must
    # not reach dQ (nor dBias, on the dQ programs' path). A shift of -150 keeps the scores in one
    # binade in both bases (150 and 150 log2 e), so the kernel's rounding matches torch's.
    check_dense([9, 0, 21], 4, 2, 16, 21, True, F32, "cpu", bias_grad=bias_grad, bias_shift=-150.0)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dense_split_dq_same_dk_dv_bits(monkeypatch, dtype):
    # the dK/dV programs do the same work with and without SPLIT_DQ: dK, dV bit for bit
    from kernels import _dense_attention_triton as dat
    from kernels import _launch_configs

    lengths, Tq, H, D, N = [40, 0, 7, 33], 33, 2, 48, 35
    off = make_offsets(lengths, "cpu")
    q = torch.randn(4, Tq, H, D, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths), H, D, dtype=dtype, requires_grad=True) for _ in range(2))
    bias = torch.randn(4, H, Tq, N, dtype=dtype)
    hand, grads = dat.dense_config, []
    for split in (0, 1):
        monkeypatch.setattr(dat, "dense_config", lambda *a, s=split, **k: dict(hand(*a, **k), SPLIT_DQ=s))
        _launch_configs.clear_caches()
        out = jagged_dense_attention(q, k, v, off, N, bias=bias, backend="triton")
        grads.append(torch.autograd.grad(out, (k, v), torch.ones_like(out)))
    _launch_configs.clear_caches()
    (dk0, dv0), (dk1, dv1) = grads
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)


# ---- GPU ----------------------------------------------------------------------------------

GPU_CONFIGS = [(dt, d, b) for dt, dims in ((BF16, (16, 48, 64, 96, 128, 256)),
                                            (F16, (64, 96, 256)), (F32, (48, 128)))
               for d in dims for b in (False, True)]


def _gpu_shapes():
    rng = random.Random(4321)
    many = [rng.choice([0, 1, rng.randint(2, 200)]) for _ in range(300)]
    return {
        "awkward": ([0, 1, 127, 129, 1000], 64, 3, 1000),
        "many": (many, 1, 2, 160),  # B = 300, Tq = 1, some keys past max_seq_len
        "long_tq": ([50, 0, 700], 300, 1, 512),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["awkward", "many", "long_tq"])
@pytest.mark.parametrize("dtype,D,with_bias", GPU_CONFIGS)
def test_dense_triton_gpu(dtype, D, with_bias, shape):
    lengths, Tq, H, N = _gpu_shapes()[shape]
    check_dense(lengths, Tq, H, D, N, with_bias, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["awkward", "many", "long_tq"])
@pytest.mark.parametrize("dtype,D", [(BF16, 64), (BF16, 128), (F16, 96), (F32, 48)])
def test_dense_triton_gpu_split_dq(split_dq, dtype, D, shape):
    # the fp32 atomics of SPLIT_DQ on the hardware (a constant bias: the split path)
    lengths, Tq, H, N = _gpu_shapes()[shape]
    check_dense(lengths, Tq, H, D, N, True, dtype, "cuda", bias_grad=False)


@pytest.mark.gpu
def test_dense_triton_gpu_extras():
    check_dense([300, 0, 77], 33, 2, 64, 300, True, BF16, "cuda", scale=0.2, bias_mask=True)
    check_dense([129, 3], 7, 1, 128, 129, True, F32, "cuda", backend="torch")
