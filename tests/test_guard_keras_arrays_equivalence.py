"""The device mode of the Keras guard on Keras' JAX and torch backends (``TrainingGuard(
host_every=k)``, ``guard_arrays.ArrayGuardCallback``) decides, skips and rolls back exactly
as the per-batch host mode: the same events, history and final state over two ``fit`` calls
(TensorFlow's device mode: tests/test_guard_keras_device_equivalence.py). On JAX the check
hands the kept values to Keras' next train step by wrapping ``model.train_function`` for the
length of a ``fit``: no variable is assigned on a steady batch, a snapshot holds its step's
state, the wrapper is gone after the ``fit``, also after one cut short, and a recompiled
model (other optimizer variables) is guarded by the same callback. On torch the check reads
each variable's tensor, and ``.value`` where that casts."""

from __future__ import annotations

import pytest

from tests.keras_backends import run_per_keras_backend

pytest.importorskip("keras")

SCRIPT = r"""
import numpy as np, keras, numstab as ns
from numstab.frameworks.keras.guard_arrays import ArrayGuardCallback

from tests.guard_keras_runs import BAD, BATCH, STEPS, X, Y, events, model_for, run

host_model, host_cb = run(1)
model, cb = run(3)
host_logs, logs = host_cb.logs, cb.logs
assert model.train_function != cb._train_with_kept_values  # gone with the fit
assert isinstance(cb, ArrayGuardCallback), type(cb)
want = events(host_cb)
assert ("rollback", 17, ()) in want and ("skip", STEPS + 30, ("loss_spike",)) in want, want
assert events(cb) == want, (events(cb), want)
assert logs == host_logs and np.isfinite(logs[0]["loss"]).all(), (logs, host_logs)
rtol = 8 * np.finfo(np.float32).eps
h, w = cb.history.as_arrays(), host_cb.history.as_arrays()
for key in w.keys() - {"names"}:
    if np.asarray(w[key]).dtype.kind == "f":
        np.testing.assert_allclose(h[key], w[key], rtol=rtol, atol=0, err_msg=key)
    else:
        np.testing.assert_array_equal(h[key], w[key], err_msg=key)
for a, b in zip(model.weights + model.optimizer.variables,
                host_model.weights + host_model.optimizer.variables, strict=True):
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
# on JAX the guard state packed in two arrays (the default on an accelerator) decides alike
if keras.backend.backend() == "jax":
    from numstab.frameworks.jax.guard_state import PackedGuardState
    ArrayGuardCallback.pack_state = True
    try:
        packed_model, packed_cb = run(3)
    finally:
        ArrayGuardCallback.pack_state = None
    assert isinstance(packed_cb._gstate, PackedGuardState), type(packed_cb._gstate)
    assert events(packed_cb) == want and packed_cb.logs == host_logs
    for a, b in zip(packed_model.weights + packed_model.optimizer.variables,
                    model.weights + model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a),
                                      keras.ops.convert_to_numpy(b))

# a fit cut short by an exception leaves no wrapper behind it, and the next fit trains
class Stop(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 4:
            raise RuntimeError("stop")
try:
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[cb, Stop()])
except RuntimeError:
    pass
before = [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]
model.fit(BAD, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[cb])
assert model.train_function != cb._train_with_kept_values
assert all(np.isfinite(keras.ops.convert_to_numpy(v)).all() for v in model.weights)
assert any((keras.ops.convert_to_numpy(v) != b).any() for v, b in zip(model.weights, before))
# recompiled with another optimizer (other variables), the same callback guards the next fit
# and rolls back to a snapshot of the new variables (taken at that fit's start)
model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
seen = len(cb.events)
model.fit(BAD, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[cb])
assert all(np.isfinite(keras.ops.convert_to_numpy(v)).all() for v in model.weights)
assert [e["event"] for e in cb.events[seen:] if e["event"] == "rollback"] == ["rollback"]

# a snapshot taken at a read holds the state of its step (the variables get the kept values
# before the runner reads them): the weights of a plain run of that many steps
def model_of(callbacks, steps):
    m = model_for()
    m.fit(X[: steps * BATCH], Y[: steps * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
          callbacks=callbacks)
    return m
snap_cb = ns.TrainingGuard(snapshot_every=10, host_every=3).keras_callback()
model_of([snap_cb], STEPS)
snap = snap_cb.runner.ring.latest()
assert snap is not None and 10 < snap.step < STEPS, snap_cb.runner.ring.steps()
plain = model_of([], snap.step)
for got, want in zip(snap.payload, plain.weights, strict=False):
    np.testing.assert_array_equal(got, keras.ops.convert_to_numpy(want))
# on JAX a steady batch assigns no variable (the kept values go to Keras' next train step):
# a fit of 36 batches assigns as many as one of 12, as without the guard (each check
# assigned every variable before)
if keras.backend.backend() == "jax":
    from keras.src.backend.common.variables import Variable
    assign, calls = Variable.assign, [0]
    def counted(self, value):
        calls[0] += 1
        return assign(self, value)
    def assigns(callbacks, steps):
        calls[0] = 0
        Variable.assign = counted
        try:
            model.fit(X[: steps * BATCH], Y[: steps * BATCH], batch_size=BATCH, shuffle=False,
                      verbose=0, callbacks=callbacks)
        finally:
            Variable.assign = assign
        return calls[0]
    steady_cb = ns.TrainingGuard(host_every=1000).keras_callback()
    assigns([steady_cb], 12)  # traced: tracing the train step calls assign (stateless)
    assert assigns([], STEPS) == assigns([], 12)
    assert assigns([steady_cb], STEPS) == assigns([steady_cb], 12), calls
    # the per-batch host mode too reads Keras' training state, not the variables, on a
    # steady batch (it synced and so assigned all 34 every batch before)
    host_steady = ns.TrainingGuard(snapshot_every=10**6).keras_callback()
    assigns([host_steady], 12)
    assert assigns([host_steady], STEPS) == assigns([host_steady], 12), calls
# on torch the check reads each variable's tensor (not ``.value``, which checks scopes per
# variable): the very tensors ``.value`` gives outside an autocast scope, ``.value`` inside
if keras.backend.backend() == "torch":
    from keras.src.backend.common.variables import AutocastScope
    from numstab.frameworks.keras.guard_arrays import _value_reader
    variables = list(model.weights)
    assert all(a is v.value for a, v in zip(_value_reader(variables)(), variables, strict=True))
    with AutocastScope("float16"):  # .value casts here: the reader must ask .value
        cast = _value_reader(variables)()
    assert {str(t.dtype) for t in cast} == {"torch.float16"}, {str(t.dtype) for t in cast}
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def runs():
    return run_per_keras_backend(SCRIPT, backends=("jax", "torch"))


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_device_mode_equals_host_mode_through_skips_a_rollback_and_two_fits(runs, backend):
    code, out, err = runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]
