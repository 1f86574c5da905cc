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
from numstab.tree import flatten, flatten_with_paths, leaves_with_paths, unflatten


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


BACKENDS = ["numpy", "torch", "jax", "tensorflow"]


def _backend(name):
    if name != "numpy":
        pytest.importorskip(name)
    return load_backend(name)


@pytest.mark.parametrize("name", BACKENDS)
def test_clip_below_max_norm_is_exact_for_awkward_max_norms(name):
    """The factor 1 is chosen, not computed: torch's ``scalar / tensor`` is ``reciprocal *
    scalar``, one ulp below 1 at ``max_norm / max_norm`` for these float32 ``max_norm``."""
    be = _backend(name)
    awkward = [54.36295700073242, 48.584049224853516, 35.7801628112793, 59.4304084777832]
    leaves = [be.asarray(np.array([0.5, -0.25, 3.0], np.float32)), be.asarray(np.zeros(2))]
    for max_norm in awkward:
        for norm in (0.0, 1.0, max_norm, np.inf, -np.inf, np.nan):
            got = be.to_numpy(ns.clipping.clip_coefficient(be.asarray(norm, "float32"), max_norm))
            assert got == 1.0, (max_norm, norm)
        clipped, _ = ns.clip_by_global_norm(leaves, max_norm)
        for got, seen in zip(clipped, leaves, strict=True):
            np.testing.assert_array_equal(be.to_numpy(got), be.to_numpy(seen))
    ratio = ns.clipping.clip_coefficient(be.asarray(4.0, "float32"), 1.0)
    assert be.to_numpy(ratio) == np.float32(0.25)
    if name == "jax" and not pytest.importorskip("jax").config.jax_enable_x64:
        return  # no float64 arrays
    # float64: TensorFlow used to round a Python max_norm to float32 first (0.1 -> 0.1000000015)
    leaves64 = [be.asarray(np.array([0.01, -0.02]), "float64")]
    for max_norm in [0.1, 0.3, *awkward]:
        norm = be.asarray(np.float64(max_norm), "float64")
        assert be.to_numpy(ns.clipping.clip_coefficient(norm, max_norm)) == 1.0, max_norm
        clipped, _ = ns.clip_by_global_norm(leaves64, max_norm)
        np.testing.assert_array_equal(be.to_numpy(clipped[0]), be.to_numpy(leaves64[0]))


@pytest.mark.parametrize("name", BACKENDS)
def test_dtype_checks_name_the_first_bad_leaf_and_empty_leaves_do_not_widen(name):
    be = _backend(name)
    f32 = be.asarray(np.ones(2, np.float32))
    i32 = be.asarray(np.ones(2, np.int32))
    with pytest.raises(ns.InvalidArgumentError, match=r"leaf 3 with dtype=int32"):
        ns.global_norm([f32, None, f32, f32, i32, f32, i32])
    with pytest.raises(ns.InvalidArgumentError, match=r"leaf 0 with dtype=int32"):
        ns.clip_by_global_norm({"a": i32, "b": [f32]}, 1.0)
    if name == "jax" and not pytest.importorskip("jax").config.jax_enable_x64:
        return  # no float64 arrays
    empty64 = be.asarray(np.zeros((0, 3)), "float64")
    assert be.dtype_name(ns.global_norm([f32, empty64, f32])) == "float32"
    assert be.dtype_name(ns.global_norm([f32, be.asarray(np.ones(1), "float64")])) == "float64"
    assert be.dtype_name(ns.global_norm([empty64, None])) == "float32"


@pytest.mark.parametrize("name", BACKENDS)
def test_nonempty_keeps_order_and_drops_only_empty_leaves(name):
    be = _backend(name)
    shapes = [(2,), (0,), (), (3, 0), (1, 1), (0,)]
    arrays = [be.asarray(np.ones(s, np.float32)) for s in shapes]
    for kept in (be.nonempty(arrays), Backend.nonempty(be, arrays)):
        assert [tuple(be.shape(x)) for x in kept] == [(2,), (), (1, 1)]
        assert all(k is a for k, a in zip(kept, [arrays[0], arrays[2], arrays[4]], strict=True))
    full = [arrays[0], arrays[2]]
    assert be.nonempty(full) == full and be.nonempty(full) is not full


def test_flat_unflatten_fast_path_keeps_types_and_checks_lengths():
    a = np.ones(2, np.float32)
    for tree in ([a, a, None], (a, None, a)):
        leaves, treedef = flatten(tree)
        rebuilt = unflatten(treedef, leaves)
        assert type(rebuilt) is type(tree) and rebuilt is not leaves
        assert list(rebuilt) == list(tree)
        with pytest.raises(ValueError, match="more leaves"):
            unflatten(treedef, [a, a, a, a])
        with pytest.raises((StopIteration, RuntimeError)):
            unflatten(treedef, [a])
    nested = [[a, a], (a,)]
    leaves, treedef = flatten(nested)
    rebuilt = unflatten(treedef, [np.full(2, i, np.float32) for i in range(3)])
    assert type(rebuilt[0]) is list and type(rebuilt[1]) is tuple and rebuilt[1][0][0] == 2.0


def test_torch_scale_and_norms_take_the_generic_path_for_mixed_dtypes():
    torch = pytest.importorskip("torch")
    be = load_backend("torch")
    leaves = [torch.tensor([1.5, -2.0]), torch.tensor([3.0], dtype=torch.float16)]
    factor = torch.tensor(0.1)
    got = be.native_scale_leaves(leaves, factor)
    want = Backend.scale_leaves(be, leaves, factor)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    same = be.native_scale_leaves(leaves[:1], factor)
    assert torch.equal(same[0], leaves[0] * factor)
    for ord in (2.0, 1.0, float("inf")):
        np.testing.assert_allclose(
            be.native_leaf_norms(leaves, ord, "float32").numpy(),
            Backend.leaf_norms(be, leaves, ord, "float32").numpy(),
            rtol=1e-6,
        )


def test_torch_on_device_checks_every_tensor():
    torch = pytest.importorskip("torch")
    from numstab.frameworks.torch.backend import _on_device

    cpu, meta = torch.device("cpu"), torch.device("meta")
    a, b = torch.ones(2), torch.ones(2, device="meta")
    assert _on_device([a, a], cpu) and _on_device([], cpu) and _on_device([b, b], meta)
    assert not _on_device([a, b], cpu) and not _on_device([b, a], meta)
    assert not _on_device([a, a], meta) and not _on_device([b], cpu)


def test_flatten_with_paths_agrees_with_flatten_and_leaves_with_paths():
    pair = namedtuple("pair", "a b")
    trees = [
        {"a": [np.ones(2), None], "b": pair(np.ones(1), {"c": (np.zeros(3),)})},
        [np.ones(1), np.ones(2)],
        np.ones(3),
        {"x": [1.0, [np.ones(1)]]},
    ]
    for tree in trees:
        named, treedef = flatten_with_paths(tree)
        leaves, _ = flatten(tree)
        assert [p for p, _ in named] == [p for p, _ in leaves_with_paths(tree)]
        assert all(a is b for (_, a), b in zip(named, leaves, strict=True))
        rebuilt = unflatten(treedef, [leaf for _, leaf in named])
        assert [p for p, _ in leaves_with_paths(rebuilt)] == [p for p, _ in named]
