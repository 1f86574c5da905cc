"""Norms, finiteness and clipping over trees, on every backend against the float64 oracle."""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from collections.abc import Mapping

import numpy as np
import pytest

import numstab as ns
from conformance_tests import oracle
from conformance_tests.tolerances import GRADIENT, VALUE

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


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")  # JAX, no x64
@pytest.mark.parametrize(
    ("low", "high"), [(-1e5, 1e5), (-3.5e38, 1e308), (1e5, 1e5), (1e308, 1e308)]
)
def test_clip_by_value_bounds_past_the_dtype(target, low, high):
    """A bound past a leaf dtype's finite range (1e5 for float16 gradients) is that range's
    end: it clamps no finite value, and +-inf become the dtype's largest finite value, on
    every backend (torch and TensorFlow raised converting it; NumPy and JAX kept inf). A
    bound inside the range is rounded to the dtype, once (TensorFlow rounded it through
    float32 first), and bfloat16 leaves stay bfloat16 (NumPy's clip made them float32)."""
    import ml_dtypes

    h = target.h
    x = np.array([-5.0, -0.5, 0.25, 7.0, 3e4, np.inf, -np.inf, np.nan])
    dtypes = ["float16", "bfloat16", "float32", "float64"]
    tree = [h.asarray(x, dtype) for dtype in dtypes]
    got = h.call_leaves(lambda t: ns.clip_by_value(t, low, high), target.compiled, tree)
    be = ns.backends.load_backend(target.name)
    for leaf, x_in in zip(got, tree, strict=True):
        dtype = be.dtype_name(x_in)  # JAX without x64 makes float64 float32
        kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        largest = float(ml_dtypes.finfo(kind).max)
        lo, hi = (np.float64(min(max(b, -largest), largest)).astype(kind) for b in (low, high))
        want = np.clip(x.astype(kind).astype(np.float64), float(lo), float(hi))
        np.testing.assert_array_equal(np.asarray(leaf, np.float64), want, err_msg=dtype)
    if not target.compiled:
        kept = [be.dtype_name(x) for x in ns.clip_by_value(tree, low, high)]
        assert kept == [be.dtype_name(x) for x in tree]


CLEAN_F32 = np.array([0.5, -2.0])


def test_all_finite(target):
    h = target.h
    clean = _tree(h, LEAVES)
    [ok] = h.call_leaves(ns.all_finite, target.compiled, clean)
    assert ok
    dirty = dict(LEAVES)
    dirty["h"] = np.array([1.0, np.nan, 2.0])
    [ok] = h.call_leaves(ns.all_finite, target.compiled, _tree(h, dirty))
    assert not ok


@pytest.mark.parametrize("part", [complex(np.nan, 0.0), complex(0.0, -np.inf), complex(np.inf, 1)])
def test_all_finite_reads_complex_leaves(target, part):
    # both parts are read (before: an InvalidArgumentError, "Expected floating-point leaves")
    h = target.h
    clean = [h.asarray(np.array([1 - 2j, 3e38j]), "complex64"), h.asarray(CLEAN_F32, "float32")]
    [ok] = h.call_leaves(ns.all_finite, target.compiled, clean)
    assert ok
    dirty = [h.asarray(np.array([1 - 2j, part]), "complex64"), clean[1]]
    [ok] = h.call_leaves(ns.all_finite, target.compiled, dirty)
    assert not ok


# complex gradients (spectral layers hold complex weights): norms are of |z|, as torch's
# clip_grad_norm_ and optax's clip_by_global_norm take them; before, numstab refused them
Z = np.array([3 + 4j, 1 - 2j, 0j, -0.5j])
R = np.array([2.0, -1.0])


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_complex_leaves_norm_and_clip(target, norm_type):
    h = target.h
    tree = [h.asarray(Z, "complex64"), h.asarray(R, "float32")]
    magnitudes = np.concatenate([np.abs(Z), np.abs(R)])
    p = norm_type
    want = magnitudes.max() if p == math.inf else (magnitudes**p).sum() ** (1 / p)
    clip = lambda t: ns.clip_by_global_norm(t, 1.0, norm_type=p)
    z, r, norm = h.call_leaves(clip, target.compiled, tree)
    rtol, _ = VALUE["float32"]  # float32 accumulation, as for real leaves
    np.testing.assert_allclose(norm, want, rtol=rtol)
    np.testing.assert_allclose(z, Z.astype(np.complex64) / want, rtol=rtol, atol=0)
    np.testing.assert_allclose(r, R / want, rtol=rtol)
    (under,) = h.call_leaves(
        lambda t: ns.clip_by_global_norm(t, 100.0, norm_type=p)[0][0], target.compiled, tree
    )
    np.testing.assert_array_equal(under, Z.astype(np.complex64))  # unchanged below max_norm
    if not target.compiled:
        assert "complex64" in str(ns.clip_by_global_norm(tree, 1.0)[0][0].dtype)


