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

# a learning rate set by another callback as each epoch begins stays through the undo of the
# epoch's first batch (the undo puts back what the step changed only), in both modes; in the
# host mode the undone batch's logs, which Keras hands every callback, are the metrics after
# the undo: TerminateOnNaN after the guard goes on
class Seen(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        losses.append(logs["loss"])
    def on_epoch_end(self, epoch, logs=None):
        lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

first = x.copy(); first[0, 1] = np.nan  # batch 0 (and 2) of each epoch
schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 / 10**epoch)
for host_every, watch in ((1, [keras.callbacks.TerminateOnNaN()]), (2, [])):
    lrs, losses = [], []
    guard = ns.TrainingGuard(snapshot_every=1000, rollback_after=8, host_every=host_every)
    callback = guard.keras_callback()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(first, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[callback, *watch, schedule, Seen()])
    assert np.allclose(lrs, [1e-2, 1e-3]), (host_every, lrs)
    assert int(model.optimizer.iterations) == 12, (host_every, int(model.optimizer.iterations))
    assert host_every > 1 or np.isfinite(losses).all(), losses
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def runs():
    return run_per_keras_backend(SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_guard_callback_survives_a_nan_batch(runs, backend):
    code, out, err = runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]


# TrainingGuard(host_every=5): the check stays on the device on every backend (TensorFlow:
# guard_device.DeviceGuardCallback; JAX, torch: guard_arrays.ArrayGuardCallback) and the host
# reads the decisions every 5 batches
HOST_EVERY_SCRIPT = r"""
import sys, threading, numpy as np, keras, numstab as ns
sys.path.insert(0, "benchmarks")
import _host_reads
from _host_reads import counting

# only the reads of the training loop's thread: Keras converts its per-batch logs on a thread
# pool, whose reads are Keras' own and land in the count or not by timing
_wrap = _host_reads.ReadCounter.wrap
def _main_thread_wrap(self, fn, counts=lambda *_: True):
    main = threading.main_thread()
    return _wrap(self, fn, lambda *a: threading.current_thread() is main and counts(*a))
_host_reads.ReadCounter.wrap = _main_thread_wrap
from numstab.frameworks.keras.guard_deferred import DeferredGuardCallback
backend = keras.backend.backend()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")

class Seen(keras.callbacks.Callback):  # after the guard: its events as each batch begins
    def __init__(self, guard_cb):
        super().__init__()
        self.guard_cb, self.at = guard_cb, []
    def on_train_batch_begin(self, batch, logs=None):
        self.at.append(len(self.guard_cb.events) if self.guard_cb else 0)

def fit(guard, data, epochs=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    cb = guard.keras_callback() if guard else None
    seen = Seen(cb)
    with counting(backend) as reads:
        model.fit(*data, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[c for c in (cb, seen) if c])
    return model, cb, seen.at, reads.count

def events(cb):
    return [(e["event"], e["step"], tuple(e.get("reasons", ()))) for e in cb.events
            if e["event"] in ("skip", "rollback")]

# a NaN batch (step 6 of 16) is skipped: the weights are those of a run without that batch
bad = x.copy(); bad[100, 0] = np.nan
model, cb, _, _ = fit(ns.TrainingGuard(host_every=5), (bad, y))
assert isinstance(cb, DeferredGuardCallback), type(cb)
assert events(cb) == [("skip", 6, ("nonfinite_loss", "nonfinite_grad"))], events(cb)
keep = np.r_[0:96, 112:256]
without, _, _, _ = fit(None, (x[keep], y[keep]))
for a, b in zip(model.get_weights(), without.get_weights(), strict=True):
    np.testing.assert_array_equal(a, b)
assert len(cb.history) == 16

# a loss spike at step 12 is skipped and logged with its step when steps 10..14 are read, as
# batch 15 begins; the same events as the per-batch host mode
spiky = y.copy(); spiky[192:208] *= 1e3
kw = dict(loss_spikes=ns.SpikeDetector(window=8, sigma=4.0, warmup=4), snapshot_every=1000)
_, cb, at, _ = fit(ns.TrainingGuard(host_every=5, **kw), (x, spiky))
_, host_cb, _, _ = fit(ns.TrainingGuard(**kw), (x, spiky))
assert ("skip", 12, ("loss_spike",)) in events(cb), events(cb)
assert events(cb) == events(host_cb), (events(cb), events(host_cb))
assert at[14] == at[13] == at[10] and at[15] > at[14], at  # read at batch 15 only

# steady batches: no host read beyond Keras' own (the reads of 32 more batches: start and end
# cancel out); the per-batch host mode reads once a batch (the tracker and the update norms
# in one transfer; it made 4 reads a batch before host_ops.py), plus, on JAX and torch,
# Keras' own conversion of the batch's logs, which a callback with on_train_batch_end makes
# synchronous, and the tracker's two values at the start of each of the 2 more epochs
def steady(guard):
    return fit(guard, (x, y), epochs=3)[3] - fit(guard, (x, y), epochs=1)[3]

plain, host = steady(None), steady(ns.TrainingGuard())
device = steady(ns.TrainingGuard(host_every=100))
assert device == plain and plain + 32 <= host <= plain + 2 * 32 + 2 * 2, (plain, device, host)
print("ok", backend, "reads of 32 batches: plain", plain, "host_every=100", device, "host", host)
"""


