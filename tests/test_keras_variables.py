"""A Keras 3 variable is its Keras backend's tensor everywhere (docs §1.3): in detection, in
conversion (its ``.value``) and as a tree leaf, eagerly and under ``tf.function`` /
``jax.jit``.

Before: a Keras variable was host data, read by ``np.asarray``: under ``tf.function`` a raw
``NotImplementedError: numpy() is only available when eager execution is enabled``, eagerly a
silent NumPy fallback (``global_norm(model.trainable_variables)`` returned ``numpy.float32``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.keras_backends import ROOT, run_per_keras_backend

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
EPS32 = float(np.finfo(np.float32).eps)  # float32 sums of a few squares: a few ulps
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import numstab as ns  # noqa: E402
from numstab._dispatch import framework_of, resolve_backend, to_backend  # noqa: E402

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="in-process checks run Keras on TensorFlow"
)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def _norm(values) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(v))) for v in values)))


def test_keras_variable_is_a_tensorflow_array():
    v = keras.Variable(np.ones((2, 3), np.float32))
    assert framework_of(v) == "tensorflow"
    be = resolve_backend(v)
    assert be.name == "tensorflow"
    assert isinstance(to_backend(be, v), tf.Variable)  # its .value, no host copy


def test_tree_functions_on_trainable_variables_eager_and_in_tf_function():
    model = _model()
    variables = model.trainable_variables
    expected = _norm(variables)
    eager = ns.global_norm(variables)
    assert isinstance(eager, tf.Tensor)  # was numpy.float32
    assert float(eager) == pytest.approx(expected, rel=16 * EPS32)

    @tf.function
    def step():
        clipped, norm = ns.clip_by_global_norm(variables, 0.1)
        bounded = ns.clip_by_value(variables, -0.01, 0.01)
        return norm, ns.global_norm(clipped), ns.all_finite(variables), bounded

    norm, clipped_norm, finite, bounded = step()
    assert float(norm) == pytest.approx(expected, rel=16 * EPS32)
    assert float(clipped_norm) == pytest.approx(0.1, rel=16 * EPS32) and bool(finite)
    assert max(float(tf.reduce_max(tf.abs(x))) for x in bounded) <= 0.01


def test_losses_with_keras_variable_arguments_in_tf_function():
    kernel = keras.Variable(tf.ones([11, 8]))
    logits = keras.Variable(tf.ones([4, 5]))
    weight = keras.Variable(tf.ones([5]))
    labels = tf.constant([1, 2, 3, 4])

    @tf.function
    def losses():
        return (
            ns.fused_linear_cross_entropy(tf.ones([4, 8]), kernel, labels),
            ns.cross_entropy(logits, labels),
            ns.cross_entropy(tf.ones([4, 5]), labels, weight=weight),
        )

    fused, plain, weighted = losses()
    assert float(fused) == pytest.approx(np.log(11), rel=16 * EPS32)
    assert float(plain) == pytest.approx(np.log(5), rel=16 * EPS32)
    assert float(weighted) == pytest.approx(np.log(5), rel=16 * EPS32)
    assert isinstance(ns.cross_entropy(logits, labels), tf.Tensor)


def test_adaptive_clipping_with_keras_params_in_tf_function():
    model = _model()
    params = model.trainable_variables
    grads = [tf.ones(v.shape) * 10.0 for v in params]

    @tf.function
    def step():
        return ns.AGC(0.01).clip(grads, params)

    out = step()
    assert len(out) == 2 and all(isinstance(x, tf.Tensor) for x in out)
    eager = ns.AGC(0.01).clip(grads, params)
    assert all(np.allclose(a, b) for a, b in zip(out, eager, strict=True))


def test_keras_variables_inside_trees_are_unwrapped():
    model = _model()
    kernel, bias = model.trainable_variables
    tree = {"k": kernel, "inner": [bias]}
    assert float(ns.global_norm(tree)) == pytest.approx(_norm([kernel, bias]), rel=16 * EPS32)
    clipped, _ = ns.clip_by_global_norm(tree, 1e-3)
    assert isinstance(clipped["k"], tf.Tensor) and isinstance(clipped["inner"][0], tf.Tensor)
    kernel.assign(tf.fill(kernel.shape, float("nan")))
    (record,) = ns.find_nonfinite(tree)
    assert record.path == "['k']" and record.nan_count == kernel.shape[0] * kernel.shape[1]


_OTHER_BACKENDS = """
import numpy as np
import keras
import numstab as ns
from numstab._dispatch import framework_of
name = keras.backend.backend()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
variables = model.trainable_variables
assert framework_of(variables[0]) == name, framework_of(variables[0])
norm = ns.global_norm(variables)
expected = np.sqrt(sum(np.sum(np.square(keras.ops.convert_to_numpy(v))) for v in variables))
assert abs(float(norm) - expected) < 16 * np.finfo(np.float32).eps * expected, (norm, expected)
clipped, _ = ns.clip_by_global_norm(variables, 0.1)
logits = keras.Variable(np.ones((2, 3), "float32"))
loss = ns.cross_entropy(logits, np.array([0, 1]))
if name == "jax":
    import jax
    assert isinstance(norm, jax.Array) and isinstance(clipped[0], jax.Array)
    assert isinstance(loss, jax.Array)
    jitted = jax.jit(lambda: ns.global_norm(variables))()
    assert abs(float(jitted) - expected) < 16 * np.finfo(np.float32).eps * expected
else:
    import torch
    assert isinstance(norm, torch.Tensor) and isinstance(clipped[0], torch.Tensor)
    assert isinstance(loss, torch.Tensor)
# a Keras model is named by its variables' Keras paths on every backend (on torch, a Keras
# layer is a torch.nn.Module too: '_functional._torch_params.sequential/dense/kernel')
kernel = model.layers[0].kernel
kernel.assign(keras.ops.where(keras.ops.arange(12).reshape((4, 3)) == 0, np.nan, kernel.value))
paths = [r.path for r in ns.find_nonfinite(model)]
assert paths == [kernel.path], paths
print("ok", name)
"""


def test_keras_variables_on_the_jax_and_torch_backends():
    results = run_per_keras_backend(_OTHER_BACKENDS, backends=("jax", "torch"))
    for backend, (code, out, err) in results.items():
        assert code == 0 and f"ok {backend}" in out, (backend, err[-3000:])


def test_detection_does_not_import_keras():
    script = (
        "import sys, numpy as np, torch, numstab as ns\n"  # TF itself imports keras
        "ns.clip_by_global_norm({'w': torch.ones(2), 'v': [torch.ones(1), None]}, 1.0)\n"
        "ns.global_norm([np.ones(2, np.float32)])\n"
        "ns.cross_entropy(torch.ones([2, 3]), torch.tensor([0, 1]))\n"
        "assert 'keras' not in sys.modules, 'keras imported'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
