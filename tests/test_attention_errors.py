"""Clear errors from the attention ops: the message names the argument and what was expected."""

import pytest
import torch

from attention_checks import make_offsets
from kernels import jagged_dense_attention, jagged_flash_attention


def _qkv(T=6, H=2, D=16, dtype=torch.float32):
    return [torch.randn(T, H, D, dtype=dtype) for _ in range(3)]


OFF = make_offsets([4, 2], "cpu")


@pytest.mark.parametrize("offsets,exc,match", [
    (torch.tensor([[0, 4, 6]]), ValueError, "offsets must be 1-D"),
    (torch.tensor([0.0, 4.0, 6.0]), TypeError, "offsets must be int64 or int32"),
    (torch.tensor([1, 4, 6]), ValueError, r"offsets\[0\] must be 0"),
    (torch.tensor([0, 5, 4, 6]), ValueError, "non-decreasing"),
    (torch.tensor([0, 4, 7]), ValueError, r"offsets\[-1\] \(7\)"),
])
def test_flash_bad_offsets(offsets, exc, match):
    with pytest.raises(exc, match=match):
        jagged_flash_attention(*_qkv(), offsets, 4)


def test_flash_shape_dtype_head_dim_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k must have q's shape"):
        jagged_flash_attention(q, k[:5], v, OFF, 4)
    with pytest.raises(ValueError, match="v must have q's shape"):
        jagged_flash_attention(q, k, v[:, :1], OFF, 4)
    with pytest.raises(TypeError, match="k dtype torch.float16 does not match q"):
        jagged_flash_attention(q, k.half(), v, OFF, 4)
    with pytest.raises(ValueError, match="q must be 3-D"):
        jagged_flash_attention(q[None], k, v, OFF, 4)
    with pytest.raises(TypeError, match="q must be float32"):
        jagged_flash_attention(q.int(), k, v, OFF, 4)
    for D in (8, 20, 264):
        with pytest.raises(ValueError, match="head dim D"):
            jagged_flash_attention(*_qkv(D=D), OFF, 4)
    with pytest.raises(TypeError, match="max_seq_len must be a Python int"):
        jagged_flash_attention(q, k, v, OFF, 4.0)
    with pytest.raises(ValueError, match="max_seq_len must be >= 0"):
        jagged_flash_attention(q, k, v, OFF, -1)
    with pytest.raises(ValueError, match="backend must be one of"):
        jagged_flash_attention(q, k, v, OFF, 4, backend="cuda")
    with pytest.raises(TypeError, match="backend='triton' supports"):
        jagged_flash_attention(*_qkv(dtype=torch.float64), OFF, 4, backend="triton")
    with pytest.raises(ValueError, match="is on meta"):
        jagged_flash_attention(q, k.to("meta"), v, OFF, 4)


def test_dense_errors():
    _, k, v = _qkv()
    q = torch.randn(2, 3, 2, 16)
    bias = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match="q must be 4-D"):
        jagged_dense_attention(q[0], k, v, OFF, 4)
    with pytest.raises(ValueError, match=r"q.shape\[0\] \(B = 3\)"):
        jagged_dense_attention(torch.randn(3, 3, 2, 16), k, v, OFF, 4)
    with pytest.raises(ValueError, match="k must be \\[T, H, D\\] with q's H = 2"):
        jagged_dense_attention(q, k[:, :1], v, OFF, 4)
    with pytest.raises(ValueError, match="v must have k's number of rows"):
        jagged_dense_attention(q, k, v[:5], OFF, 4)
    with pytest.raises(ValueError, match=r"offsets\[-1\]"):
        jagged_dense_attention(q, k[:5], v[:5], OFF, 4)
    with pytest.raises(ValueError, match=r"bias must be \[B, H, Tq, max_seq_len\]"):
        jagged_dense_attention(q, k, v, OFF, 4, bias=bias[..., :3])
    with pytest.raises(ValueError, match="bias must be 4-D"):
        jagged_dense_attention(q, k, v, OFF, 4, bias=bias[0])
    with pytest.raises(TypeError, match="v dtype"):
        jagged_dense_attention(q, k, v.bfloat16(), OFF, 4)
    with pytest.raises(ValueError, match="head dim D"):
        jagged_dense_attention(torch.randn(2, 3, 2, 12), *_qkv(D=12)[:2], OFF, 4)
