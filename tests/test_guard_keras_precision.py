"""The Keras guard callback under a mixed-precision policy (``mixed_float16``: float16
compute, float32 variables, Keras' LossScaleOptimizer) and with ``steps_per_execution=2``
(not on torch, which Keras runs one step per execution), on every Keras backend (one
subprocess each), in the per-batch host mode and with ``host_every=3``: a NaN sample in one
batch is undone (the weights and the epoch's loss end, bit for bit, as a run without that
batch's step, or that execution's, would leave them), and training goes on."""

from __future__ import annotations

import pytest

from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

pytest.importorskip("keras")

SCRIPT = r"""
import numpy as np, keras, numstab as ns
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = x.sum(1, keepdims=True)
bad = x.copy()
bad[20, 0] = np.nan  # batch 2 of 8 (batch size 8)

def run(data, callbacks, policy="float32", spe=1, skip=()):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", steps_per_execution=spe)
    xs, ys = data
    keep = np.ones(len(xs), bool)
    for b in skip:  # the batches a guard undoes: trained without them
        keep[b * 8 : (b + 1) * 8] = False
    h = model.fit(xs[keep], ys[keep], batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
    return model, h.history["loss"][0]

cases = [("mixed_float16", 1, (2,)), ("float32", 2, (2, 3))]
if keras.backend.backend() == "torch":  # Keras on torch runs one step per execution
    cases = cases[:1]
for policy, spe, skipped_batches in cases:
    # unguarded, the epoch's loss is NaN (under mixed_float16 the LossScaleOptimizer skips the
    # update, not the loss tracker); guarded, it is the loss of a run without that step
    _, plain_loss = run((bad, y), [], policy, spe)
    assert np.isnan(plain_loss), plain_loss
    want, want_loss = run((x, y), [], policy, spe, skip=skipped_batches)
    if policy == "mixed_float16":
        assert "LossScaleOptimizer" in type(want.optimizer).__name__, type(want.optimizer)
    for host_every in (1, 3):
        cb = ns.TrainingGuard(snapshot_every=1000, host_every=host_every).keras_callback()
        model, loss = run((bad, y), [cb], policy, spe)
        assert cb.runner.skipped == 1, (policy, spe, host_every, cb.runner.skipped)
        assert loss == want_loss, (policy, spe, host_every, loss, want_loss)
        for got, w in zip(model.get_weights(), want.get_weights(), strict=True):
            np.testing.assert_array_equal(got, w, f"{policy} spe={spe} host_every={host_every}")
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def runs():
    return run_per_keras_backend(SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_a_nan_batch_is_undone_under_mixed_float16_and_steps_per_execution(runs, backend):
    code, out, err = runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]
