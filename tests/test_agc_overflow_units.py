"""AGC on units whose norm is not finite (§13.2): a NaN or inf element, or a float32 sum of
squares past float32's largest value (as §7.2's norms, not rescaled), or a non-finite
parameter norm, leaves the unit unchanged, on every backend, eagerly, under jax.jit and
tf.function, as clip_by_global_norm leaves such a tree. Before, optax's rule made the finite
[1e20, 1e20] zero ([0, 0], limit / inf) and [inf, 1] half-NaN, half-zero ([nan, 0])."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns
from tests.backend_arrays import as_backend

BACKENDS = ["numpy", "torch", "jax", "tensorflow"]
EPS32 = float(np.finfo(np.float32).eps)
NAN, INF = float("nan"), float("inf")


def _agc(backend: str, mode: str, grads: list, params: list, **kw) -> list[np.ndarray]:
    g = [as_backend(backend, np.asarray(x, np.float32)) for x in grads]
    p = [as_backend(backend, np.asarray(x, np.float32)) for x in params]
    fn = lambda g, p: ns.adaptive_grad_clip(g, p, 0.01, **kw)
    if mode == "compiled" and backend == "jax":
        fn = pytest.importorskip("jax").jit(fn)
    elif mode == "compiled" and backend == "tensorflow":
        fn = pytest.importorskip("tensorflow").function(fn)
    elif mode == "compiled":
        pytest.skip("eager only")
    return [np.asarray(x) for x in fn(g, p)]


# (gradient, parameter, expected): clip_factor 0.01, eps 1e-3
CASES = [
    ([1e20, 1e20], [1.0, 1.0], [1e20, 1e20]),  # squares overflow: inf, unchanged (not [0, 0])
    ([1e19, 1e19], [1e20, 1e20], [1e19, 1e19]),
    ([INF, 1.0], [1.0, 1.0], [INF, 1.0]),  # non-finite: unchanged, never [nan, 0]
    ([NAN, 1.0], [1.0, 1.0], [NAN, 1.0]),
    ([-INF, INF], [1.0, 1.0], [-INF, INF]),
    ([1.0, 1.0], [NAN, 1.0], [1.0, 1.0]),  # a non-finite parameter norm: no limit, unchanged
    ([1.0, 1.0], [INF, 1.0], [1.0, 1.0]),
    ([3.0, 4.0], [1e20, 0.0], [3.0, 4.0]),  # |W| overflows: unchanged (the limit is not finite)
    ([3.0, 4.0], [1e18, 0.0], [3.0, 4.0]),  # finite and under the limit 1e16
    ([3e18, 4e18], [1.0, 0.0], [0.006, 0.008]),  # finite squares (2.5e37): clipped to 0.01
]


@pytest.mark.parametrize("impl", ["native", "generic"], indirect=True)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_overflowing_and_non_finite_units(impl, backend, mode):
    for grad, param, want in CASES:
        (got,) = _agc(backend, mode, [grad], [param])
        np.testing.assert_allclose(got, want, rtol=4 * EPS32, atol=0, err_msg=f"{grad}, {param}")


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_overflowing_unit_is_left_unclipped(backend, mode):
    """Units are columns ("io"): column 0 overflows and is kept, column 1 is clipped with
    optax's float32 values, the 1-D leaf beside them too."""
    g = np.array([[1e20, 1.0], [1e20, 2.0]], np.float32)
    bias = np.array([5.0, 0.001], np.float32)
    got, got_bias = _agc(backend, mode, [g, bias], [np.ones((2, 2)), np.ones(2)])
    limit = np.float32(0.01) * np.float32(np.sqrt(2.0))
    np.testing.assert_array_equal(got[:, 0], g[:, 0])
    col = g[:, 1] * (limit / np.sqrt(np.sum(g[:, 1] * g[:, 1])))  # optax's float32 values
    np.testing.assert_allclose(got[:, 1], col, rtol=2 * EPS32, atol=0)
    want_bias = bias * (limit / np.sqrt(np.sum(bias * bias)))
    np.testing.assert_allclose(got_bias, want_bias, rtol=2 * EPS32, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_overflow_is_left_unchanged(backend):
    if backend == "jax":
        pytest.skip("JAX without jax_enable_x64 has no float64 arrays")
    g = as_backend(backend, np.array([1e200, -1e200]))
    p = as_backend(backend, np.ones(2))
    (got,) = ns.adaptive_grad_clip([g], [p], 0.01)
    np.testing.assert_array_equal(np.asarray(got), [1e200, -1e200])
