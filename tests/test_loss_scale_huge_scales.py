"""LossScaler.unscale past 2**126, where 1 / scale is a float32 subnormal that TensorFlow's
and XLA's kernels flush to 0 (every gradient came back 0 with finite=True): exact on every
backend and mode for power-of-two scales up to float32's largest, and below 2**126 the same
values as before (times the float32 reciprocal)."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

# scaled gradients of a few unscaled values whose quotients are normal float32 numbers
SCALED = np.array([2.0**126, 3.0 * 2**125, 2.0**120, -(2.0**124)], np.float32)
BACKENDS = ["numpy", "torch", "tensorflow", "jax"]


def _as(backend: str, x: np.ndarray, dtype: str = "float32"):
    if backend == "torch":
        import torch

        return torch.from_numpy(x.astype(np.float32)).to(getattr(torch, dtype))
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.cast(tf.constant(x.astype(np.float32)), dtype)
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x.astype(np.float32)).astype(dtype)
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def _host(x) -> np.ndarray:
    return np.asarray(x.float() if hasattr(x, "float") else x, np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exponent", [126, 127])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_unscale_is_exact_up_to_2_127(backend, exponent, dtype):
    scaler = ns.LossScaler(init_scale=2.0**exponent)
    grads = {"w": _as(backend, SCALED, dtype), "none": None}
    state = scaler.init(like=grads["w"])
    out, finite = scaler.unscale(grads, state)
    assert out["none"] is None and bool(finite)
    np.testing.assert_array_equal(_host(out["w"]), SCALED.astype(np.float64) / 2.0**exponent)


def test_compiled_tensorflow_unscale_is_exact():
    import tensorflow as tf

    scaler = ns.LossScaler(init_scale=2.0**127)
    state = scaler.init(like=tf.constant(SCALED))
    want = SCALED.astype(np.float64) / 2.0**127
    for jit in (False, True):  # Grappler reassociated (x * a) * b; XLA kept it
        step = tf.function(lambda g, s: scaler.unscale(g, s)[0][0], jit_compile=jit)
        np.testing.assert_array_equal(_host(step([tf.constant(SCALED)], state)), want)
    variable = tf.Variable(state.scale)  # a Keras LossScaleOptimizer keeps it in a variable
    step = tf.function(lambda g: scaler.unscale(g, state._replace(scale=variable))[0][0])
    np.testing.assert_array_equal(_host(step([tf.constant(SCALED)])), want)


def test_jitted_jax_unscale_is_exact():
    import jax
    import jax.numpy as jnp

    scaler = ns.LossScaler(init_scale=2.0**127)
    state = scaler.init(like=jnp.asarray(SCALED))
    out = jax.jit(lambda g, s: scaler.unscale(g, s)[0][0])([jnp.asarray(SCALED)], state)
    np.testing.assert_array_equal(_host(out), SCALED.astype(np.float64) / 2.0**127)


@pytest.mark.parametrize("backend", BACKENDS)
def test_below_2_126_the_values_are_the_reciprocal_products(backend):
    """Power-of-two scales: the float32 reciprocal product, bit for bit (as before); any
    other scale: torch, JAX and NumPy multiply by it, TensorFlow divides (the correctly
    rounded quotient), at most one float32 spacing from it."""
    rng = np.random.default_rng(3)
    scaled = (rng.standard_normal(256) * 2.0**20).astype(np.float32)
    for scale in (2.0**16, 2.0**-3, 1000.0, 3.0):
        scaler = ns.LossScaler(init_scale=scale)
        state = scaler.init(like=_as(backend, scaled))
        (got,), _ = scaler.unscale([_as(backend, scaled)], state)
        reciprocal = scaled * np.float32(1.0 / np.float32(scale))
        if backend == "tensorflow" and scale in (1000.0, 3.0):
            spacing = np.spacing(np.abs(reciprocal)).astype(np.float64)
            assert np.all(np.abs(_host(got) - reciprocal) <= spacing)
        else:
            np.testing.assert_array_equal(_host(got), reciprocal.astype(np.float64))
