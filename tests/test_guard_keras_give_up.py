"""The Keras callback after a give-up (``max_rollbacks`` spent: ``NonFiniteError`` out of
``fit``), the user going on with another ``fit``: every step is in the history once, those
read with the give-up's step included (``host_every`` > 1: before, step 3, read with the
give-up at step 2, was missing)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
if keras.backend.backend() != "tensorflow":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)

from numstab.errors import NonFiniteError  # noqa: E402
from numstab.guard import TrainingGuard  # noqa: E402

BATCH = 32
X = np.ones((6 * BATCH, 3), "float32")
Y = np.ones((6 * BATCH, 1), "float32")


def test_deferred_callback_records_every_step_read_with_a_give_up():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    cb = TrainingGuard(
        loss_spikes=None,
        grad_norm_spikes=None,
        rollback_after=1,
        rollback_window=1,
        max_rollbacks=0,
        host_every=4,
    ).keras_callback()
    x = X.copy()
    x[2 * BATCH, 0] = np.nan  # step 2: the rollback, given up, read with steps 0-3
    args = dict(batch_size=BATCH, shuffle=False, verbose=0, callbacks=[cb])
    with pytest.raises(NonFiniteError):
        model.fit(x, Y, **args)
    model.fit(X[: 2 * BATCH], Y[: 2 * BATCH], **args)  # the user goes on
    assert cb.history.as_arrays()["step"].tolist() == [0, 1, 2, 3, 4, 5]
    events = [(e["event"], e["step"]) for e in cb.events]
    assert events == [("snapshot", 0), ("skip", 2), ("give_up", 2)]
