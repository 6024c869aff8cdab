"""The size budgets of issue 43: the library (kernels, models, data_gen, pipeline) and the lab
(experiments) in Python lines, and module docstrings of at most 15 lines outside the public op
modules, whose docstrings are the ops' spec."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("kernels", "models", "data_gen", "pipeline")
SPEC_MODULES = {f"kernels/{name}.py" for name in
                ("flash_attention", "dense_attention", "softmax", "bmm", "conversions", "elementwise")}


def _lines(*packages: str) -> int:
    """What `find <packages> -name '*.py' | xargs cat | wc -l` counts: newlines of every Python file."""
    return sum(p.read_bytes().count(b"\n") for pkg in packages for p in (REPO / pkg).rglob("*.py"))


def test_the_library_is_at_most_12_500_lines():
    assert _lines(*LIBRARY) <= 12_500


def test_the_lab_is_at_most_7_600_lines():
    assert _lines("experiments") <= 7_600


@pytest.mark.parametrize("package", [*LIBRARY, "experiments"])
def test_no_module_docstring_is_over_15_lines_outside_the_public_op_modules(package):
    long = {}
    for path in sorted((REPO / package).rglob("*.py")):
        doc = ast.parse(path.read_text()).body[:1]
        if doc and isinstance(doc[0], ast.Expr) and isinstance(doc[0].value, ast.Constant) \
                and isinstance(doc[0].value.value, str):
            n = doc[0].end_lineno - doc[0].lineno + 1
            if n > 15 and path.relative_to(REPO).as_posix() not in SPEC_MODULES:
                long[path.relative_to(REPO).as_posix()] = n
    assert not long, long