def test_complex128_accumulates_in_float64(eager_target):
    h = eager_target.h
    if h.name == "jax":
        pytest.skip("JAX without jax_enable_x64 has no complex128 arrays")
    # accumulated in float64 (3e30 + 4e30j would overflow float32), and nothing is rescaled
    # (§7.2): |z|**2 = 2.5e401 overflows float64 too, as torch's sum of squares does
    norm = ns.global_norm([h.asarray(np.array([3e30 + 4e30j, 1.0]), "complex128")])
    np.testing.assert_allclose(h.numpy(norm), 5e30, rtol=1e-12)
    big = np.array([3e200 + 4e200j, 1.0])
    norm = ns.global_norm([h.asarray(big, "complex128")])
    assert h.numpy(norm).dtype == np.float64 and np.isinf(h.numpy(norm))
    small = np.array([3e-3 + 4e-3j, 1e-300])
    norm = ns.global_norm([h.asarray(small, "complex128")])
    np.testing.assert_allclose(h.numpy(norm), 5e-3, rtol=1e-12)


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


def test_defaultdict_keeps_its_factory(eager_target):
    # before, rebuilding it raised Python's TypeError: first argument must be callable or None
    h = eager_target.h
    grads = collections.defaultdict(list, {"a": h.asarray(np.array([3.0, 4.0]), "float32")})
    clipped, _ = ns.clip_by_global_norm(grads, 1.0)
    assert type(clipped) is collections.defaultdict and clipped.default_factory is list
    np.testing.assert_allclose(h.numpy(clipped["a"]), [0.6, 0.8], rtol=VALUE["float32"][0])
    (leaf,) = ns.clip_by_value(grads, -1.0, 1.0).values()
    np.testing.assert_array_equal(h.numpy(leaf), [1.0, 1.0])


def test_mappings_built_from_one_mapping():
    # ChainMap(pairs) gave a ChainMap over a zip object; MappingProxyType(pairs) raised
    x = np.array([3.0, 4.0])
    chain = collections.ChainMap({"a": x}, {"b": np.zeros(1), "a": np.ones(2)})
    clipped, _ = ns.clip_by_global_norm(chain, 1.0)  # the values it shows: a = x, b
    assert type(clipped) is collections.ChainMap and sorted(clipped) == ["a", "b"]
    np.testing.assert_allclose(clipped["a"], x / 5.0)
    proxy, _ = ns.clip_by_global_norm(types.MappingProxyType({"a": x}), 1.0)
    assert type(proxy) is types.MappingProxyType
    np.testing.assert_allclose(proxy["a"], x / 5.0)
    # Counter(pairs) counted the (key, array) pairs: TypeError, unhashable array
    counter, _ = ns.clip_by_global_norm(collections.Counter({"a": x}), 1.0)
    assert type(counter) is collections.Counter
    np.testing.assert_allclose(counter["a"], x / 5.0)


class _Config(Mapping):
    """A read-only mapping whose constructor takes no pairs."""

    def __init__(self, weight, frozen: bool) -> None:
        self._items, self.frozen = {"weight": weight}, frozen

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_mapping_that_cannot_be_rebuilt_raises_typed():
    grads = _Config(np.array([3.0, 4.0]), frozen=True)
    np.testing.assert_allclose(ns.global_norm(grads), 5.0)  # read without rebuilding
    with pytest.raises(ns.InvalidArgumentError, match=r"Cannot rebuild a _Config from"):
        ns.clip_by_global_norm(grads, 1.0)  # was Python's TypeError from _Config.__init__


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


EPS32 = float(np.finfo(np.float32).eps)
SMALLEST32 = 2.0**-149  # float32's smallest subnormal: the spacing of the factor near 0


