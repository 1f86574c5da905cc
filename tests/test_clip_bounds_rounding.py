"""``clip_by_value`` bounds rounded to a 16-bit leaf's dtype once (docs/semantics.md §7.4),
``clip_coefficient``'s host norm as float32 on every backend (§7.3), and the range that
``check_number`` states for a bound with no lower limit.

Before: torch, TensorFlow and JAX took a Python bound for a float16 leaf through float32, and
every backend for a bfloat16 leaf (NumPy's bfloat16 ``maximum`` included): a bound just above
a tie of the 16-bit dtype rounded twice, one spacing low. ``clip_coefficient(10.0, 1.0)`` was
float64 on NumPy and float32 elsewhere. ``-inf`` was refused with "Expected min_value in
[-inf, inf)", a range holding it."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import numstab as ns
from numstab.backends import load_backend
from numstab.clipping import clip_coefficient, rounded_once
from numstab.errors import InvalidArgumentError

BACKENDS = ["numpy", "torch", "tensorflow", "jax"]
NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# just above a tie of the dtype: rounded once it goes up one spacing, through float32 it ties
# to even (down)
ABOVE_TIE = {"float16": 1 + 2**-11 + 2**-40, "bfloat16": 1 + 2**-8 + 2**-40}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rounded_once_is_the_correctly_rounded_value(dtype):
    rng = np.random.default_rng(0)
    largest = float(ml_dtypes.finfo(NUMPY_DTYPES[dtype]).max)
    low_exponent = -26 if dtype == "float16" else -135  # through the subnormals
    exponents = rng.uniform(low_exponent, math.log2(largest), 20000)
    values = np.sign(rng.normal(size=exponents.size)) * np.exp2(exponents)
    ties = (np.round(values * 2**9) + 0.5) / 2**9  # halfway cases of both dtypes near 1
    for value in [*np.clip(values, -largest, largest), *ties, ABOVE_TIE[dtype], 2.0**-140]:
        want = float(np.asarray(value, np.float64).astype(NUMPY_DTYPES[dtype]))
        assert rounded_once(float(value), dtype) == want, value


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bound_above_a_tie_is_rounded_once(backend, dtype):
    be = load_backend(backend)
    leaf = be.cast(be.asarray(np.array([2.0, -2.0, 0.5], np.float32)), dtype)
    bound = ABOVE_TIE[dtype]
    (out,) = ns.clip_by_value([leaf], -bound, bound)
    want = float(np.asarray(bound).astype(NUMPY_DTYPES[dtype]))
    np.testing.assert_array_equal(np.asarray(be.to_numpy(out), np.float64), [want, -want, 0.5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_coefficient_of_a_host_norm_is_float32(backend):
    coefficient = clip_coefficient(10.0, 1.0, backend=backend)
    assert load_backend(backend).dtype_name(coefficient) == "float32"
    assert float(load_backend(backend).to_numpy(coefficient)) == np.float32(1.0) / np.float32(10)


def test_an_unbounded_range_is_stated_open():
    with pytest.raises(InvalidArgumentError, match=r"min_value in \(-inf, inf\)"):
        ns.clip_by_value([np.ones(2, np.float32)], -math.inf, 1.0)
