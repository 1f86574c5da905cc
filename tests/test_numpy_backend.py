"""The NumPy backend's own primitives where NumPy's behaviour depends on versions."""

from __future__ import annotations

import numpy as np
import pytest

from numstab.backends import load_backend


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_where_keeps_the_array_dtype_against_a_python_number(dtype):
    """NEP 50: a Python number takes the array's dtype. bfloat16 arrays got float64 from
    ``np.where`` with ml_dtypes < 0.7 (seen with the versions JAX 0.11 installs)."""
    be = load_backend("numpy")
    x = be.asarray(np.array([1.0, np.nan, -3.0]), dtype)
    ok = np.isfinite(be.to_numpy(x))
    cases = [
        (be.where(ok, x, -2.0), [1.0, -2.0, -3.0]),
        (be.where(~ok, 0.5, x), [1.0, 0.5, -3.0]),
        (be.where(ok, x, 0), [1.0, 0.0, -3.0]),
    ]
    for got, want in cases:
        assert be.dtype_name(got) == dtype
        np.testing.assert_array_equal(be.to_numpy(got), want)
