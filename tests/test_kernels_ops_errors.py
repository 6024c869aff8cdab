"""Bad inputs to the jagged feature-interaction ops raise clear errors naming the argument."""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from kernels import (
    jagged_dense_bmm,
    jagged_dense_elementwise_add,
    jagged_dense_elementwise_mul,
    jagged_jagged_bmm,
    jagged_softmax,
    jagged_to_padded,
    padded_to_jagged,
)

B, N, D, M = 3, 4, 8, 5
LENGTHS = (2, 0, 5)
T = sum(LENGTHS)


def _good(device="cpu"):
    off = torch.tensor([0, 2, 2, 7], device=device)
    return {
        "values": torch.randn(T, D, device=device),
        "offsets": off,
        "padded": torch.randn(B, N, D, device=device),
        "w": torch.randn(B, D, M, device=device),
        "b": torch.randn(T, M, device=device),
        "dense": torch.randn(B, N, D, device=device),
    }


# each op as a function of the argument dict, so one bad argument can be swapped in
CALLS = {
    "jagged_to_padded": lambda a, **kw: jagged_to_padded(a["values"], a["offsets"], N, **kw),
    "padded_to_jagged": lambda a, **kw: padded_to_jagged(a["padded"], a["offsets"], **kw),
    "jagged_softmax": lambda a, **kw: jagged_softmax(a["values"], a["offsets"], N, **kw),
    "jagged_dense_bmm": lambda a, **kw: jagged_dense_bmm(a["values"], a["offsets"], a["w"], N, **kw),
    "jagged_jagged_bmm": lambda a, **kw: jagged_jagged_bmm(a["values"], a["b"], a["offsets"], N, **kw),
    "elementwise_add": lambda a, **kw: jagged_dense_elementwise_add(a["values"], a["offsets"], a["dense"], **kw),
    "elementwise_mul": lambda a, **kw: jagged_dense_elementwise_mul(a["values"], a["offsets"], a["dense"], **kw),
}
JAGGED_INPUT = [op for op in CALLS if op != "padded_to_jagged"]  # values rows vs offsets[-1]
FIRST_ARG = {"padded_to_jagged": ("padded", "padded"), "jagged_jagged_bmm": ("values", "a")}


def _first_arg(op):  # (key in the argument dict, the public argument name)
    return FIRST_ARG.get(op, ("values", "values"))


def _raises(op, args, exc, match, **kw):
    with pytest.raises(exc, match=match):
        CALLS[op](args, **kw)


@pytest.mark.parametrize("op", list(CALLS))
def test_good_inputs_run(op):
    CALLS[op](_good())


BAD_OFFSETS = [
    ("2-D", torch.tensor([[0, 2, 2, 7]]), ValueError, r"offsets must be 1-D"),
    ("float", torch.tensor([0.0, 2.0, 2.0, 7.0]), TypeError, r"offsets must be int64 or int32"),
    ("not-tensor", [0, 2, 2, 7], TypeError, r"offsets must be a torch.Tensor"),
    ("nonzero-start", torch.tensor([1, 2, 2, 7]), ValueError, r"offsets\[0\] must be 0"),
    ("decreasing", torch.tensor([0, 2, 1, 7]), ValueError, r"offsets must be non-decreasing"),
]


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("what,offsets,exc,match", BAD_OFFSETS, ids=[b[0] for b in BAD_OFFSETS])
def test_bad_offsets(op, what, offsets, exc, match):
    args = _good()
    args["offsets"] = offsets
    _raises(op, args, exc, match)


@pytest.mark.parametrize("op", JAGGED_INPUT)
def test_total_mismatch(op):
    args = _good()
    args["offsets"] = torch.tensor([0, 2, 2, 6])
    _raises(op, args, ValueError, re.escape("offsets[-1] (6) must equal the number of rows of values (7)"))


def test_padded_to_jagged_total_mismatch():
    with pytest.raises(ValueError, match=r"offsets\[-1\] \(7\) must equal"):
        padded_to_jagged(_good()["padded"], _good()["offsets"], total=9)


@pytest.mark.parametrize("op", list(CALLS))
def test_int_values_rejected(op):
    args = _good()
    key, name = _first_arg(op)
    args[key] = args[key].long()
    _raises(op, args, TypeError, rf"^{name} must be float32, bfloat16, float16 or float64")


