"""docs/architecture.md is the map of the code: every module under numstab/ appears in its tree
(by file name, in its folder's block), so a new module cannot land unmapped."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_module_is_in_the_architecture_tree():
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text[text.index("```") : text.index("```", text.index("```") + 3)]
    named = set(re.findall(r"[\w.]+\.py\b", tree))
    missing = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "numstab").rglob("*.py")
        if path.name != "__init__.py" and path.name not in named
    )
    assert not missing, f"modules missing from docs/architecture.md's tree: {missing}"
