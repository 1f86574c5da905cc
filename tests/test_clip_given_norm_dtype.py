"""clip_by_global_norm(tree, max_norm, norm=<host number>): the norm takes the tree's
accumulation dtype (§7.2) on every backend, so the result equals the tree's own norm's."""

import numpy as np
import pytest

import numstab as ns

BACKENDS = {"numpy": np.asarray}
torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")
jnp = pytest.importorskip("jax.numpy")
BACKENDS.update(torch=torch.tensor, tf=tf.constant, jax=jnp.asarray)


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_host_norm_matches_own_norm(name, dtype):
    mk = BACKENDS[name]
    rng = np.random.default_rng(3)
    tree = [mk(rng.standard_normal(5).astype(dtype)), mk(rng.standard_normal(3).astype(dtype))]
    own, own_norm = ns.clip_by_global_norm(tree, 0.5)
    out, norm = ns.clip_by_global_norm(tree, 0.5, norm=float(np.asarray(own_norm)))
    assert np.asarray(norm).dtype == np.asarray(own_norm).dtype
    for a, b in zip(out, own, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_float64_leaf_factor_not_rounded_to_float32(name):
    g = np.array([0.1234567890123, -0.2], np.float64)
    out, norm = ns.clip_by_global_norm([BACKENDS[name](g)], 1.0, norm=1e6)
    expected = np.asarray(ns.clip_by_global_norm([g], 1.0, norm=np.float64(1e6))[0][0])
    assert np.asarray(norm).dtype == np.asarray(out[0]).dtype
    np.testing.assert_array_equal(np.asarray(out[0]), expected.astype(np.asarray(out[0]).dtype))
