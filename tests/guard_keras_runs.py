"""The Keras guard runs that the device-mode equivalence tests compare with the per-batch
host mode (tests/test_guard_keras_device_equivalence.py on TensorFlow, in process;
tests/test_guard_keras_arrays_equivalence.py on JAX and torch, one process each): an epoch
of 36 steps with a lone NaN (step 5), three NaN steps and a rollback (15-17) and a NaN last
step, then a second fit of two epochs with a loss spike (step 36 + 30)."""

from __future__ import annotations

from typing import Any

import numpy as np

BATCH, STEPS = 16, 36  # an epoch: 36 steps, a multiple of every host_every used
_rng = np.random.default_rng(3)
X = _rng.standard_normal((STEPS * BATCH, 8)).astype("float32")
Y = (X @ _rng.standard_normal((8, 1))).astype("float32")
BAD = X.copy()
BAD[5 * BATCH, 0] = np.nan  # step 5: a lone skip
BAD[15 * BATCH : 18 * BATCH, 1] = np.nan  # steps 15-17: three skips, a rollback at step 17
BAD[35 * BATCH, 2] = np.nan  # step 35, the epoch's last: Keras' epoch logs are NaN until mended
SPIKY = Y.copy()
SPIKY[30 * BATCH : 31 * BATCH] *= 1e3  # step 36 + 30 = 66 (second fit): a loss spike


def model_for(optimizer: Any = None, **compile_kw: Any) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-2), loss="mse", **compile_kw)
    return model


def run(host_every: int, **compile_kw: Any) -> tuple[Any, Any]:
    """``(model, callback)`` after the two fits; ``callback.logs``: each fit's history."""
    import numstab as ns

    model = model_for(**compile_kw)
    guard = ns.TrainingGuard(
        snapshot_every=1000,
        rollback_after=3,
        rollback_window=4,
        host_every=host_every,
        loss_spikes=ns.SpikeDetector(window=8, sigma=4.0, warmup=4),
    )
    cb = guard.keras_callback()
    logs = []
    # the second fit() keeps the callback's device state (undo copy, slot, guard state)
    for x, y, epochs in ((BAD, Y, 1), (X, SPIKY, 2)):
        h = model.fit(
            x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[cb]
        )
        logs.append(h.history)
    cb.logs = logs
    return model, cb


def events(cb: Any) -> list[tuple]:
    return [
        (e["event"], e["step"], tuple(e.get("reasons", ())))
        for e in cb.events
        if e["event"] in ("skip", "rollback", "snapshot")
    ]
