"""numstab.guard as a Keras 3 callback: a NaN batch at step k kills an unguarded model.fit and
not a guarded one (the step is undone: weights, optimizer variables, iterations, running loss);
rollback restores weights and optimizer variables and lowers the learning rate."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
if keras.backend.backend() != "tensorflow":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)

from numstab.guard import TrainingGuard  # noqa: E402

BATCH, REPEATS = 32, 12  # one epoch of 8 * 12 = 96 steps
_rng = np.random.default_rng(0)
X = _rng.standard_normal((256, 8)).astype("float32")
Y = (X @ _rng.standard_normal((8, 1)) + 0.1 * _rng.standard_normal((256, 1))).astype("float32")


def fit(callback=None, nan_steps=()):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", jit_compile=False)
    x, y = np.tile(X, (REPEATS, 1)), np.tile(Y, (REPEATS, 1))
    for step in nan_steps:
        x[step * BATCH, 0] = np.nan
    hist = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[callback] if callback is not None else [],
    )
    weights = np.concatenate([w.numpy().ravel() for w in model.weights])
    return model.evaluate(X, Y, verbose=0), np.isfinite(weights).all(), model, hist


def test_nan_batch_kills_plain_fit_and_the_guard_callback_survives_it():
    clean, clean_finite, clean_model, _ = fit()
    dead, dead_finite, _, _ = fit(nan_steps={40})
    cb = TrainingGuard(snapshot_every=25).keras_callback()
    kept, finite, model, hist = fit(cb, nan_steps={40})
    assert clean_finite and math.isfinite(clean)
    assert not dead_finite and math.isnan(dead)
    assert finite and abs(kept - clean) <= 0.05 * clean, (kept, clean)
    skips = [e for e in cb.events if e["event"] == "skip"]
    assert [(e["step"], e["reasons"]) for e in skips] == [
        (40, ["nonfinite_loss", "nonfinite_grad"])
    ]
    # the skipped step never happened: one fewer optimizer iteration, finite epoch loss
    assert int(model.optimizer.iterations) == int(clean_model.optimizer.iterations) - 1
    assert math.isfinite(hist.history["loss"][-1])
    h = cb.history.as_arrays()
    assert h["layer_norms"].shape == (8 * REPEATS, 4) and not h["applied"][40]
    assert np.isfinite(h["loss"][41:]).all()  # per-batch losses, not a NaN running mean


def test_rollback_restores_weights_and_optimizer_and_lowers_the_lr():
    seen = {}

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 19:  # the guard's snapshot after 20 good steps
                seen["weights"] = [w.numpy().copy() for w in self.model.weights]
                seen["opt"] = [v.numpy().copy() for v in self.model.optimizer.variables]
            if batch == 22:
                seen["weights_after"] = [w.numpy().copy() for w in self.model.weights]
                seen["opt_after"] = [v.numpy().copy() for v in self.model.optimizer.variables]

    cb = TrainingGuard(snapshot_every=10, rollback_after=3).keras_callback()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", jit_compile=False)
    x = np.tile(X, (4, 1))
    x[20 * BATCH : 23 * BATCH, 0] = np.nan
    model.fit(
        x,
        np.tile(Y, (4, 1)),
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[cb, Spy()],
    )
    for a, b in zip(seen["weights"], seen["weights_after"], strict=True):
        np.testing.assert_array_equal(a, b)
    lr_index = next(i for i, v in enumerate(model.optimizer.variables) if "learning_rate" in v.path)
    for i, (a, b) in enumerate(zip(seen["opt"], seen["opt_after"], strict=True)):
        if i == lr_index:
            assert float(b) == pytest.approx(0.025)  # restored 0.05, times the factor
        else:
            np.testing.assert_array_equal(a, b)  # iterations, moments
    events = [(e["event"], e["step"]) for e in cb.events if e["event"] != "snapshot"]
    assert events == [("skip", 20), ("skip", 21), ("skip", 22), ("rollback", 22)]
    assert float(model.optimizer.learning_rate) == pytest.approx(0.025)


def test_a_snapshot_of_other_variables_is_refused_by_name(tmp_path):
    """After ``compile`` with another optimizer, a disk snapshot of the old variables cannot
    be loaded into the new ones: a typed error names the first variable that does not fit;
    the snapshot taken for the new variables loads."""
    from numstab.errors import InvalidArgumentError

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)
    cb = TrainingGuard(snapshot_dir=tmp_path).keras_callback()
    model.fit(X, Y, batch_size=BATCH, verbose=0, callbacks=[cb])
    old = cb.runner.disk.steps()[-1]
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    model.fit(X, Y, batch_size=BATCH, verbose=0, callbacks=[cb])
    with pytest.raises(InvalidArgumentError, match="snapshot") as err:
        cb.runner.load_from_disk(old)
    assert repr(model.optimizer.variables[0].path) in str(err.value), err.value
    step, _ = cb.runner.load_from_disk()
    assert step > old


def test_rollback_scales_the_lr_of_a_wrapped_optimizer_and_not_a_wrapped_schedule():
    """The learning rate sits in the innermost of several wrapping optimizers (Keras'
    LossScaleOptimizer around numstab's ZClipOptimizer): a rollback multiplies it by the
    factor; a LearningRateSchedule there cannot be, and no longer raises Keras' TypeError."""
    from numstab.integrations.keras_clipping import ZClipOptimizer

    x = np.tile(X, (4, 1))
    x[20 * BATCH : 23 * BATCH, 0] = np.nan
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 100, 0.9)
    for lr, applied in ((0.05, True), (schedule, False)):
        inner = ZClipOptimizer(keras.optimizers.Adam(lr), warmup_steps=3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.LossScaleOptimizer(inner), "mse", jit_compile=False)
        cb = TrainingGuard(snapshot_every=10, rollback_after=3).keras_callback()
        fit_args = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        model.fit(x[: 24 * BATCH], np.tile(Y, (4, 1))[: 24 * BATCH], **fit_args)
        assert [e["step"] for e in cb.events if e["event"] == "rollback"] == [22]
        assert cb.lr_factor_applied is applied
        if applied:
            assert float(model.optimizer.learning_rate) == pytest.approx(0.025)
