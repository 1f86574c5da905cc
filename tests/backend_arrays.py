"""A NumPy array as one backend's array, for tests parametrized over the backends (a missing
framework skips the test)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def as_backend(backend: str, x: np.ndarray) -> Any:
    """``x`` as ``backend``'s array ("numpy", "torch", "jax" or "tensorflow"), dtype kept."""
    if backend == "numpy":
        return x
    if backend == "torch":
        return pytest.importorskip("torch").tensor(x)
    if backend == "jax":
        return pytest.importorskip("jax").numpy.asarray(x)
    return pytest.importorskip("tensorflow").constant(x)
