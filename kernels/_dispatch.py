"""Backend choice shared by every public op: "torch" (reference), "triton" or "auto".

"auto" picks Triton for CUDA tensors and the torch reference for CPU tensors, except under
``TRITON_INTERPRET=1`` where "auto" still picks the reference on CPU (the interpreter is for
tests, not for speed). "triton" on CPU tensors needs ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os
import warnings

import torch

BACKENDS = ("torch", "triton", "auto")


# Decided once at import: a plain bool is free to read under torch.compile, where a cached
# function call makes Dynamo warn. Triton absent is a quiet fact of the machine; Triton present
# but failing to import is a broken install, which "auto" must not hide behind the slow path.
_TRITON_ERROR = ""
try:
    import triton.language  # noqa: F401

    _TRITON_AVAILABLE = True
except ModuleNotFoundError as err:
    _TRITON_AVAILABLE = False
    if err.name not in ("triton", "triton.language"):
        _TRITON_ERROR = f"{type(err).__name__}: {err}"
except Exception as err:
    _TRITON_AVAILABLE = False
    _TRITON_ERROR = f"{type(err).__name__}: {err}"
_warned = False


def triton_available() -> bool:
    return _TRITON_AVAILABLE


def _broken_triton_warning() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"triton is installed but does not import ({_TRITON_ERROR}); backend='auto' runs the "
                      "slow torch path on the GPU. Fix the Triton install, or pass backend='torch' to "
                      "choose that path", RuntimeWarning, stacklevel=3)


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return "torch" or "triton" for tensors on `device`, or raise a clear error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    on_gpu = device.type == "cuda"
    if backend == "auto":
        if on_gpu and _TRITON_ERROR:
            _broken_triton_warning()
        return "triton" if on_gpu and triton_available() else "torch"
    if not triton_available():
        why = f" ({_TRITON_ERROR})" if _TRITON_ERROR else ""
        raise RuntimeError(f"backend='triton' needs the triton package, which is not importable{why}")
    if not on_gpu and not interpreter_on():
        raise ValueError(
            f"backend='triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
            "(the Triton interpreter); use backend='auto' or 'torch' on the CPU"
        )
    return "triton"
