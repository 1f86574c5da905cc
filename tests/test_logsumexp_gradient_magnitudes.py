"""``logsumexp``'s gradient is softmax(x - max) at any magnitude, on every backend with
gradients and on both paths. torch's own ``logsumexp`` differentiates to exp(x - lse) with
lse rounded at x's magnitude: float32 [1e8] * 3 gave the gradient [1, 1, 1], and at 1e4 a
relative error of 2e-5 (docs/semantics.md §4.1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numstab as ns

# rows of one magnitude: offsets exact in the dtype (1e4 + k in float32; ties at 1e300,
# whose spacing is ~1e284), so x - max is exact and softmax is known in float64
CASES = [
    ("float32", 1e4, [[0.0, -1.0, 0.0, -3.5], [2.0, 1.0, -5.0, 0.0]]),
    ("float32", 1e8, [[0.0, 0.0, 0.0, 0.0], [8.0, 0.0, -8.0, 0.0]]),
    ("float64", 1e300, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _tolerance(dtype: str, classes: int) -> float:
    """Relative: x - m is exact here; lse(x - m) lies in [0, ln K] and is rounded once
    (absolute error <= eps * ln K / 2 after the sum's K roundings of at most eps each),
    and exp rounds once more: (2 + ln K + K) eps bounds every path."""
    return (2.0 + math.log(classes) + classes) * float(np.finfo(dtype).eps)


def _grad(backend: str, x: np.ndarray, axis: int) -> np.ndarray:
    if backend == "torch":
        torch = pytest.importorskip("torch")
        t = torch.tensor(x, requires_grad=True)
        ns.logsumexp(t, axis=axis).sum().backward()
        return t.grad.numpy()
    if backend == "jax":
        jax = pytest.importorskip("jax")
        with jax.enable_x64(x.dtype == np.float64):
            f = jax.grad(lambda a: ns.logsumexp(a, axis=axis).sum())
            return np.asarray(f(jax.numpy.asarray(x)))
    tf = pytest.importorskip("tensorflow")
    v = tf.Variable(x)
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(ns.logsumexp(v, axis=axis))
    return tape.gradient(y, v).numpy()


@pytest.mark.parametrize("impl", ["native", "generic"], indirect=True)
@pytest.mark.parametrize("backend", ["torch", "jax", "tensorflow"])
@pytest.mark.parametrize(("dtype", "magnitude", "offsets"), CASES)
@pytest.mark.parametrize("axis", [-1, 0])
def test_gradient_is_softmax_at_any_magnitude(impl, backend, dtype, magnitude, offsets, axis):
    x = (magnitude + np.asarray(offsets)).astype(dtype)
    if axis == 0:
        x = np.ascontiguousarray(x.T)
    got = _grad(backend, x, axis)
    want = _softmax(np.moveaxis(x.astype(np.float64) - magnitude, axis, -1))
    want = np.moveaxis(want, -1, axis)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, rtol=_tolerance(dtype, x.shape[axis]), atol=0)