@pytest.mark.parametrize("op", list(CALLS))
def test_wrong_rank(op):
    args = _good()
    key, name = _first_arg(op)
    args[key] = args[key].unsqueeze(0)
    _raises(op, args, ValueError, rf"^{name} must be \d-D")


@pytest.mark.parametrize(
    "op,name,bad,match",
    [
        ("jagged_dense_bmm", "w", torch.randn(B, D), r"dense must be 3-D"),
        ("jagged_dense_bmm", "w", torch.randn(B + 1, D, M), r"dense.shape\[0\] must equal B"),
        ("jagged_dense_bmm", "w", torch.randn(B, D + 1, M), r"dense.shape\[1\] must equal K"),
        ("jagged_jagged_bmm", "b", torch.randn(T + 1, M), r"b.shape\[0\] must equal T"),
        ("jagged_jagged_bmm", "b", torch.randn(T, M, 1), r"b must be 2-D"),
        ("elementwise_add", "dense", torch.randn(B, N, D + 1), r"dense.shape\[2\] must equal D"),
        ("elementwise_mul", "dense", torch.randn(B - 1, N, D), r"dense.shape\[0\] must equal B"),
        ("padded_to_jagged", "padded", torch.randn(B + 1, N, D), r"padded.shape\[0\] must equal B"),
    ],
)
def test_shape_mismatch(op, name, bad, match):
    args = _good()
    args[name] = bad
    _raises(op, args, ValueError, match)


@pytest.mark.parametrize(
    "op,name,match",
    [
        ("jagged_dense_bmm", "w", "dense dtype"),
        ("jagged_jagged_bmm", "b", "b dtype"),
        ("elementwise_add", "dense", "dense dtype"),
        ("elementwise_mul", "dense", "dense dtype"),
    ],
)
def test_dtype_mismatch(op, name, match):
    args = _good()
    args[name] = args[name].half()
    _raises(op, args, TypeError, match)


@pytest.mark.parametrize("op", list(CALLS))
def test_device_mismatch(op):
    # the meta device stands in for a second device on CPU-only machines
    args = _good()
    args["offsets"] = args["offsets"].to("meta")
    _raises(op, args, ValueError, r"offsets is on meta but values are on cpu")


def test_operand_device_mismatch():
    args = _good()
    args["w"] = args["w"].to("meta")
    _raises("jagged_dense_bmm", args, ValueError, r"dense is on meta but values is on cpu")


@pytest.mark.parametrize("op", [o for o in CALLS if o not in ("padded_to_jagged",) and not o.startswith("elem")])
@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (4.0, TypeError), (True, TypeError)])
def test_bad_max_seq_len(op, bad, exc):
    args = _good()
    call = {
        "jagged_to_padded": lambda: jagged_to_padded(args["values"], args["offsets"], bad),
        "jagged_softmax": lambda: jagged_softmax(args["values"], args["offsets"], bad),
        "jagged_dense_bmm": lambda: jagged_dense_bmm(args["values"], args["offsets"], args["w"], bad),
        "jagged_jagged_bmm": lambda: jagged_jagged_bmm(args["values"], args["b"], args["offsets"], bad),
    }[op]
    with pytest.raises(exc, match="max_seq_len"):
        call()


def test_elementwise_max_seq_len_must_match_dense():
    args = _good()
    with pytest.raises(ValueError, match=r"dense.shape\[1\] must equal max_seq_len"):
        jagged_dense_elementwise_add(args["values"], args["offsets"], args["dense"], N + 1)
    jagged_dense_elementwise_mul(args["values"], args["offsets"], args["dense"], N)  # equal is fine


@pytest.mark.parametrize("op", list(CALLS))
def test_bad_backend(op):
    _raises(op, _good(), ValueError, r"backend must be one of", backend="cuda")


@pytest.mark.parametrize("op", list(CALLS))
def test_triton_rejects_float64(op):
    args = {k: (v.double() if v.is_floating_point() else v) for k, v in _good().items()}
    _raises(op, args, TypeError, r"backend='triton' supports float32, bfloat16 and float16", backend="triton")
    CALLS[op](args, backend="auto")  # auto falls back to the reference for float64


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(CALLS))
def test_sync_checks_on_cuda_behind_debug_flag(op):
    args = _good("cuda")
    args["offsets"] = torch.tensor([0, 3, 2, 7], device="cuda")
    kernels.set_debug_checks(True)
    try:
        _raises(op, args, ValueError, r"offsets must be non-decreasing")
    finally:
        kernels.set_debug_checks(False)
