"""jagged_flash_attention: Triton (interpreter on CPU, compiled on GPU) and torch backends
against the fp32/fp64 reference, forward and every gradient; gradcheck of the references."""

import random

import pytest
import torch

import attention_checks
from attention_checks import poison_and_debug  # noqa: F401  (autouse fixture)
from attention_checks import check_flash, make_offsets
from kernels import jagged_flash_attention
from kernels._attention_reference import flash_attention_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(scope="module", autouse=True)
def _error_summary():
    start = len(attention_checks.RECORDS)
    yield
    attention_checks.dump_summary(attention_checks.RECORDS[start:], "flash")


# ---- CPU: the Triton kernels through the interpreter (blocks of 16, tiny shapes) ----------

CPU_CASES = [
    # lengths, H, D, max_seq_len, causal, dtype
    ([0, 1, 17, 40], 2, 16, 40, False, F32),
    ([0, 1, 17, 40], 2, 16, 40, True, F32),
    ([33, 0, 5], 1, 48, 33, True, BF16),
    ([33, 0, 5], 3, 48, 33, False, F16),
    ([40, 3, 20], 1, 24, 17, False, BF16),  # sequences longer than max_seq_len
    ([40, 3, 20], 2, 24, 17, True, F32),
    ([1], 1, 96, 1, True, F16),
    ([0, 0], 1, 16, 4, False, F32),  # nothing but empty sequences
    ([19, 2], 1, 128, 19, True, BF16),
]


@pytest.mark.parametrize("lengths,H,D,N,causal,dtype", CPU_CASES)
def test_flash_triton_cpu(lengths, H, D, N, causal, dtype):
    check_flash(lengths, H, D, N, causal, dtype, "cpu")


@pytest.mark.parametrize("causal,dtype", [(True, F32), (False, BF16)])
@pytest.mark.slow
def test_flash_triton_cpu_many_sequences(causal, dtype):
    # B > 64 reaches the coarse level of the kernels' search for their sequence; lengths around
    # the block sizes, empty ones, and some past max_seq_len
    rng = random.Random(7)
    lengths = [rng.choice([0, 1, 16, 17, rng.randint(2, 40)]) for _ in range(80)]
    check_flash(lengths, 1, 16, 33, causal, dtype, "cpu")


def test_flash_triton_cpu_lse_grad_scale_int32_offsets():
    check_flash([18, 0, 7], 2, 16, 18, True, F32, "cpu", lse_grad=True, scale=0.3)


def test_flash_triton_cpu_fused_qkv_strides():
    # q, k, v are strided views of one [T, 3, H, D] tensor: no copy, same results
    check_flash([21, 4], 2, 16, 21, False, BF16, "cpu", layout="fused")


def test_flash_max_seq_len_zero():
    check_flash([3, 0, 2], 1, 16, 0, False, F32, "cpu")


def test_flash_int32_offsets_and_noncontiguous_last_dim():
    lengths, H, D = [9, 0, 17], 2, 16
    off = make_offsets(lengths, "cpu")
    q, k, v = (torch.randn(26, D, H).transpose(1, 2) for _ in range(3))  # stride(-1) != 1
    want = flash_attention_reference(q, k, v, off, 17, True)[0]
    got = jagged_flash_attention(q, k, v, off.to(torch.int32), 17, causal=True, backend="triton")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_torch_backend(causal):
    # the torch backend's explicit backward against autograd through the reference, in fp64
    check_flash([0, 1, 9, 23], 2, 16, 20, causal, torch.float64, "cpu", backend="torch",
                lse_grad=True)
    check_flash([5, 12], 1, 24, 12, causal, BF16, "cpu", backend="torch")


