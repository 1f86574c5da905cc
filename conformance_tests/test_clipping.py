"""Norms, finiteness and clipping over trees, on every backend against the float64 oracle."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

import numstab as ns
from conformance_tests import oracle
from conformance_tests.tolerances import GRADIENT

RNG = np.random.default_rng(5)
LEAVES = {"w": RNG.normal(0, 1, (5, 4)), "b": RNG.normal(0, 3, (4,)), "h": RNG.normal(0, 2, (3,))}
DTYPES = {"w": "float32", "b": "float16", "h": "bfloat16"}


def _tree(h, values):
    """A list (not a dict: jax.jit returns dicts with sorted keys) in the order of LEAVES."""
    return [h.asarray(values[k], DTYPES[k]) for k in LEAVES]


def _seen(h, tree):
    return [h.numpy(leaf) for leaf in tree]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
# 54.36...: a float32 max_norm whose max_norm / max_norm torch computed one ulp below 1, as
# reciprocal(max_norm) * max_norm: the "unchanged" leaves changed
@pytest.mark.parametrize("max_norm", [0.5, 54.36295700073242, 1e6])
def test_clip_by_global_norm(target, norm_type, max_norm):
    h = target.h
    tree = _tree(h, LEAVES)
    fn = lambda t: ns.clip_by_global_norm(t, max_norm, norm_type=norm_type)
    *clipped, norm = h.call_leaves(fn, target.compiled, tree)
    want, want_norm = oracle.clip_by_global_norm(_seen(h, tree), max_norm, norm_type)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    for got, expected, dtype in zip(clipped, want, DTYPES.values(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=GRADIENT[dtype][0], atol=1e-6)
    if max_norm > want_norm:  # exactly unchanged: no epsilon
        for got, seen in zip(clipped, _seen(h, tree), strict=True):
            np.testing.assert_array_equal(got, seen)


def test_fp16_norm_does_not_overflow(target):
    """300 and 400 in float16: the squares overflow float16; the norm is still 500."""
    h = target.h
    tree = [h.asarray(np.array([300.0, 400.0]), "float16"), h.asarray(np.full(4, 6e4), "float16")]
    fn = lambda t: (ns.global_norm(t), ns.clip_by_global_norm(t, 1.0))
    norm, *_, clipped_norm = h.call_leaves(fn, target.compiled, tree)
    want = np.sqrt(300.0**2 + 400.0**2 + 4 * h.numpy(tree[1])[0] ** 2)
    np.testing.assert_allclose(norm, want, rtol=1e-6)
    np.testing.assert_allclose(clipped_norm, want, rtol=1e-6)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_norm_leaves_gradients_untouched(target, bad):
    h = target.h
    values = dict(LEAVES)
    values["b"] = values["b"].copy()
    values["b"][2] = bad
    tree = _tree(h, values)
    fn = lambda t: (ns.clip_by_global_norm(t, 1.0), ns.all_finite(t))
    *clipped, norm, finite = h.call_leaves(fn, target.compiled, tree)
    assert not np.isfinite(norm) and not finite
    assert np.isnan(norm) == np.isnan(bad)
    for got, seen in zip(clipped, _seen(h, tree), strict=True):
        np.testing.assert_array_equal(got, seen)  # no half-NaN, half-zero tree


def test_zero_gradients_stay_zero(target):
    h = target.h
    tree = {"a": h.asarray(np.zeros((3, 2)), "float32"), "b": h.asarray(np.zeros(0), "float32")}
    clipped_a, clipped_b, norm = h.call_leaves(
        lambda t: ns.clip_by_global_norm(t, 1e-3), target.compiled, tree
    )
    assert norm == 0.0 and np.all(clipped_a == 0.0) and clipped_b.shape == (0,)


def test_clip_by_value(target):
    h = target.h
    x = np.array([-5.0, -0.5, 0.25, 7.0, np.inf, -np.inf, np.nan])
    tree = [h.asarray(x, "float32"), h.asarray(x, "float16")]
    for got in h.call_leaves(lambda t: ns.clip_by_value(t, -1.0, 2.0), target.compiled, tree):
        np.testing.assert_array_equal(got, [-1.0, -0.5, 0.25, 2.0, 2.0, -1.0, np.nan])


def test_all_finite(target):
    h = target.h
    clean = _tree(h, LEAVES)
    [ok] = h.call_leaves(ns.all_finite, target.compiled, clean)
    assert ok
    dirty = dict(LEAVES)
    dirty["h"] = np.array([1.0, np.nan, 2.0])
    [ok] = h.call_leaves(ns.all_finite, target.compiled, _tree(h, dirty))
    assert not ok


Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Params:
    weight: object
    extras: list


def test_tree_containers_and_none_leaves(eager_target):
    h = eager_target.h
    a, b, c = (h.asarray(np.full(2, v), "float32") for v in (3.0, 4.0, 12.0))
    tree = {"pair": Pair(a, None), "params": Params(weight=b, extras=[c, None]), "t": (a,)}
    clipped, norm = ns.clip_by_global_norm(tree, 1.0)
    assert isinstance(clipped["pair"], Pair) and clipped["pair"].second is None
    assert isinstance(clipped["params"], Params) and clipped["params"].extras[1] is None
    assert isinstance(clipped["t"], tuple)
    want = np.sqrt(2 * (9 + 16 + 144 + 9))
    np.testing.assert_allclose(h.numpy(norm), want, rtol=1e-6)
    np.testing.assert_allclose(h.numpy(clipped["params"].weight), 4.0 / want, rtol=1e-6)


def test_bad_clipping_arguments(eager_target):
    h = eager_target.h
    tree = [h.asarray(np.ones(3), "float32")]
    with pytest.raises(ns.InvalidArgumentError, match=r"Expected max_norm in \(0, inf\)"):
        ns.clip_by_global_norm(tree, 0.0)
    with pytest.raises(ns.InvalidArgumentError, match="norm_type"):
        ns.global_norm(tree, norm_type=-1)
    with pytest.raises(ns.InvalidArgumentError, match="min_value <= max_value"):
        ns.clip_by_value(tree, 1.0, -1.0)
    with pytest.raises(ns.InvalidArgumentError, match="dtype=int32"):
        ns.global_norm([h.asarray(np.ones(2, np.int32))])


def test_all_finite_float64_and_huge_finite_values(eager_target):
    h = eager_target.h
    big = [h.asarray(np.array([3e38]), "float32"), h.asarray(np.array([3e38]), "float32")]
    assert bool(h.numpy(ns.all_finite(big)))  # maxima are not summed into an overflow
    if h.name != "jax":  # JAX without x64 has no float64 arrays
        assert bool(h.numpy(ns.all_finite([h.asarray(np.ones(2), "float64")])))


def test_host_leaves_adopt_the_tree_backend(eager_target):
    h = eager_target.h
    tree = [np.array([3.0], np.float32), h.asarray(np.array([4.0]), "float32")]
    np.testing.assert_allclose(h.numpy(ns.global_norm(tree)), 5.0, rtol=1e-6)
    clipped, _ = ns.clip_by_global_norm(tree[1:], 1.0, norm=10.0)
    np.testing.assert_allclose(h.numpy(clipped[0]), [0.4], rtol=1e-6)
