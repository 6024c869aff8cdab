"""Argument checks shared by every jagged op.

Cheap checks (shapes, dtypes, devices, ranks) always run. Checks that read offsets values
(offsets[0] == 0, non-decreasing, offsets[-1] == T) force a device sync on CUDA, so they run
on CPU tensors always and on GPU tensors only when debug checks are on:
``JAGGED_DEBUG=1`` in the environment or ``kernels.set_debug_checks(True)``."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_debug_checks = os.environ.get("JAGGED_DEBUG", "0") not in ("", "0", "false", "False")


def set_debug_checks(enabled: bool) -> None:
    """Turn on (or off) the offsets checks that need a device sync on GPU tensors."""
    global _debug_checks
    _debug_checks = bool(enabled)


def debug_checks_enabled() -> bool:
    return _debug_checks


def check_offsets(offsets: torch.Tensor, name: str = "offsets", total: int | None = None) -> None:
    """Validate a jagged offsets tensor: 1-D, integer, length >= 1, starts at 0, non-decreasing.

    `total`, when given, is the number of rows of the values tensor; offsets[-1] must equal it."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B+1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 or int32, got {offsets.dtype}")
    if offsets.numel() < 1:
        raise ValueError(f"{name} must have at least one element (B+1 >= 1), got 0")
    # value checks: not on fake/meta tensors (torch.compile), nor on CUDA ones without debug checks
    if torch.compiler.is_compiling() or (offsets.is_cuda and not _debug_checks) or offsets.device.type == "meta":
        return
    off = offsets.detach()
    if int(off[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(off[0])}")
    if off.numel() > 1:
        steps = off[1:] - off[:-1]
        if bool((steps < 0).any()):
            bad = int(torch.nonzero(steps < 0)[0, 0])
            raise ValueError(
                f"{name} must be non-decreasing; {name}[{bad + 1}]={int(off[bad + 1])} "
                f"< {name}[{bad}]={int(off[bad])}"
            )
    if total is not None and int(off[-1]) != total:
        raise ValueError(
            f"{name}[-1] ({int(off[-1])}) must equal the number of rows of values ({total})"
        )


def check_max_seq_len(max_seq_len: int, name: str = "max_seq_len") -> int:
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
        if isinstance(max_seq_len, torch.SymInt):
            return max_seq_len
        raise TypeError(f"{name} must be a Python int, got {type(max_seq_len).__name__}")
    if max_seq_len < 0:
        raise ValueError(f"{name} must be >= 0, got {max_seq_len}")
    return max_seq_len


def check_float(t: torch.Tensor, name: str, ndim: int | tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in dims:
            raise ValueError(f"{name} must be {' or '.join(map(str, dims))}-D, got shape {tuple(t.shape)}")


def check_same(tensors: dict[str, torch.Tensor], *, dtype: bool = True, device: bool = True) -> None:
    """All named tensors share dtype and device; the error names the first mismatch."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if dtype and t.dtype != first.dtype:
            raise TypeError(f"{name} dtype {t.dtype} does not match {first_name} dtype {first.dtype}")
        if device and t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_offsets_device(offsets: torch.Tensor, values: torch.Tensor, name: str = "offsets") -> None:
    if offsets.device != values.device:
        raise ValueError(f"{name} is on {offsets.device} but values are on {values.device}")


def check_head_dim(d: int, name: str = "head dim") -> None:
    """Attention head dims: every multiple of 8 from 16 to 256."""
    if d < 16 or d > 256 or d % 8 != 0:
        raise ValueError(f"{name} must be a multiple of 8 in [16, 256], got {d}")


def check_size(t: torch.Tensor, name: str, dim: int, expected: int, what: str) -> None:
    """`t.shape[dim] == expected`; `what` says where `expected` comes from (e.g. "B = len(offsets) - 1")."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} = {expected}, got shape {tuple(t.shape)}"
        )


def check_jagged_and_dense(values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, *, same_dtype: bool,
                           width_dim: int, width: str) -> None:
    """The jagged-dense ops' checks: ``values [T, W]``, its offsets, ``dense [B, ...]`` with W at
    `width_dim` (named `width`); `same_dtype` False where autocast will cast mixed dtypes."""
    check_float(values, "values", ndim=2)
    check_float(dense, "dense", ndim=3)
    check_same({"values": values, "dense": dense}, dtype=same_dtype)
    check_offsets(offsets, total=values.shape[0])
    check_offsets_device(offsets, values)
    check_size(dense, "dense", 0, offsets.shape[0] - 1, "B = len(offsets) - 1")
    check_size(dense, "dense", width_dim, values.shape[1], f"{width} = values.shape[1]")
