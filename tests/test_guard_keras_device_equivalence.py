"""The TensorFlow device mode of the Keras guard (``TrainingGuard(host_every=k)``,
``guard_device.py``) decides, skips and rolls back exactly as the per-batch host mode: the
same events, history and final state over two ``fit`` calls (the second after the first's
final read), where the rollback falls on a read (device mode acts on a rollback, and takes a
snapshot, when it reads: docs/semantics.md §16.12).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
if keras.backend.backend() != "tensorflow":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)

import numstab as ns  # noqa: E402
from numstab.frameworks.keras.guard_device import DeviceGuardCallback  # noqa: E402
from tests.guard_keras_runs import BAD, BATCH, STEPS, Y, events  # noqa: E402
from tests.guard_keras_runs import run as _guarded_run  # noqa: E402


def _run(host_every: int):
    return _guarded_run(host_every, jit_compile=False)


_events = events


@pytest.mark.parametrize("host_every", [3, 6])
def test_device_mode_equals_host_mode_through_skips_a_rollback_and_two_fits(host_every):
    host_model, host_cb = _run(1)
    model, cb = _run(host_every)
    assert isinstance(cb, DeviceGuardCallback)
    want_events = _events(host_cb)
    assert ("skip", 5, ("nonfinite_loss", "nonfinite_grad")) in want_events
    assert ("rollback", 17, ()) in want_events
    assert ("skip", STEPS + 30, ("loss_spike",)) in want_events
    assert ("skip", 35, ("nonfinite_loss", "nonfinite_grad")) in want_events
    assert _events(cb) == want_events
    assert cb.logs == host_cb.logs and np.isfinite(cb.logs[0]["loss"]).all(), cb.logs
    h, want = cb.history.as_arrays(), host_cb.history.as_arrays()
    assert h.keys() == want.keys()
    # the norms and the loss: float32 on the device, float64 then float32 on the host (a
    # few ulps apart); the rest exactly
    rtol = 8 * np.finfo(np.float32).eps
    for key in want.keys() - {"names"}:  # the layers' names differ: two models
        if np.asarray(want[key]).dtype.kind == "f":
            np.testing.assert_allclose(h[key], want[key], rtol=rtol, atol=0, err_msg=key)
        else:
            np.testing.assert_array_equal(h[key], want[key], err_msg=key)
    for a, b in zip(model.weights, host_model.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(model.optimizer.variables, host_model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(cb.state.step) == int(host_cb.state.step) == 3 * STEPS


def test_device_step_takes_no_argument():
    """The compiled per-batch check is called without arguments (its row index lives in a
    variable), as a concrete function: a tensor argument, and a ``tf.function``'s dispatch,
    each cost the CPU as much as the decision itself."""
    _, cb = _run(3)
    import tensorflow as tf

    assert isinstance(cb._fn, tf.types.experimental.ConcreteFunction), type(cb._fn)
    signature = cb._fn.structured_input_signature
    assert signature == ((), {}), signature


@pytest.mark.parametrize("loss_spikes", [None, ns.SpikeDetector(window=5, warmup=3)])
def test_packed_guard_state_round_trips_on_host_and_in_tensorflow(loss_spikes):
    import tensorflow as tf

    from numstab.backends import load_backend
    from numstab.frameworks.keras.guard_device import _Layout

    guard = ns.TrainingGuard(loss_spikes=loss_spikes, rollback_window=6)
    rng = np.random.default_rng(0)
    state = tf.nest.map_structure(  # distinct values in every slot
        lambda x: (
            rng.integers(1, 99, np.shape(x)) + 0.5 * (np.asarray(x).dtype.kind == "f")
        ).astype(np.asarray(x).dtype),
        guard.init_state(load_backend("numpy")),
    )
    layout = _Layout(state)
    host = layout.pack(state, np)
    device = layout.pack(tf.nest.map_structure(tf.constant, state), tf)
    assert sorted(host) == sorted(device) == ["float32", "int32"]
    for name in host:
        np.testing.assert_array_equal(device[name].numpy(), host[name])
    for back in (layout.unpack(host, copy=True), layout.unpack(device)):
        assert type(back) is type(state)
        for a, b in zip(tf.nest.flatten(tuple(back)), tf.nest.flatten(tuple(state)), strict=True):
            assert np.asarray(a).dtype == b.dtype and np.shape(a) == b.shape
            np.testing.assert_array_equal(np.asarray(a), b)


def test_recompiled_model_is_guarded_and_rolls_back_to_its_own_variables():
    """After ``compile`` with another optimizer (other variables), the same callback guards
    the next ``fit``: its device copies are made again, and the snapshots of the old
    variables give way to one of the new, which a rollback restores."""
    model, cb = _run(3)
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse", jit_compile=False)
    seen = len(cb.events)
    model.fit(BAD, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[cb])
    assert all(np.isfinite(w).all() for w in model.get_weights())
    new = [(e["event"], e["step"]) for e in cb.events[seen:] if e["event"] != "lr_factor"]
    assert ("rollback", 3 * STEPS + 17) in new, new
    assert ("skip", 3 * STEPS + 5) in new, new
