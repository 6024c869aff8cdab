"""Checks shared by the attention tests (CPU interpreter, GPU grid and GPU sweep).

Each check makes fresh random inputs, runs the op and its backward on the chosen backend, and
compares the output and every gradient with the flash-attn rule of tests/tolerance.py: the
oracle is the reference in fp32 (fp64 for fp32 inputs), "PyTorch's own error" is the same
reference computed in the input dtype. Rows past max_seq_len must come back exactly zero.
The floor of a gradient scales with the largest gradient of the same backward (not only with
its own size): the gradients share intermediates, e.g. dS = P * (dP - delta) with delta =
rowsum(dO * O) cancelling against dP, so a gradient that is exactly zero in theory (every
sequence of length 1) still carries the rounding of terms as large as the other gradients.
Every comparison is also appended to RECORDS (name, dtype, error, bound) for the reports.
"""

from __future__ import annotations

import pytest
import torch

from kernels import offsets_from_lengths
from kernels._attention_reference import dense_attention_reference, flash_attention_reference
from kernels._jagged_common import set_poison_outputs
from kernels._validation import set_debug_checks
from kernels.dense_attention import jagged_dense_attention
from kernels.flash_attention import jagged_flash_attention
from tolerance import _FLOORS, assert_close_to_oracle, max_abs_err

RECORDS: list[dict] = []


@pytest.fixture(autouse=True)
def poison_and_debug():
    """Autouse in every test module that imports it: NaN-filled outputs catch any element a
    kernel forgets to write; debug checks validate offsets on the GPU too."""
    set_poison_outputs(True)
    set_debug_checks(True)
    yield
    set_poison_outputs(False)
    set_debug_checks(False)


def make_offsets(lengths: list[int], device) -> torch.Tensor:
    return offsets_from_lengths(lengths, device)


def ignored_rows(lengths: list[int], max_seq_len: int, device) -> torch.Tensor:
    """Bool [T]: rows past max_seq_len in their sequence."""
    return torch.cat([torch.arange(n, device=device) >= max_seq_len for n in lengths]
                     + [torch.zeros(0, dtype=torch.bool, device=device)])


def _amax(t) -> float:
    return t.abs().max().item() if t is not None and t.numel() else 0.0


def _compare(out, oracle, lowp, name, tag, factor=2.0, scale=0.0):
    floor = _FLOORS[out.dtype] * max(1.0, _amax(oracle), scale)
    err, ref_err = max_abs_err(out, oracle), max_abs_err(lowp, oracle)
    RECORDS.append(dict(case=tag, name=name, dtype=str(out.dtype).replace("torch.", ""),
                        err=err, bound=factor * ref_err + floor))
    assert_close_to_oracle(out, oracle, lowp, f"{tag} {name}", factor=factor, floor=floor)


def _oracle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _grads(outputs, inputs, grad_outputs):
    return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)


def _compare_lse(lse, oracle_lse, lowp_lse, tag):
    inf = torch.isinf(oracle_lse)
    assert torch.equal(torch.isinf(lse), inf), f"{tag} lse: -inf pattern differs"
    assert bool((lse[inf] < 0).all()), f"{tag} lse: +inf where -inf expected"
    fin = ~inf
    _compare(lse[fin], oracle_lse[fin].to(torch.float64), lowp_lse[fin].float(), "lse", tag)


def check_flash(lengths, H, D, max_seq_len, causal, dtype, device, backend="triton",
                lse_grad=False, scale=None, layout="separate", window=None):
    """One case of jagged_flash_attention, forward + backward, against the oracle."""
    tag = f"flash L={list(lengths)[:6]} N={max_seq_len} H={H} D={D} causal={causal} window={window} {dtype}"
    off = make_offsets(lengths, device)
    T = int(sum(lengths))
    if layout == "fused":  # q, k, v as strided slices of one [T, 3, H, D] projection
        qkv = torch.randn(T, 3, H, D, dtype=dtype, device=device)
        leaves = [qkv.requires_grad_()]
        q, k, v = qkv.unbind(1)
    else:
        leaves = [torch.randn(T, H, D, dtype=dtype, device=device).requires_grad_()
                  for _ in range(3)]
        q, k, v = leaves
    out, lse = jagged_flash_attention(q, k, v, off, max_seq_len, causal=causal, scale=scale,
                                      return_lse=True, backend=backend, window=window)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if lse_grad else None
    outs, gouts = ([out, lse], [dout, dlse]) if lse_grad else ([out], [dout])
    got = _grads(outs, (q, k, v) if layout == "separate" else leaves, gouts)
    if layout == "fused":
        got = got[0].unbind(1)

    def ref(dt, upcast):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = flash_attention_reference(*xs, off, max_seq_len, causal, scale, upcast=upcast,
                                         window=-1 if window is None else window)
        outs_r = [o, l] if lse_grad else [o]
        g_r = [dout.to(o.dtype)] + ([dlse.to(l.dtype)] if lse_grad else [])
        return o, l, _grads(outs_r, xs, g_r)

    o_ref, l_ref, g_ref = ref(_oracle_dtype(dtype), True)
    o_low, l_low, g_low = ref(dtype, dtype in (torch.float32, torch.float64))
    _compare(out, o_ref, o_low, "out", tag)
    _compare_lse(lse, l_ref, l_low, tag)
    gscale = max(_amax(g) for g in g_ref)
    for name, g, gr, gl in zip(("dq", "dk", "dv"), got, g_ref, g_low):
        _compare(g, gr, gl, name, tag, scale=gscale)
    gone = ignored_rows(lengths, max_seq_len, device)
    if bool(gone.any()):
        for name, t in (("out", out), ("dq", got[0]), ("dk", got[1]), ("dv", got[2])):
            assert bool((t[gone] == 0).all()), f"{tag}: {name} rows past max_seq_len not zero"
        assert bool((lse[:, gone] == float("-inf")).all()), f"{tag}: lse past max_seq_len"


