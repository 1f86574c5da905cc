"""The TensorFlow Keras device guard keeps its guard state in one vector per dtype and reads
it in two transfers (float32, int32), leaf for leaf equal to the state the last read (rows and
state in one call) gave; a later ``fit`` keeps the same undo copy mechanism (one compiled
call)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("the TensorFlow device callback", allow_module_level=True)
tf = pytest.importorskip("tensorflow")

from numstab.guard import TrainingGuard  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _host_reads import counting  # noqa: E402


def _fit(cb, fits=2):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64 * 10, 8)).astype(np.float32)
    y = rng.normal(size=(64 * 10, 1)).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    for _ in range(fits):
        model.fit(x, y, batch_size=64, verbose=0, callbacks=[cb], shuffle=False)
    return model


def test_device_state_is_read_in_two_transfers_and_equals_each_variable():
    cb = TrainingGuard(host_every=7).keras_callback()
    model = _fit(cb)
    got = tf.nest.flatten(tuple(cb._device_state()))
    want = tf.nest.flatten(tuple(cb.state))  # read with the rows at the end of training
    fresh = tf.nest.flatten(tuple(cb.guard.init_state(cb._host)))
    assert len(got) == len(want) == len(fresh) == 11
    for a, b, c in zip(got, want, fresh, strict=True):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        np.testing.assert_array_equal(a, b)
    assert int(cb.state.step) == 20  # two fits of 10 batches
    assert sorted(cb._packed) == ["float32", "int32"]
    with counting("tensorflow") as counter:
        cb._device_state()
    assert counter.count == 2
    for w, s in zip(model.weights, cb._shadow_vars, strict=False):  # the undo copy is current
        np.testing.assert_array_equal(w.numpy(), s.numpy())


def test_decision_steps_past_float32_integers_are_exact():
    """The rows are float32, which holds integers exactly only to 2**24: a step read from a
    row came back rounded (16777217 as 16777216), so events named wrong steps in long runs.
    The steps are now the host's count, ``state.step`` minus the rows read."""
    cb = TrainingGuard(host_every=4).keras_callback()
    model = _fit(cb, fits=1)
    start = 2**24 + 1
    cb.state = cb.state._replace(step=np.int32(start))
    cb._set_device_state(cb.state)
    seen = []
    after_steps = cb.runner.after_steps
    cb.runner.after_steps = lambda decisions, *rest: (
        seen.extend(decisions) or after_steps(decisions, *rest)
    )
    x = np.random.default_rng(2).normal(size=(64 * 8, 8)).astype(np.float32)
    model.fit(x, x[:, :1], batch_size=64, verbose=0, callbacks=[cb], shuffle=False)
    assert [d["step"] for d in seen] == list(range(start, start + 8))
    assert int(cb.state.step) == start + 8
