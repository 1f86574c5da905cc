"""The Keras callback resumes from its snapshot files (``load_snapshot``), as the torch and
optax guards do, on every Keras backend and in both modes (``host_every`` 1 and 4): a new
process's model gets the newest file's weights and optimizer variables, and its next epoch
is the one the first run would have trained. Before, the callback had no ``load_snapshot``:
its files could not be resumed from."""

from __future__ import annotations

import pytest

from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

pytest.importorskip("keras")

SCRIPT = r"""
import shutil, tempfile, numpy as np, keras, numstab as ns
from numstab.errors import InvalidArgumentError

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = x.sum(1, keepdims=True)
FIT = dict(batch_size=8, verbose=0, shuffle=False)

def model_of(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model

def values(model):
    variables = list(model.weights) + list(model.optimizer.variables)
    return [keras.ops.convert_to_numpy(v.value).copy() for v in variables]

for host_every in (1, 4):
    folder, crashed = tempfile.mkdtemp(), tempfile.mkdtemp() + "/files"
    guard = lambda d=crashed: ns.TrainingGuard(snapshot_every=4, snapshot_dir=d,
                                               host_every=host_every)
    first, cb = model_of(0), guard(folder).keras_callback()
    first.fit(x, y, epochs=1, callbacks=[cb], **FIT)  # snapshots at steps 4 and 8
    saved = values(first)
    shutil.copytree(folder, crashed)  # the files a run that crashed now left
    first.fit(x, y, epochs=1, callbacks=[cb], **FIT)  # the epoch a resumed run must repeat

    resumed, again = model_of(1), guard().keras_callback()
    assert not np.allclose(values(resumed)[0], saved[0])  # the test can fail
    assert again.load_snapshot(resumed) == 8
    for a, b in zip(values(resumed), saved, strict=True):
        np.testing.assert_array_equal(a, b)  # the file's values, exactly
    assert int(again.state.step) == 8 and int(keras.ops.convert_to_numpy(
        resumed.optimizer.iterations)) == 8
    resumed.fit(x, y, epochs=1, callbacks=[again], **FIT)
    # the same float32 ops on the same values: equal to a few ulps of each weight
    for a, b in zip(values(resumed), values(first), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert again.history.as_arrays()["step"].tolist() == list(range(8, 16))
    assert again.load_snapshot(step=12) == 12 and int(again.state.step) == 12

    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    other.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    for bad, model in (("does not fit", other), ("compiled model", keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(1)])), ("keras.Model", None)):
        try:
            guard().keras_callback().load_snapshot(model)
        except InvalidArgumentError as exc:
            assert bad in str(exc), (bad, str(exc))
        else:
            raise AssertionError(f"no error for {bad}")
try:
    ns.TrainingGuard().keras_callback().load_snapshot(model_of(0))
except InvalidArgumentError as exc:
    assert "snapshot_dir" in str(exc), str(exc)
else:
    raise AssertionError("no error without snapshot_dir")
print("ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def runs():
    return run_per_keras_backend(SCRIPT)


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_keras_callback_resumes_from_its_files(runs, backend):
    code, out, err = runs[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]
