"""The guard's Keras callback in model.fit on every Keras backend (one subprocess per backend:
Keras fixes its backend at import). A NaN sample in batch 2: unguarded, the weights end NaN;
guarded, that one step is undone and training goes on."""

from __future__ import annotations

import pytest

from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

pytest.importorskip("keras")

SCRIPT = r"""
import numpy as np, keras, numstab as ns
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = x.sum(1, keepdims=True)
x[20, 0] = np.nan  # batch 2 of 8

def run(callbacks):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    return model

plain = run([])
assert not all(np.isfinite(w).all() for w in plain.get_weights())  # the test can fail
callback = ns.TrainingGuard(snapshot_every=1000).keras_callback()
model = run([callback])
assert all(np.isfinite(w).all() for w in model.get_weights())
assert callback.runner.skipped == 2, callback.runner.skipped  # batch 2, in each epoch
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def runs():
    return run_per_keras_backend(SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_guard_callback_survives_a_nan_batch(runs, backend):
    code, out, err = runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]