def clipped_norm_bound(max_norm: float, size: int) -> float:
    """The most a clipped norm may reach: ``max_norm`` times float32's rounding of the norm
    (``size`` terms), of the factor and of the product (each under eps), plus the subnormal
    spacing where ``max_norm`` itself is below float32's range. 16-bit leaves round toward
    zero, so they add nothing of their own coarser rounding."""
    return max_norm * (1 + (size + 3) * EPS32) + SMALLEST32


@pytest.mark.parametrize("max_norm", [3.4028234e38, 3.5e38, 1e300, 1.7976931348623157e308])
def test_max_norm_beyond_the_dtype_clips_nothing(target, max_norm):
    """A max_norm past float32's largest value is clamped to it: zeros stay zeros (inf / inf
    was NaN on numpy, torch and jax; TensorFlow raised) and finite leaves stay unchanged."""
    h = target.h
    tree = [h.asarray(np.zeros(3), "float32"), *_tree(h, LEAVES)]
    *clipped, _ = h.call_leaves(
        lambda t: ns.clip_by_global_norm(t, max_norm), target.compiled, tree
    )
    for got, seen in zip(clipped, _seen(h, tree), strict=True):
        np.testing.assert_array_equal(got, seen)


@pytest.mark.parametrize("max_norm", [1e-3, 3e-6, 1e-7, 1e-9, 1e-30, 5e-324])
def test_tiny_max_norm_bounds_16bit_leaves(target, max_norm):
    """float16/bfloat16 leaves scaled far into (or below) their subnormal range: rounded to
    nearest, 0.6 of a float16 spacing became a whole one (the clipped norm 1.19x max_norm);
    rounded toward zero, the norm never exceeds max_norm by more than float32's rounding."""
    h = target.h
    rng = np.random.default_rng(11)
    tree = [h.asarray(rng.normal(0, 3, 40), "float16"), h.asarray(rng.normal(0, 1, 9), "bfloat16")]
    *clipped, _ = h.call_leaves(
        lambda t: ns.clip_by_global_norm(t, max_norm), target.compiled, tree
    )
    norm = np.sqrt(sum(np.sum(np.asarray(c, np.float64) ** 2) for c in clipped))
    assert norm <= clipped_norm_bound(max_norm, 49)
    assert all(np.isfinite(c).all() for c in clipped)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a finite overflow is not reported
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_toward_zero_is_round_toward_zero(target, dtype):
    """``Backend.cast_toward_zero`` against NumPy: round to nearest, then one spacing back where
    that moved away from zero; largest finite for finite overflow; NaN and inf kept. Compiled
    too: XLA on a GPU may keep 16-bit intermediates in float32 (excess precision)."""
    import ml_dtypes

    from numstab.backends import load_backend

    rng = np.random.default_rng(3)
    scales = (1e-9, 1e-7, 1e-6, 1e-3, 1.0, 1e3, 1e5)
    special = [np.nan, np.inf, -np.inf, 0.0, 65504.0, 65520.0, -7e4, 3.4e38]
    x = np.concatenate([rng.normal(0, s, 400) for s in scales] + [special]).astype(np.float32)
    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    with np.errstate(over="ignore"):
        nearest = x.astype(kind)
    back = nearest.view(np.int16) - np.int16(1)
    away = np.abs(nearest.astype(np.float32)) > np.abs(x)
    want = np.where(away, back.view(kind), nearest).astype(np.float64)
    be = load_backend(target.name)
    got = target.h.call(lambda v: be.cast_toward_zero(v, dtype), target.compiled,
                        target.h.asarray(x, "float32"))  # fmt: skip
    np.testing.assert_array_equal(got, want)


# -- TensorFlow ragged and sparse tensors: nodes whose one child is their stored values ---
def _tf_composites():
    """A ragged tensor, a sparse tensor and a dense one; the composites' stored values are
    (3, 0, 4) and (6, 8): norm sqrt(9 + 16 + 36 + 64 + 1) = sqrt(126)."""
    tf = pytest.importorskip("tensorflow")
    ragged = tf.ragged.constant([[3.0, 0.0], [], [4.0]])
    sparse = tf.sparse.SparseTensor([[0, 1], [2, 0]], [6.0, 8.0], [3, 3])
    return tf, {"r": ragged, "s": sparse, "d": tf.constant([1.0])}


