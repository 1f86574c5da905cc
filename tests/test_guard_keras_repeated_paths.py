"""The Keras callback's snapshot files keep every variable where two share a Keras path (a
layer calling ``add_weight(name="w")`` twice): ``load_snapshot`` gives each its own value, on
every Keras backend and in both modes. Before, the file was keyed by path: the second
variable's value took the first's key, the file held one array fewer, and ``load_snapshot``
gave both variables the second's value without an error. A file written so (one value
fewer) is refused with ``InvalidArgumentError`` before anything is restored."""

from __future__ import annotations

import pytest

from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

pytest.importorskip("keras")

SCRIPT = r"""
import tempfile, numpy as np, keras, numstab as ns
from numstab.errors import InvalidArgumentError

class Affine(keras.layers.Layer):
    def build(self, shape):
        self.w1 = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")
        self.w2 = self.add_weight(shape=(shape[-1],), initializer="zeros", name="w")

    def call(self, x):
        return x * self.w1 + self.w2

def model_of(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), Affine(name="aff"),
                              keras.layers.Dense(1, name="out")], name="net")
    model.compile(optimizer=keras.optimizers.Adam(1e-2, name="opt"), loss="mse")
    return model

def values(model):
    variables = list(model.weights) + list(model.optimizer.variables)
    return [keras.ops.convert_to_numpy(v.value).copy() for v in variables]

rng = np.random.default_rng(0)
x = rng.normal(size=(32, 4)).astype("float32")
y = x.sum(1, keepdims=True)
FIT = dict(batch_size=8, epochs=1, verbose=0, shuffle=False)

for host_every in (1, 4):
    guard = lambda d: ns.TrainingGuard(snapshot_every=4, snapshot_dir=d, host_every=host_every)
    folder = tempfile.mkdtemp()
    first = model_of(0)
    paths = [v.path for v in first.weights]
    assert paths[0] == paths[1], paths  # the case: two variables of one path
    first.fit(x, y, callbacks=[guard(folder).keras_callback()], **FIT)  # snapshot at step 4
    saved = values(first)
    assert not np.allclose(saved[0], saved[1])

    resumed = model_of(1)
    assert guard(folder).keras_callback().load_snapshot(resumed) == 4
    got = values(resumed)
    assert len(got) == len(saved)
    for j, (a, b) in enumerate(zip(got, saved, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"variable {j}")

    # a file written as before (keyed by path: one value fewer) does not fit: refused
    old = tempfile.mkdtemp()
    writer = guard(old).keras_callback()
    writer.to_host = lambda payload, cb=writer: {  # the writer before
        v.path: a for v, a in zip(cb._state_vars, payload, strict=True)}
    model_of(0).fit(x, y, callbacks=[writer], **FIT)
    fresh = model_of(2)
    fresh.optimizer.build(fresh.trainable_variables)
    before = values(fresh)
    try:
        guard(old).keras_callback().load_snapshot(fresh)
    except InvalidArgumentError as exc:
        assert "variables" in str(exc), str(exc)
    else:
        raise AssertionError("no error for a file holding one value fewer")
    for a, b in zip(values(fresh), before, strict=True):
        np.testing.assert_array_equal(a, b)  # nothing restored
print("ok", keras.backend.backend())
"""


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_variables_sharing_a_path_each_get_their_value(backend):
    code, out, err = run_per_keras_backend(SCRIPT, (backend,))[backend]
    assert code == 0 and f"ok {backend}" in out, err[-3000:]