@pytest.mark.slow  # a full fp64 gradcheck of the oracle: 35 s
@pytest.mark.parametrize("causal", [False, True])
def test_flash_reference_gradcheck(causal):
    off = make_offsets([0, 2, 3, 1], "cpu")
    q, k, v = (torch.randn(6, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def ref(a, b, c):  # out and the finite part of lse (rows past max_seq_len have -inf)
        out, lse = flash_attention_reference(a, b, c, off, 2, causal)
        return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

    torch.autograd.gradcheck(ref, (q, k, v))
    torch.autograd.gradcheck(
        lambda a, b, c: jagged_flash_attention(a, b, c, off, 3, causal=causal, backend="torch"),
        (q, k, v))


def test_flash_auto_backend_on_cpu_is_torch():
    off = make_offsets([4, 2], "cpu")
    q, k, v = (torch.randn(6, 1, 16) for _ in range(3))
    out = jagged_flash_attention(q, k, v, off, 4)
    torch.testing.assert_close(out, flash_attention_reference(q, k, v, off, 4)[0])


# ---- sliding window -------------------------------------------------------------------------

WINDOW_CASES = [
    # lengths, H, D, max_seq_len, causal, window, dtype: windows inside one block of 16, across
    # blocks, wider than any sequence; truncated and empty sequences
    ([0, 1, 17, 40], 2, 16, 40, False, 1, F32),
    ([0, 1, 17, 40], 2, 16, 40, True, 3, F32),
    ([40, 3, 20], 1, 24, 17, False, 20, BF16),
    ([33, 0, 50], 1, 32, 50, False, 18, F16),
    ([33, 0, 50], 2, 32, 50, True, 0, BF16),
]


@pytest.mark.parametrize("lengths,H,D,N,causal,window,dtype", WINDOW_CASES)
def test_flash_window_triton_cpu(lengths, H, D, N, causal, window, dtype):
    check_flash(lengths, H, D, N, causal, dtype, "cpu", window=window)


def test_flash_window_lse_grad_and_torch_backend():
    check_flash([0, 37, 9], 2, 16, 37, False, F32, "cpu", lse_grad=True, window=5)
    check_flash([0, 1, 9, 23], 2, 16, 20, False, torch.float64, "cpu", backend="torch", window=2)
    check_flash([5, 30], 1, 24, 30, True, BF16, "cpu", backend="torch", window=4)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_window_reference_is_the_masked_softmax(causal):
    """The reference's window against softmax over an explicit per-sequence loop."""
    torch.manual_seed(3)
    lengths, w, N = [0, 6, 13, 2], 3, 11
    off = make_offsets(lengths, "cpu")
    q, k, v = (torch.randn(sum(lengths), 2, 16, dtype=torch.float64) for _ in range(3))
    out = flash_attention_reference(q, k, v, off, N, causal, window=w)[0]
    for b, n in enumerate(lengths):
        s0, n = int(off[b]), min(n, N)
        for i in range(n):
            keys = [j for j in range(n) if abs(i - j) <= w and (j <= i or not causal)]
            sc = torch.einsum("hd,jhd->hj", q[s0 + i], k[s0 + torch.tensor(keys)]) / 4.0
            want = torch.einsum("hj,jhd->hd", sc.softmax(-1), v[s0 + torch.tensor(keys)])
            torch.testing.assert_close(out[s0 + i], want)


def test_flash_window_zero_is_the_values_and_wide_is_every_key():
    torch.manual_seed(4)
    off = make_offsets([7, 0, 20], "cpu")
    q, k, v = (torch.randn(27, 2, 16) for _ in range(3))
    torch.testing.assert_close(jagged_flash_attention(q, k, v, off, 20, window=0, backend="triton"), v)
    torch.testing.assert_close(jagged_flash_attention(q, k, v, off, 20, window=19, backend="triton"),
                               jagged_flash_attention(q, k, v, off, 20, backend="triton"))


def test_flash_window_refused():
    q = torch.randn(4, 1, 16)
    off = make_offsets([4], "cpu")
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an int >= 0"):
            jagged_flash_attention(q, q, q, off, 4, window=bad)
    from kernels import S2Shards
    with pytest.raises(ValueError, match="window and shards"):
        jagged_flash_attention(q, q, q, off, 4, window=2, shards=S2Shards(16, 1, 2))


# ---- GPU: compiled kernels, bigger and more awkward shapes --------------------------------

GPU_CONFIGS = [(dt, d, c) for dt, dims in ((BF16, (16, 48, 64, 96, 128, 256)),
                                            (F16, (64, 96, 256)), (F32, (16, 48, 128)))
               for d in dims for c in (False, True)]


def _gpu_shapes():
    rng = random.Random(1234)
    many = [rng.choice([0, 1, rng.randint(2, 200)]) for _ in range(300)]
    return {
        "awkward": ([0, 1, 127, 129, 1000], 3, 1000),
        "many": (many, 1, 160),  # B = 300, some sequences past max_seq_len
        "truncated": ([1000, 5, 300], 2, 700),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["awkward", "many", "truncated"])
@pytest.mark.parametrize("dtype,D,causal", GPU_CONFIGS)
def test_flash_triton_gpu(dtype, D, causal, shape):
    lengths, H, N = _gpu_shapes()[shape]
    check_flash(lengths, H, D, N, causal, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D", [(BF16, 32), (BF16, 64), (F16, 128), (F32, 48)])
@pytest.mark.parametrize("causal,window", [(False, 2), (False, 100), (True, 8)])
def test_flash_window_triton_gpu(dtype, D, causal, window):
    check_flash([0, 1, 127, 129, 1000], 3, D, 1000, causal, dtype, "cuda", window=window)
    check_flash([1000, 5, 300], 2, D, 700, causal, dtype, "cuda", window=window)


@pytest.mark.gpu
def test_flash_triton_gpu_extras():
    check_flash([300, 0, 77], 2, 64, 300, True, BF16, "cuda", lse_grad=True, scale=0.2)
    check_flash([300, 0, 77], 2, 64, 300, False, BF16, "cuda", layout="fused")
    check_flash([129, 3], 1, 128, 129, True, F32, "cuda", backend="torch")