def _same_layout(tf, got, like):
    """``got`` is a ragged / sparse tensor with ``like``'s row partition / indices."""
    assert type(got) is type(like)
    if isinstance(like, tf.RaggedTensor):
        np.testing.assert_array_equal(got.row_splits.numpy(), like.row_splits.numpy())
        return got.flat_values.numpy()
    np.testing.assert_array_equal(got.indices.numpy(), like.indices.numpy())
    np.testing.assert_array_equal(got.dense_shape.numpy(), like.dense_shape.numpy())
    return got.values.numpy()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_tensorflow_ragged_and_sparse_leaves_norm_and_clip(compiled):
    """Before, a ``tf.RaggedTensor`` or ``tf.SparseTensor`` leaf was read as a host array:
    ``AttributeError: 'DType' object has no attribute 'kind'`` from every tree function."""
    tf, tree = _tf_composites()

    def fn(t):
        clipped, norm = ns.clip_by_global_norm(t, 1.0)
        return clipped, norm, ns.global_norm(t), ns.all_finite(t), ns.clip_by_value(t, 0, 5)

    clipped, norm, norm2, finite, bounded = (tf.function(fn) if compiled else fn)(tree)
    want = math.sqrt(126.0)
    np.testing.assert_allclose([norm.numpy(), norm2.numpy()], want, rtol=1e-6)
    assert bool(finite)
    values = {"r": [3.0, 0.0, 4.0], "s": [6.0, 8.0]}
    for key, stored in values.items():
        got = _same_layout(tf, clipped[key], tree[key])
        np.testing.assert_allclose(got, np.array(stored) / want, rtol=1e-6)
        got = _same_layout(tf, bounded[key], tree[key])
        np.testing.assert_array_equal(got, np.minimum(stored, 5.0))
    nan_tree = {**tree, "r": tree["r"].with_flat_values(tf.constant([3.0, np.nan, 4.0]))}
    assert not bool((tf.function(ns.all_finite) if compiled else ns.all_finite)(nan_tree))
    sparse_inf = tf.sparse.SparseTensor([[1, 1]], [np.inf], [2, 2])
    assert not bool((tf.function(ns.all_finite) if compiled else ns.all_finite)([sparse_inf]))


def test_tensorflow_ragged_and_sparse_find_nonfinite_and_assert_finite():
    """Records under the node's own path (as for ``tf.IndexedSlices``), counted over the
    stored values; a sparse tensor's implicit zeros are finite."""
    tf, tree = _tf_composites()
    assert ns.find_nonfinite(tree) == []
    ns.assert_finite(tree)
    tree["r"] = tf.ragged.constant([[1.0, np.nan], [2.0], [np.inf, -np.inf]])
    tree["s"] = tf.sparse.SparseTensor([[0, 1], [2, 0]], [np.nan, 8.0], [3, 3])
    records = ns.find_nonfinite(tree)
    assert [r.path for r in records] == ["['r']", "['s']"]
    r, s = records
    assert (r.nan_count, r.posinf_count, r.neginf_count, r.shape) == (1, 1, 1, (5,))
    assert (s.nan_count, s.inf_count, s.finite_min, s.finite_max) == (1, 0, 8.0, 8.0)
    with pytest.raises(ns.NonFiniteError) as info:
        ns.assert_finite({"g": [tree["s"]]})
    assert info.value.paths == ("['g'][0]",)


def test_tensorflow_sparse_as_dense_keeps_a_sparse_tensor_sparse():
    """``flatten(sparse_as_dense=True)`` (AGC) gives a sparse tensor's dense array, rebuilt
    as a sparse tensor from its values at the same indices; a ragged tensor keeps its stored
    values (padding is not data)."""
    from numstab.tree import flatten, unflatten

    tf, tree = _tf_composites()
    leaves, treedef = flatten(tree, sparse_as_dense=True)
    assert [tuple(x.shape) for x in leaves] == [(3,), (3, 3), (1,)]
    back = unflatten(treedef, [x * 2 for x in leaves])
    np.testing.assert_array_equal(_same_layout(tf, back["s"], tree["s"]), [12.0, 16.0])
    np.testing.assert_array_equal(_same_layout(tf, back["r"], tree["r"]), [6.0, 0.0, 8.0])
