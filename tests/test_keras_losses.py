"""numstab's Keras Loss classes on every Keras backend (one subprocess per backend: Keras
fixes its backend at import) against Keras' own losses, inside model.fit, and saved and
reloaded (keras.models.load_model)."""

from __future__ import annotations

import pytest

from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

pytest.importorskip("keras")

SCRIPT = r"""
import numpy as np, keras
from keras import ops
from numstab.integrations.keras_losses import (
    CategoricalCrossentropy, SparseCategoricalCrossentropy)

rng = np.random.default_rng(0)
logits = rng.normal(size=(8, 5)).astype("float32") * 3
ids = rng.integers(0, 5, size=(8, 1)).astype("float32")  # Keras hands floats, shape (batch, 1)
ids[2, 0] = 4
weights = rng.uniform(0.5, 2.0, size=8).astype("float32")
tol = dict(rtol=2e-6, atol=2e-6)  # float32 logsumexp of 5 classes: a few ulps

ours, theirs = SparseCategoricalCrossentropy(), keras.losses.SparseCategoricalCrossentropy(
    from_logits=True)
np.testing.assert_allclose(ours(ids, logits), theirs(ids, logits), **tol)
np.testing.assert_allclose(ours(ids, logits, weights), theirs(ids, logits, weights), **tol)
ours = SparseCategoricalCrossentropy(ignore_index=4)
theirs = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=4)
np.testing.assert_allclose(ours(ids, logits), theirs(ids, logits), **tol)

onehot = np.eye(5, dtype="float32")[ids[:, 0].astype(int)]
ours = CategoricalCrossentropy(label_smoothing=0.1)
theirs = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
np.testing.assert_allclose(ours(onehot, logits), theirs(onehot, logits), **tol)

lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
z = SparseCategoricalCrossentropy(z_loss=1e-2)(ids, logits)
plain = SparseCategoricalCrossentropy()(ids, logits)
np.testing.assert_allclose(float(z) - float(plain), 1e-2 * np.mean(lse**2), rtol=1e-5)

# every argument round-trips through get_config, dtype included (Keras' own leaves it out)
for cls, extra in ((SparseCategoricalCrossentropy, {"ignore_index": 3}),
                   (CategoricalCrossentropy, {})):
    args = dict(label_smoothing=0.1, z_loss=1e-3, reduction="sum", name="ce", dtype="float16",
                **extra)
    config = cls(**args).get_config()
    assert config == args, config
    again = cls.from_config(config)
    assert again.get_config() == config and again.dtype == "float16", again.get_config()
    assert cls().get_config()["dtype"] is None

keras.utils.set_random_seed(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = (x[:, :1] > 0).astype("int64")  # (batch, 1) labels
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.Adam(1e-2),
              loss=SparseCategoricalCrossentropy(label_smoothing=0.05, z_loss=1e-4))
history = model.fit(x, y, batch_size=16, epochs=5, verbose=0).history["loss"]
assert np.isfinite(history).all() and history[-1] < history[0], history

# saved and reloaded: keras.models.load_model finds the (registered) losses
import os, tempfile
path = os.path.join(tempfile.mkdtemp(), "model.keras")
model.save(path)
loaded = keras.models.load_model(path)
assert type(loaded.loss) is SparseCategoricalCrossentropy, loaded.loss
assert loaded.loss.get_config() == model.loss.get_config()
np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0))
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def runs():
    return run_per_keras_backend(SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_keras_losses_match_keras_and_train(runs, backend):
    code, out, err = runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]


def test_bad_arguments_are_typed_errors():
    from numstab.errors import InvalidArgumentError
    from numstab.integrations.keras_losses import SparseCategoricalCrossentropy

    with pytest.raises(InvalidArgumentError, match="label_smoothing"):
        SparseCategoricalCrossentropy(label_smoothing=2.0)
    with pytest.raises(InvalidArgumentError, match="ignore_index"):
        SparseCategoricalCrossentropy(ignore_index=1.5)
    with pytest.raises(InvalidArgumentError, match="reduction='avg'"):  # Keras' ValueError
        SparseCategoricalCrossentropy(reduction="avg")
