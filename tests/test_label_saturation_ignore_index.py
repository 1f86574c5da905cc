"""On JAX (int32 ids) a wider label saturates to int32's bounds so that it stays out of
range (§3). A bound that is itself ``ignore_index`` made the corrupt id an ignored row, a
silent 0 where NumPy and torch raise: the saturation now stops one step inside that bound."""

import numpy as np
import pytest

import numstab as ns
from numstab.errors import InvalidArgumentError
from tests.backend_arrays import as_backend

LOGITS = np.array([[3.0, 4.0], [1.0, 2.0]], np.float32)
CASES = [
    (np.array([2**40, 0], np.int64), 2**31 - 1),
    (np.array([2**32 - 1, 0], np.uint32), 2**31 - 1),
    (np.array([-(2**40), 0], np.int64), -(2**31)),
]


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("labels, ignore_index", CASES)
def test_a_corrupt_id_is_out_of_range_even_at_ignore_index(backend, labels, ignore_index):
    with pytest.raises(InvalidArgumentError, match="labels"):
        ns.cross_entropy(as_backend(backend, LOGITS), labels, ignore_index=ignore_index)


@pytest.mark.parametrize("ignore_index", [2**31 - 1, -(2**31)])
def test_a_real_ignore_index_at_a_bound_still_ignores(ignore_index):
    jnp = pytest.importorskip("jax.numpy")
    labels = np.array([ignore_index, 1], np.int64)
    got = ns.cross_entropy(jnp.asarray(LOGITS), labels, ignore_index=ignore_index)
    want = ns.cross_entropy(LOGITS[1:], np.array([1]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2 * np.finfo(np.float32).eps)


@pytest.mark.parametrize("labels, ignore_index", CASES)
def test_fused_loss_refuses_the_corrupt_id_on_jax(labels, ignore_index):
    jnp = pytest.importorskip("jax.numpy")
    hidden, weight = jnp.eye(2, dtype=jnp.float32), jnp.asarray(LOGITS)
    with pytest.raises(InvalidArgumentError, match="labels"):
        ns.fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index)
