"""bfloat16 on TensorFlow under ``check_numerics(mode="op")`` (docs §14.2).

TensorFlow's check-numerics callback builds its message, NaN and inf counts included, for
every eager output with ``np.isinf(tensor)``; a 0-d bfloat16 tensor gives NumPy a scalar of
an ``ml_dtypes`` type there, not an array. Before: ``tf.nn.gelu`` on bfloat16 (its ``Cast``
of a constant makes such a scalar), so any Keras ``mixed_bfloat16`` model with a gelu, raised
a raw ``ValueError: object __array__ method not producing an array``; a 0-d float8 NaN, which
numstab reads on the host, raised the same ``ValueError`` instead of ``NonFiniteError``.
Such outputs are read on the host now: checked, not skipped.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow")

from numstab import NonFiniteError, check_numerics  # noqa: E402

NAN = float("nan")


def test_gelu_on_bfloat16_is_checked_not_refused():
    x = tf.constant([[-1.0, 0.5], [2.0, 3.0]], tf.bfloat16)
    with check_numerics(backend="tensorflow"):
        y = tf.nn.gelu(x)
    np.testing.assert_allclose(y.numpy().astype(np.float32), tf.nn.gelu(x).numpy(), rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e5m2"])
def test_scalar_nan_is_reported(dtype):
    """A 0-d NaN of an ``ml_dtypes`` type, made eagerly (a ``Cast``), is reported with its
    count, as a 1-d one is."""
    dt = tf.dtypes.as_dtype(dtype)
    for shape, count in (((), 1), ((2,), 2)):
        x = tf.fill(shape, NAN)
        with pytest.raises(NonFiniteError) as info, check_numerics(backend="tensorflow"):
            tf.cast(x, dt)
        assert (info.value.op, info.value.op_kind, info.value.nan_count) == ("Cast", "cast", count)
    with check_numerics(backend="tensorflow"):  # and a finite scalar passes
        assert float(tf.cast(tf.constant(1.5), dt)) == 1.5


def test_keras_mixed_bfloat16_dense_gelu():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras runs on another backend")
    layer = keras.layers.Dense(4, activation="gelu", dtype="mixed_bfloat16")
    x = np.ones((2, 3), np.float32)
    with check_numerics(backend="tensorflow"):
        out = layer(x)
    assert out.dtype == tf.bfloat16
    layer.kernel.assign(np.full((3, 4), NAN, np.float32))  # a bfloat16 NaN is still reported
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="tensorflow"):
        layer(x)
    assert info.value.framework == "tensorflow" and info.value.phase == "forward"
