"""The architecture as a test: imports go experiments -> pipeline -> models -> kernels, with data_gen
beside; nothing imports upward, and kernels imports nothing of the project."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what each package may import of the project (itself included)
ALLOWED = {
    "kernels": {"kernels"},
    "models": {"models", "kernels"},
    "data_gen": {"data_gen"},
    "pipeline": {"pipeline", "models", "kernels", "data_gen"},
    "experiments": {"experiments", "pipeline", "models", "kernels", "data_gen"},
}


def project_imports(path: Path) -> set[str]:
    """Top-level project packages that a file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package):
    wrong = {str(f.relative_to(REPO)): sorted(project_imports(f) - ALLOWED[package])
             for f in sorted((REPO / package).rglob("*.py"))}
    assert {f: bad for f, bad in wrong.items() if bad} == {}


def test_the_rule_sees_an_upward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from experiments import sweep\nimport kernels.softmax\n")
    assert project_imports(f) - ALLOWED["pipeline"] == {"experiments"}
