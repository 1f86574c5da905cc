"""Importing numstab must not import any framework (nor numpy)."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ("torch", "tensorflow", "jax", "optax", "numpy")


def _modules_after(code: str) -> list[str]:
    script = (
        code
        + f"\nimport json, sys; print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_numstab_imports_no_framework():
    assert _modules_after("import numstab") == []


def test_numpy_use_imports_no_deep_learning_framework():
    code = "import numpy as np, numstab\n"
    code += "numstab.cross_entropy(np.zeros((2, 3), 'float32'), np.array([0, 1]))"
    assert _modules_after(code) == ["numpy"]


def test_available_backends_imports_nothing():
    loaded = _modules_after("import numstab\nassert 'numpy' in numstab.available_backends()")
    assert loaded == []


def test_framework_hooks_follow_what_is_imported():
    """``frameworks.loaded`` imports no framework, and sees one as soon as the user imports
    it (the NumPy tree walk, then a torch module's named leaves)."""
    code = (
        "import numpy as np\n"
        "from numstab import frameworks, find_nonfinite\n"
        "assert frameworks.loaded('tree', 'named_leaves') == ()\n"
        "assert find_nonfinite({'w': np.array([1.0, np.nan])})[0].path == \"['w']\"\n"
        "import torch\n"
        "(named,) = frameworks.loaded('tree', 'named_leaves')\n"
        "assert [p for p, _ in named(torch.nn.Linear(2, 2))] == ['weight', 'bias']\n"
        "assert frameworks.loaded('tree', 'sparse_type') == ()\n"
    )
    assert _modules_after(code) == ["torch", "numpy"]
