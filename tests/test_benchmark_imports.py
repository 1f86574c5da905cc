"""Every name a benchmark imports from numstab (or from another benchmark) exists: the
benchmarks are not run by CI, so a moved module must not break them silently."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from numstab... import name`` and ``from _x import name``
    in ``path``, at any depth (benchmarks import frameworks inside functions)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if node.module.split(".")[0] == "numstab" or node.module.startswith("_"):
            found += [(node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_imports_resolve(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    missing = [
        f"{module}.{name}"
        for module, name in _imports(path)
        if not hasattr(importlib.import_module(module), name)
        and f"{module}.{name}" not in sys.modules
        and importlib.util.find_spec(f"{module}.{name}") is None
    ]
    assert not missing, missing
