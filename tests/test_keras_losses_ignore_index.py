"""numstab's Keras SparseCategoricalCrossentropy with its default ``ignore_index=None``
ignores nothing: -100 is an out-of-range label like any other (docs/semantics.md §4.4.6),
never a silently ignored row, on every Keras backend (one subprocess per backend)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

pytest.importorskip("keras")

SCRIPT = r"""
import numpy as np, keras
from numstab.errors import InvalidArgumentError
from numstab.integrations.keras_losses import SparseCategoricalCrossentropy

rng = np.random.default_rng(3)
logits = rng.normal(size=(4, 7)).astype("float32")
ids = np.array([1, 2, -100, 3])

try:  # eagerly: a typed error naming the label, not the internal sentinel
    SparseCategoricalCrossentropy()(ids, logits)
    raise AssertionError("-100 was ignored by default")
except InvalidArgumentError as err:
    assert "labels[2]=-100" in str(err) and "ignore_index" not in str(err), err

# an ignore_index no label can equal (outside the index dtype) ignores nothing either
valid = np.array([1, 2, 0, 3])
for huge in (2**70, 2**40, -(2**40)):  # outside int32, the ids' dtype (2**40 inside int64)
    np.testing.assert_array_equal(SparseCategoricalCrossentropy(ignore_index=huge)(valid, logits),
                                  SparseCategoricalCrossentropy()(valid, logits))
# -100 ignored only when asked
asked = SparseCategoricalCrossentropy(ignore_index=-100)(ids, logits)
theirs = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)
eps = np.finfo(np.float32).eps
np.testing.assert_allclose(asked, theirs(ids, logits), rtol=16 * eps, atol=16 * eps)

# inside model.evaluate (traced on TF and JAX: NaN, §4.4.6; torch runs eagerly: the error)
keras.utils.set_random_seed(0)
x = rng.normal(size=(8, 5)).astype("float32")
y = np.array([0, 1, 2, -100, 4, 5, 6, 0])
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7)])
for eager in (False, True):
    model.compile(loss=SparseCategoricalCrossentropy(), run_eagerly=eager)
    try:
        loss = model.evaluate(x, y, batch_size=8, verbose=0)
    except InvalidArgumentError as err:
        assert "-100" in str(err), err
        print("raised", eager)
    else:
        assert np.isnan(loss), ("finite loss with label -100 and ignore_index=None", loss)
        assert not eager or keras.backend.backend() == "jax", loss
        print("nan", eager)
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def runs():
    return run_per_keras_backend(SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_default_ignore_index_ignores_nothing_on_each_backend(runs, backend):
    code, out, err = runs[backend]
    assert code == 0 and f"ok {backend}" in out, (out[-2000:], err[-3000:])


def test_default_ignore_index_tf_in_process():
    tf = pytest.importorskip("tensorflow")
    from numstab.errors import InvalidArgumentError
    from numstab.integrations.keras_losses import SparseCategoricalCrossentropy

    logits = np.random.default_rng(0).normal(size=(4, 7)).astype("float32")
    ids = np.array([1, 2, -100, 3])
    with pytest.raises(InvalidArgumentError, match=r"labels\[2\]=-100"):
        SparseCategoricalCrossentropy()(tf.constant(ids), tf.constant(logits))
    traced = tf.function(lambda a, b: SparseCategoricalCrossentropy()(a, b))
    assert np.isnan(float(traced(tf.constant(ids), tf.constant(logits))))
    with pytest.raises(InvalidArgumentError, match="labels"):
        SparseCategoricalCrossentropy(ignore_index=2**70)(ids, logits)
