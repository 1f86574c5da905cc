"""The per-call fast paths of the tree functions and backends give what the generic paths give.

Covered: numstab.tree's flat-list fast path, the per-type backend detection and the dtype check
of clipping's leaf collection, TensorFlow's cached reduction axes and skipped no-op reshape, and
the per-leaf finiteness flags (``Backend.leaf_finite``) of every backend.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest

import numstab as ns
from numstab.backends import load_backend
from numstab.backends._base import Backend
from numstab.tree import flatten, unflatten


def test_flat_lists_and_tuples_round_trip_with_none_leaves():
    a, b = np.ones(2, np.float32), np.zeros(3, np.float32)
    for tree in ([a, None, b], (a, None, b), [], ()):
        leaves, treedef = flatten(tree)
        assert leaves == list(tree) and len(treedef.children) == len(tree)
        rebuilt = unflatten(treedef, leaves)
        assert type(rebuilt) is type(tree) and list(rebuilt) == list(tree)


def test_lists_of_containers_and_namedtuples_keep_the_generic_structure():
    a = np.ones(2, np.float32)
    pair = namedtuple("pair", "x y")(a, a)
    leaves, treedef = flatten([pair, {"w": a}, [a, 1.0]])
    assert len(leaves) == 5
    rebuilt = unflatten(treedef, [np.full(2, i, np.float32) for i in range(4)] + [2.0])
    assert type(rebuilt[0]).__name__ == "pair" and rebuilt[0].y[0] == 1.0
    assert list(rebuilt[1]) == ["w"] and rebuilt[2][1] == 2.0
    with pytest.raises(ValueError, match="more leaves"):
        unflatten(flatten([a, a])[1], [a, a, a])


def test_non_floating_leaf_is_named_by_its_index():
    f, i = np.ones(2, np.float32), np.ones(2, np.int32)
    with pytest.raises(ns.InvalidArgumentError, match=r"leaf 2 with dtype=int32"):
        ns.global_norm([f, f, i, f])
    with pytest.raises(ns.InvalidArgumentError, match=r"leaf 1 with dtype=int32"):
        ns.all_finite([f, None, i])  # None leaves are not counted


def test_mixed_frameworks_in_one_tree_still_raise():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    tree = [torch.ones(2), torch.ones(3), jnp.ones(2), torch.ones(1)]
    with pytest.raises(ns.MixedBackendsError, match="torch and jax"):
        ns.global_norm(tree)


@pytest.mark.parametrize("name", ["numpy", "torch", "jax", "tensorflow"])
def test_leaf_finite_flags_each_leaf(name):
    if name != "numpy":
        pytest.importorskip(name)
    be = load_backend(name)
    host = [
        np.array([1.0, np.nan], np.float32),
        np.ones((2, 3), np.float32),
        np.array([[np.inf]], np.float64),
        np.array(3.0, np.float32),
        np.array([-np.inf, 2.0], np.float16),
        np.array([6e4, 6e4], np.float16),  # large finite values stay finite
    ]
    leaves = [be.asarray(x) for x in host]
    want = [False, True, False, True, False, True]
    for flags in (be.leaf_finite(leaves), Backend.leaf_finite(be, leaves)):
        assert be.to_numpy(flags).tolist() == want
    assert not bool(be.to_numpy(be.all_finite(leaves)))
    assert bool(be.to_numpy(be.all_finite([leaves[1], leaves[3]])))


def test_tensorflow_full_reductions_match_tf_reduce():
    tf = pytest.importorskip("tensorflow")
    be = load_backend("tensorflow")
    rng = np.random.default_rng(0)
    for shape in [(), (5,), (3, 4), (2, 3, 4)]:
        x = tf.constant(rng.standard_normal(shape).astype(np.float32))
        np.testing.assert_array_equal(be.sum(x).numpy(), tf.reduce_sum(x).numpy())
        np.testing.assert_array_equal(be.max(x).numpy(), tf.reduce_max(x).numpy())
        assert be.all(x > 0).numpy() == tf.reduce_all(x > 0).numpy()
        assert be.sum(x).shape == () and be.max(x).shape == ()
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        total = be.sum(x * x) + be.max(x)
    np.testing.assert_array_equal(tape.gradient(total, x).numpy(), [[2.0, 4.0], [6.0, 9.0]])

    @tf.function
    def traced(v):
        return be.sum(v), be.all(v > 0)

    total, positive = traced(x)
    assert total.numpy() == 10.0 and positive.numpy()


def test_tensorflow_reshape_skips_only_true_no_ops():
    tf = pytest.importorskip("tensorflow")
    be = load_backend("tensorflow")
    x = tf.reshape(tf.range(24.0), (4, 6))
    for shape in [(4, 6), (-1, 6), (4, -1), [4, 6]]:
        assert be.reshape(x, shape) is x
    for shape in [(6, 4), (24,), (-1,), (2, 12), (2, 3, 4)]:
        out = be.reshape(x, shape)
        assert out is not x and tuple(out.shape) == tuple(np.empty((4, 6)).reshape(shape).shape)
    with pytest.raises(tf.errors.InvalidArgumentError):
        be.reshape(x, (-1, -1))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        be.reshape(x, (5, 5))