def check_dense(lengths, Tq, H, D, max_seq_len, with_bias, dtype, device, backend="triton",
                scale=None, bias_mask=False, bias_grad=True, bias_shift=0.0):
    """One case of jagged_dense_attention, forward + backward (dq, dk, dv, and dbias unless the
    bias is a constant: bias_grad=False). bias_shift is added to the whole bias: the same
    softmax, with the log-sum-exp moved as far from 0."""
    tag = (f"dense L={list(lengths)[:6]} N={max_seq_len} Tq={Tq} H={H} D={D} bias={with_bias} "
           f"{'' if bias_grad else 'constant '}{dtype}")
    B = len(lengths)
    off = make_offsets(lengths, device)
    T = int(sum(lengths))
    q = torch.randn(B, Tq, H, D, dtype=dtype, device=device).requires_grad_()
    k, v = (torch.randn(T, H, D, dtype=dtype, device=device).requires_grad_() for _ in range(2))
    bias = None
    if with_bias:
        bias = torch.randn(B, H, Tq, max_seq_len, dtype=dtype, device=device) + bias_shift
        if bias_mask:  # -inf masks keys, including whole rows
            bias = bias.masked_fill(torch.rand_like(bias, dtype=torch.float32) < 0.3, float("-inf"))
            bias[:, :, 0] = float("-inf")
        bias.requires_grad_(bias_grad)
    inputs = (q, k, v) + ((bias,) if with_bias and bias_grad else ())
    out = jagged_dense_attention(q, k, v, off, max_seq_len, bias=bias, scale=scale,
                                 backend=backend)
    dout = torch.randn_like(out)
    got = _grads([out], inputs, [dout])

    def ref(dt, upcast):
        xs = [t.detach().to(dt).requires_grad_() for t in inputs]
        b = xs[3] if len(xs) == 4 else (bias.to(dt) if with_bias else None)
        o, _ = dense_attention_reference(xs[0], xs[1], xs[2], off, max_seq_len, b, scale,
                                         upcast=upcast)
        return o, _grads([o], xs, [dout.to(o.dtype)])

    o_ref, g_ref = ref(_oracle_dtype(dtype), True)
    o_low, g_low = ref(dtype, dtype in (torch.float32, torch.float64))
    _compare(out, o_ref, o_low, "out", tag)
    gscale = max(_amax(g) for g in g_ref)
    for name, g, gr, gl in zip(("dq", "dk", "dv", "dbias"), got, g_ref, g_low):
        gr = torch.zeros_like(g) if gr is None else gr
        gl = torch.zeros_like(g) if gl is None else gl
        _compare(g, gr, gl, name, tag, scale=gscale)
    gone = ignored_rows(lengths, max_seq_len, device)
    if bool(gone.any()):
        assert bool((got[1][gone] == 0).all()) and bool((got[2][gone] == 0).all()), \
            f"{tag}: dk/dv rows past max_seq_len not zero"
    if with_bias and bias_grad:  # bias columns past each sequence's length get zero gradient
        lens = torch.tensor(lengths, device=device).clamp(max=max_seq_len)
        past = torch.arange(max_seq_len, device=device)[None, :] >= lens[:, None]  # [B, N]
        assert bool((got[3].permute(0, 3, 1, 2)[past] == 0).all()), f"{tag}: dbias past length"


def summarize(records: list[dict]) -> dict:
    """Per dtype: number of comparisons, worst error and worst error / bound."""
    out: dict = {}
    for r in records:
        s = out.setdefault(r["dtype"], dict(comparisons=0, worst_err=0.0, worst_ratio=0.0,
                                            worst_case=""))
        s["comparisons"] += 1
        s["worst_err"] = max(s["worst_err"], r["err"])
        ratio = r["err"] / r["bound"] if r["bound"] > 0 else 0.0
        if ratio >= s["worst_ratio"]:
            s["worst_ratio"], s["worst_case"] = ratio, f'{r["case"]} {r["name"]}'
    return out


def dump_summary(records: list[dict], label: str) -> None:
    """Append a summary line to $JAGGED_ERR_LOG (JSON lines) when it is set."""
    import json
    import os

    path = os.environ.get("JAGGED_ERR_LOG")
    if path and records:
        with open(path, "a") as f:
            f.write(json.dumps(dict(label=label, cases=len({r["case"] for r in records}),
                                    summary=summarize(records))) + "\n")
