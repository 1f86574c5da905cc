"""The bit-level generics every backend shares (``Backend.bitcast``): ``step_toward_zero`` and
``magnitude_from_bits``, checked on all 65,536 float16 and bfloat16 bit patterns against
NumPy's exact values, eagerly and under each framework's compiler (``jax.jit``,
``torch.compile``, ``tf.function``): ``cast_toward_zero`` leans on them where a compiler keeps
16-bit values in float32 (docs/semantics.md §7.3, the toward-zero rounding of clipped leaves).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numstab.backends import load_backend

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
BACKENDS = ["numpy", "torch", "jax", "tensorflow"]


def _all_patterns(dtype: str) -> np.ndarray:
    return np.arange(-(2**15), 2**15, dtype=np.int32).astype(np.int16).view(NUMPY_DTYPES[dtype])


def _compiled(backend: str, fn):
    if backend == "jax":
        import jax

        return jax.jit(fn)
    if backend == "torch":
        import torch

        return torch.compile(fn, fullgraph=True, dynamic=False)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def _run(backend: str, fn, x: np.ndarray, compiled: bool) -> np.ndarray:
    be = load_backend(backend)
    arg = be.cast(be.asarray(x.astype(np.float32)), str(x.dtype))  # every 16-bit value is exact
    out = (_compiled(backend, fn) if compiled else fn)(arg)
    return np.asarray(be.to_numpy(out))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_magnitude_from_bits_is_the_exact_value(backend, dtype, compiled):
    if backend == "tensorflow":
        pytest.skip("TensorFlow tensors have no shift operators (its compilers keep 16-bit values)")
    x = _all_patterns(dtype)
    got = _run(backend, load_backend(backend).magnitude_from_bits, x, compiled)
    want = np.abs(x.astype(np.float32))
    assert got.dtype == np.float32
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])  # inf, subnormals and -0 included


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_step_toward_zero_is_the_next_value_toward_zero(backend, dtype, compiled):
    x = _all_patterns(dtype)
    x = x[np.isfinite(x.astype(np.float32)) & (x.astype(np.float32) != 0)]
    got = _run(backend, load_backend(backend).step_toward_zero, x, compiled).astype(np.float32)
    values = np.abs(_all_patterns(dtype).astype(np.float32))
    magnitudes = np.unique(values[np.isfinite(values)])  # sorted, 0 first
    below = magnitudes[np.searchsorted(magnitudes, np.abs(x.astype(np.float32))) - 1]
    np.testing.assert_array_equal(got, np.sign(x.astype(np.float32)) * below)