@pytest.fixture(scope="module")
def host_every_runs():
    return run_per_keras_backend(HOST_EVERY_SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_host_every_skips_logs_at_the_read_and_reads_nothing_per_batch(host_every_runs, backend):
    code, out, err = host_every_runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]


# a model that is not built when fit() begins (a subclassed model, a Sequential without an
# Input), or whose compiled metrics are not (a Sequential with an Input): Keras on TensorFlow
# builds them and its optimizer as it traces the first step, after the callbacks'
# on_train_begin (the metrics were missing from the undo copy: the epoch's mae was NaN).
# Guarded, in both modes, fit works as without the guard: NaN batches 0 and 2 are undone (the
# weights and the epoch's logs are those of a run without them), and a rollback goes back to
# the state before the first step
UNBUILT_SCRIPT = r"""
import numpy as np, keras, numstab as ns
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = x.sum(1, keepdims=True)
bad = x.copy(); bad[0, 0] = bad[20, 1] = np.nan  # batches 0 and 2 of 8

class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)
    def call(self, t):
        return self.out(self.hidden(t))

def sequential():
    return keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])

def with_input():
    layers = [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    return keras.Sequential([keras.Input((4,)), *layers])

def fit(make, x, y, guard=None):
    keras.utils.set_random_seed(0)
    model = make()
    assert model.built is (make is with_input)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    cbs = [guard.keras_callback()] if guard else []
    h = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=cbs)
    return model, h.history, cbs

keep = np.r_[8:16, 24:64]
for make in (Net, sequential, with_input):
    want, want_logs, _ = fit(make, x[keep], y[keep])
    for host_every in (1, 3):
        model, logs, (cb,) = fit(make, bad, y, ns.TrainingGuard(host_every=host_every))
        skips = [e["step"] for e in cb.events if e["event"] == "skip"]
        assert skips == [0, 2], (make, host_every, skips)
        for a, b in zip(model.get_weights(), want.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
        assert logs == want_logs, (make, host_every, logs, want_logs)

# batches 1-3 bad: a rollback at step 3 to the snapshot taken before step 0
keras.utils.set_random_seed(0)
first = Net()
first(x[:1])  # the weights the model starts from
bad = x[:32].copy(); bad[8:, 0] = np.nan
for host_every in (1, 3):
    model, _, (cb,) = fit(Net, bad, y[:32], ns.TrainingGuard(host_every=host_every))
    events = [(e["event"], e["step"]) for e in cb.events]
    assert events[-2:] == [("skip", 3), ("rollback", 3)], events
    assert int(model.optimizer.iterations) == 0
    for a, b in zip(model.get_weights(), first.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def unbuilt_runs():
    return run_per_keras_backend(UNBUILT_SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_guard_callback_sets_up_on_a_model_built_by_fit(unbuilt_runs, backend):
    code, out, err = unbuilt_runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]
