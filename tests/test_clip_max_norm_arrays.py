"""``clip_by_global_norm`` and ``clip_coefficient`` take ``max_norm`` as a 0-d array, as ZClip,
AGC and the optax wrappers do: a readable one is read and checked, a traced one (``jax.jit``,
``tf.function``) clips by ``1 / max(norm / max_norm, 1)``. Before, any array raised
``Expected max_norm to be a real number``, so a schedule's value could not be passed in a jit."""

import re

import numpy as np
import pytest

import numstab as ns
from numstab.clipping import clip_coefficient
from tests.backend_arrays import as_backend

BACKENDS = ("numpy", "torch", "jax", "tensorflow")
EPS32 = float(np.finfo(np.float32).eps)
GRADS = {"w": np.array([3.0, 4.0], np.float32), "b": np.array([12.0], np.float32)}  # norm 13


def _clipped(backend, max_norm):
    tree = {k: as_backend(backend, x) for k, x in GRADS.items()}
    out, norm = ns.clip_by_global_norm(tree, max_norm)
    return {k: np.asarray(x) for k, x in out.items()}, float(norm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_readable_array_clips_as_its_number(backend):
    want, want_norm = _clipped(backend, 6.5)
    got, norm = _clipped(backend, as_backend(backend, np.asarray(6.5, np.float32)))
    assert norm == want_norm == 13.0
    for key in GRADS:
        np.testing.assert_array_equal(got[key], want[key])
    assert float(clip_coefficient(as_backend(backend, np.float32(13.0)), np.float32(6.5))) == 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.asarray(-1.0, np.float32), "Expected max_norm in (0, inf). Received: max_norm=-1.0"),
        (np.asarray([1.0], np.float32), "Expected max_norm to be a real number"),
        (np.asarray(True), "Expected max_norm to be a real number"),
    ],
)
def test_a_bad_readable_array_raises_the_same_on_every_backend(backend, value, message):
    with pytest.raises(ns.InvalidArgumentError, match=re.escape(message)):
        _clipped(backend, as_backend(backend, value))


def _within_rounding(got, want):
    """One more float32 rounding than the Python bound's path (the division norm / max_norm)."""
    np.testing.assert_allclose(got, want, rtol=4 * EPS32, atol=0)


def test_a_traced_max_norm_under_jax_jit():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    tree = {k: jnp.asarray(x) for k, x in GRADS.items()}
    clip = jax.jit(lambda g, m: ns.clip_by_global_norm(g, m))
    want, _ = ns.clip_by_global_norm(tree, 6.5)
    out, norm = clip(tree, jnp.float32(6.5))
    assert float(norm) == 13.0
    for key in GRADS:
        _within_rounding(np.asarray(out[key]), np.asarray(want[key]))
    unchanged, _ = clip(tree, jnp.float32(13.0))  # norm <= max_norm: exactly unchanged
    for key in GRADS:
        np.testing.assert_array_equal(np.asarray(unchanged[key]), GRADS[key])
    coef = jax.jit(lambda n, m: clip_coefficient(n, m))(jnp.float32(13.0), jnp.float32(6.5))
    _within_rounding(float(coef), 0.5)


def test_a_traced_max_norm_under_tf_function():
    tf = pytest.importorskip("tensorflow")
    tree = {k: tf.constant(x) for k, x in GRADS.items()}
    clip = tf.function(lambda g, m: ns.clip_by_global_norm(g, m))
    want, _ = ns.clip_by_global_norm(tree, 6.5)
    out, norm = clip(tree, tf.constant(6.5))
    assert float(norm) == 13.0
    for key in GRADS:
        _within_rounding(out[key].numpy(), want[key].numpy())


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_traced_max_norm_that_cannot_be_checked_clips_nothing(value):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    tree = {k: jnp.asarray(x) for k, x in GRADS.items()}
    out, norm = jax.jit(lambda g, m: ns.clip_by_global_norm(g, m))(tree, jnp.float32(value))
    assert float(norm) == 13.0
    for key in GRADS:
        np.testing.assert_array_equal(np.asarray(out[key]), GRADS[key])


def test_a_variable_max_norm_inside_tf_function():
    """A ``tf.Variable`` / ``keras.Variable`` (a Keras hyperparameter) read inside
    ``tf.function`` has no readable value: it is traced (it raised Python's AttributeError,
    ``'SymbolicTensor' object has no attribute 'numpy'``)."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    tree = {k: tf.constant(x) for k, x in GRADS.items()}
    want, _ = ns.clip_by_global_norm(tree, 6.5)
    for variable in (tf.Variable(6.5), keras.Variable(6.5)):
        out, norm = tf.function(lambda g, v=variable: ns.clip_by_global_norm(g, v))(tree)
        assert float(norm) == 13.0
        for key in GRADS:
            _within_rounding(out[key].numpy(), want[key].numpy())
