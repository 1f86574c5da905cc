"""The NumPy backend's own primitives where NumPy's behaviour depends on versions."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns
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


def test_cast_returns_arrays_and_skips_only_casts_with_nothing_to_do():
    """``cast`` gives an ndarray of the asked dtype for arrays, NumPy and Python scalars, and
    bfloat16; the very array where its dtype is already the one asked (as
    ``astype(copy=False)``), a new one otherwise (the input untouched)."""
    be = load_backend("numpy")
    x = np.array([1.5, -2.0], np.float32)
    assert be.cast(x, "float32") is x
    y = be.cast(x, "int32")
    assert y.dtype == np.int32 and y.tolist() == [1, -2] and x.dtype == np.float32
    swapped = x.astype(x.dtype.newbyteorder())
    assert be.cast(swapped, "float32").dtype == np.dtype(np.float32).newbyteorder("=")
    for value in (np.float32(2.5), 2.5, True, np.int64(3)):
        got = be.cast(value, "float32")
        assert type(got) is np.ndarray and got.dtype == np.float32 and got.shape == ()
        assert got == np.float32(value)
    assert be.dtype_name(be.cast(x, "bfloat16")) == "bfloat16"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.bool_])
def test_sum_is_numpys_sum(dtype):
    """``sum`` (``np.add.reduce``) gives ``np.sum``'s value, dtype and shape."""
    be = load_backend("numpy")
    x = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    for axis, keepdims in [(None, False), (1, False), (-1, True), (None, True)]:
        got, want = be.sum(x, axis=axis, keepdims=keepdims), np.sum(x, axis=axis, keepdims=keepdims)
        assert np.asarray(got).dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(got, want)
    assert be.sum(np.float32(2.0)) == np.float32(2.0)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "longdouble", "bfloat16"])
def test_clip_by_value_keeps_every_numpy_float_dtype(dtype):
    """``clip`` keeps the dtype (NumPy's own ``np.clip`` returned float32 for ml_dtypes'
    bfloat16), NaN passes, +-inf become the bounds; a float128 leaf has no range table entry
    and keeps its bounds as given."""
    import ml_dtypes

    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = np.array([-5.0, 0.25, 7.0, np.inf, -np.inf, np.nan]).astype(kind)
    [got] = ns.clip_by_value([x], -1.0, 2.0)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.astype(np.float64), [-1.0, 0.25, 2.0, 2.0, -1.0, np.nan])


@pytest.mark.parametrize("dtype", ["longdouble", "clongdouble"])
def test_find_nonfinite_reads_longdouble_in_its_own_range(dtype):
    """A float128 (or complex256) leaf's counts and range are read in its own dtype: before,
    it was read in float32, and a finite 1e300 beside a NaN counted as +inf."""
    (record,) = ns.find_nonfinite([np.array([1e300, -2.0, np.nan], dtype)])
    assert (record.nan_count, record.inf_count) == (1, 0)
    assert (record.finite_min, record.finite_max) == (-2.0, 1e300)
