"""The flash-attn tolerance rule, shared by every kernel test.

A kernel's error against the fp32 (or fp64) oracle may be at most `factor` times PyTorch's own
error when it computes the same thing in the kernel's dtype, plus a small floor. The floor only
matters where PyTorch is exact (fp32 paths, zeros), so it is tied to the dtype's resolution.
"""

from __future__ import annotations

import torch

_FLOORS = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def resolution_floor(dtype: torch.dtype, oracle: torch.Tensor) -> float:
    """The rule's floor for values of `dtype`'s resolution, scaled with the result's magnitude so
    that a large output is not held to a bar below one ulp of its own dtype."""
    return _FLOORS[dtype] * max(1.0, oracle.abs().max().item() if oracle.numel() else 0.0)


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_close_to_oracle(
    out: torch.Tensor,
    oracle: torch.Tensor,
    torch_lowp: torch.Tensor,
    name: str,
    factor: float = 2.0,
    floor: float | None = None,
) -> None:
    """`out` (kernel) vs `oracle` (fp32/fp64 reference) within factor x err(torch_lowp) + floor."""
    assert out.shape == oracle.shape, f"{name}: shape {tuple(out.shape)} != {tuple(oracle.shape)}"
    assert torch.isfinite(out.float()).all(), f"{name}: non-finite values in the kernel output"
    if floor is None:
        floor = resolution_floor(out.dtype, oracle)
    err = max_abs_err(out, oracle)
    ref_err = max_abs_err(torch_lowp, oracle)
    bound = factor * ref_err + floor
    assert err <= bound, f"{name}: max |kernel - oracle| = {err:.3e} > {factor} x {ref_err:.3e} + {floor:.1e}"
