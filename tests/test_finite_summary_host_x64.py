"""``finite_summary`` reads a host leaf on the host in its own dtype (§1.3, §14.8): with
``jax_enable_x64`` a float64 (or complex128) host leaf gives a float64 sum, eagerly as under
``jax.jit`` (before: float32, 1e300 clamped to 3.4e38 eagerly, 1e300 under jit); without x64
the sum is float32, a finite one clamped to float32's range (JAX has no float64)."""

import numpy as np
import pytest

from numstab.numerics import finite_summary

jax = pytest.importorskip("jax")
jnp = jax.numpy

F32_MAX = float(np.finfo(np.float32).max)


def _eager_and_jit(tree):
    eager = finite_summary(tree).sums
    jitted = jax.jit(finite_summary)(tree).sums
    return np.asarray(eager), np.asarray(jitted)


@pytest.mark.parametrize(
    "host, expected",
    [
        (np.array([1e300]), 1e300),
        (np.array([5e299, 5e299]), 1e300),  # summed in float64: exact here
        (np.array([1e300 + 1e299j]), 1.1e300),  # real part plus imaginary part
        (1e300, 1e300),  # a Python float is float64 (§1.3)
        (np.array([-1e300, -np.inf]), -np.inf),
    ],
)
def test_float64_host_leaf_under_x64(host, expected):
    with jax.enable_x64(True):
        tree = [jnp.ones(2, jnp.float32), host]
        eager, jitted = _eager_and_jit(tree)
        device = np.asarray(finite_summary([jnp.ones(2, jnp.float32), jnp.asarray(host)]).sums)
    for sums in (eager, jitted, device):
        assert sums.dtype == np.float64
        assert sums[0] == 2.0
        # one or two float64 additions: within a couple of float64 ulps
        np.testing.assert_allclose(sums[1], expected, rtol=4 * np.finfo(np.float64).eps)
    np.testing.assert_array_equal(eager, jitted)


def test_float32_host_leaf_under_x64_stays_float32():
    with jax.enable_x64(True):
        eager, jitted = _eager_and_jit([jnp.ones(2, jnp.float32), np.array([3e38], np.float32)])
    assert eager.dtype == jitted.dtype == np.float32
    np.testing.assert_array_equal(eager, [2.0, np.float32(3e38)])


def test_float64_host_leaf_without_x64_is_float32_clamped():
    with jax.enable_x64(False):
        sums = np.asarray(finite_summary([jnp.ones(2, jnp.float32), np.array([1e300])]).sums)
        nan = np.asarray(finite_summary([jnp.ones(2), np.array([1e300, np.nan])]).sums)
    assert sums.dtype == np.float32
    assert sums[1] == np.float32(F32_MAX)  # finite, as the float64 leaf is
    assert np.isnan(nan[1])
