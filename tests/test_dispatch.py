"""backend="auto" on a GPU falls back to the torch path quietly only where Triton is absent; a
Triton that is installed but fails to import is said loudly (a warning, once), never hidden."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import warnings
import torch
from kernels._dispatch import resolve_backend
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    picks = [resolve_backend("auto", torch.device("cuda")) for _ in range(2)]
print(picks, len(seen), *[str(w.message) for w in seen])
try:
    resolve_backend("triton", torch.device("cuda"))
except RuntimeError as err:
    print("triton:", err)
"""


def _probe(tmp_path: Path, triton_init: str | None) -> str:
    """Run the probe with a stand-in `triton` package (None: a machine without triton)."""
    fake = tmp_path / "site"
    if triton_init is None:
        prelude = "import sys; sys.modules['triton'] = None\n"
    else:
        (fake / "triton").mkdir(parents=True)
        (fake / "triton" / "__init__.py").write_text(triton_init)
        prelude = f"import sys; sys.path.insert(0, {str(fake)!r})\n"
    proc = subprocess.run([sys.executable, "-c", prelude + PROBE], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_broken_triton_is_said_once_when_auto_falls_back(tmp_path):
    out = _probe(tmp_path, "raise OSError('libcuda.so: cannot open shared object file')\n")
    assert out.startswith("['torch', 'torch'] 1 triton is installed but does not import (OSError: libcuda.so")
    assert "triton: backend='triton' needs the triton package, which is not importable (OSError" in out


def test_no_triton_is_a_quiet_fallback(tmp_path):
    out = _probe(tmp_path, None)
    assert out.startswith("['torch', 'torch'] 0\n")
    assert "triton: backend='triton' needs the triton package, which is not importable\n" in out
