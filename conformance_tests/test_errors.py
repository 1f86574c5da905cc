"""Bad input gets the same typed, named error on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns
from conformance_tests.conftest import requested_backends
from numstab.backends import load_backend


def _args(target):
    h = target.h
    return h.asarray(np.zeros((8, 10)), "float32"), h.asarray(np.zeros(8, np.int64))


BAD_CALLS = [
    (
        "labels_shape",
        lambda x, y, h: ns.cross_entropy(x, h.asarray(np.zeros((8, 3), np.int64))),
        r"Expected labels of shape \(8,\) for logits of shape \(8, 10\)\. "
        r"Received: labels.shape=\(8, 3\)",
    ),
    (
        "probability_shape",
        lambda x, y, h: ns.cross_entropy(x, h.asarray(np.zeros(8), "float32")),
        r"Expected probability labels of shape \(8, 10\).*Received: labels.shape=\(8,\)",
    ),
    (
        "bool_labels",
        lambda x, y, h: ns.cross_entropy(x, h.asarray(np.zeros(8, bool))),
        r"Received: labels.dtype=bool",
    ),
    (
        "integer_logits",
        lambda x, y, h: ns.cross_entropy(h.asarray(np.zeros((8, 10), np.int32)), y),
        r"Expected logits of a floating dtype.*Received: logits.dtype=int32",
    ),
    (
        "reduction",
        lambda x, y, h: ns.cross_entropy(x, y, reduction="avg"),
        r"Expected reduction to be one of 'mean', 'sum', 'none'. Received: reduction='avg'",
    ),
    (
        "smoothing_range",
        lambda x, y, h: ns.cross_entropy(x, y, label_smoothing=1.5),
        r"Expected label_smoothing in \[0, 1\]. Received: label_smoothing=1.5",
    ),
    (
        "smoothing_nan",
        lambda x, y, h: ns.cross_entropy(x, y, label_smoothing=float("nan")),
        r"label_smoothing=nan",
    ),
    (
        "negative_z_loss",
        lambda x, y, h: ns.cross_entropy(x, y, z_loss=-1e-4),
        r"Expected z_loss in \[0, inf\)",
    ),
    (
        "ignore_index_type",
        lambda x, y, h: ns.cross_entropy(x, y, ignore_index=1.5),
        r"Expected ignore_index to be an int",
    ),
    (
        "weight_shape",
        lambda x, y, h: ns.cross_entropy(x, y, weight=h.asarray(np.ones(3), "float32")),
        r"Expected weight of shape \(10,\), one per class. Received: weight.shape=\(3,\)",
    ),
    (
        "axis",
        lambda x, y, h: ns.cross_entropy(x, y, axis=2),
        r"Expected axis in \[-2, 2\) for an array of rank 2. Received: axis=2",
    ),
    (
        "no_classes",
        lambda x, y, h: ns.cross_entropy(h.asarray(np.zeros((8, 0)), "float32"), y),
        r"Expected at least one class",
    ),
    (
        "scalar_logits",
        lambda x, y, h: ns.logsumexp(h.asarray(np.float32(1.0), "float32")),
        r"Expected x of rank >= 1",
    ),
    (
        "smooth_alpha",
        lambda x, y, h: ns.smooth_labels(y, -0.1, num_classes=10),
        r"Expected alpha in \[0, 1\]. Received: alpha=-0.1",
    ),
    (
        "smooth_num_classes",
        lambda x, y, h: ns.smooth_labels(y, 0.1),
        r"Expected num_classes for integer class ids",
    ),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=lambda c: c[0])
def test_bad_input_raises_invalid_argument(eager_target, case):
    target = eager_target
    _, call, message = case
    x, y = _args(target)
    with pytest.raises(ns.InvalidArgumentError, match=message) as info:
        call(x, y, target.h)
    assert isinstance(info.value, ValueError)


def test_out_of_range_label_names_value_and_position(eager_target):
    h = eager_target.h
    logits = h.asarray(np.zeros((2, 3, 4)), "float32")
    labels = h.asarray(np.array([[0, 1, 2], [3, -7, -100]]))
    with pytest.raises(ns.InvalidArgumentError, match=r"Received: labels\[1, 1\]=-7 \(1 label"):
        ns.cross_entropy(logits, labels)


@pytest.mark.parametrize(
    ("label", "dtype"),
    [(2**32 + 1, "int64"), (2**32 - 100, "uint32"), (-(2**32) + 2, "int64")],
    ids=["int64_wraps_to_1", "uint32_wraps_to_ignore_index", "negative_wraps_to_2"],
)
@pytest.mark.parametrize("where", ["host", "framework"])
def test_a_label_beyond_the_index_dtype_is_out_of_range_not_wrapped(
    eager_target, label, dtype, where
):
    """JAX indexes with int32: a corrupt id the cast wrapped around became a valid class, or
    ignore_index (a silently ignored row); it now saturates, out of range as on the int64
    backends. (A framework int64 array exists on JAX under x64 only; uint32 does.)"""
    h = eager_target.h
    labels = np.array([0, label], dtype)
    if where == "framework":
        if eager_target.name == "jax" and dtype == "int64":
            pytest.skip("JAX without x64 holds no int64 array (it wraps when converting)")
        labels = h.asarray(labels)
    logits = h.asarray(np.zeros((2, 4)), "float32")
    for call in (
        lambda: ns.cross_entropy(logits, labels),
        lambda: ns.smooth_labels(labels, 0.1, num_classes=4, backend=eager_target.name),
        lambda: ns.fused_linear_cross_entropy(
            logits, h.asarray(np.ones((4, 4)), "float32"), labels
        ),
    ):
        with pytest.raises(ns.InvalidArgumentError, match=r"Received: labels\[1\]="):
            call()


# (labels, ignore_index, the bad label named or None): the eager check reads the min and max
# of the counted labels and whether any is ignored (on CPU torch, min and max first, which
# settle labels not spanning ignore_index). Every way must reach the same verdict and loss.
LABEL_SETS = [
    ([0, 3, 1, 2], -100, None),  # the bounds alone settle it
    ([0, 3, 1, 3], 3, None),  # ignore_index inside the bounds: rows 1 and 3 ignored
    ([0, 3, 1, 2], 1, None),  # ignore_index inside the bounds, one row ignored
    ([0, 2, 1, 2], 3, None),  # ignore_index between the bounds' max and K: nothing ignored
    ([-100, 3, 1, -100], -100, None),  # padding rows, the common LM case
    ([-100, -1, 1, 2], -100, "-1"),  # a negative label that is not ignore_index
    ([0, 4, 1, 2], -100, "4"),  # one past the last class
    ([0, 4, 1, 4], 4, None),  # ignore_index == K: allowed, and ignored
]


@pytest.mark.parametrize("labels, ignore_index, bad", LABEL_SETS)
def test_label_range_check_and_ignored_rows(eager_target, labels, ignore_index, bad):
    h = eager_target.h
    logits = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    y = np.array(labels)
    if bad is not None:
        with pytest.raises(ns.InvalidArgumentError, match=rf"=({bad}) \(1 label"):
            ns.cross_entropy(h.asarray(logits, "float32"), h.asarray(y), ignore_index=ignore_index)
        return
    counted = y != ignore_index
    lse = np.log(np.exp(logits).sum(-1))
    rows = np.where(counted, lse - logits[np.arange(4), np.where(counted, y, 0)], 0.0)
    expected = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / max(counted.sum(), 1)}
    x, t = h.asarray(logits, "float32"), h.asarray(y)
    for reduction, want in expected.items():
        got = ns.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction)
        np.testing.assert_allclose(h.numpy(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "int64"])
def test_any_integer_label_dtype_works(eager_target, dtype):
    h = eager_target.h
    logits = h.asarray(np.zeros((3, 4)), "float32")
    labels = h.asarray(np.array([0, 3, 1], dtype=dtype))
    out = h.numpy(ns.cross_entropy(logits, labels, label_smoothing=0.1))
    np.testing.assert_allclose(out, np.log(4.0), rtol=1e-6)
    smoothed = h.numpy(ns.smooth_labels(labels, 0.2, num_classes=4))
    np.testing.assert_allclose(smoothed.sum(-1), 1.0, rtol=1e-6)


def test_numpy_scalars_are_accepted_and_nonfinite_ones_rejected(eager_target):
    x, y = _args(eager_target)
    ns.cross_entropy(x, y, label_smoothing=np.float32(0.1), ignore_index=np.int64(-100))
    with pytest.raises(ns.InvalidArgumentError, match="z_loss=inf"):
        ns.cross_entropy(x, y, z_loss=float("inf"))
    with pytest.raises(ns.InvalidArgumentError, match="Expected num_classes to be an int"):
        ns.smooth_labels(y, 0.1, num_classes=2.5)
    bad = eager_target.h.asarray(np.array([0, 10]))
    with pytest.raises(ns.InvalidArgumentError, match=r"Received: labels\[1\]=10"):
        ns.smooth_labels(bad, 0.1, num_classes=10)


def test_empty_reduction_axis_is_rejected(eager_target):
    empty = eager_target.h.asarray(np.zeros((2, 0)), "float32")
    for fn in (ns.logsumexp, ns.log_softmax):
        with pytest.raises(ns.InvalidArgumentError, match="Expected at least one class"):
            fn(empty)


def test_jax_grad_without_jit_still_validates_labels():
    if "jax" not in requested_backends():
        pytest.skip("jax not requested")
    import jax
    import jax.numpy as jnp

    loss = lambda a: ns.cross_entropy(a, jnp.array([7, 1]))
    with pytest.raises(ns.InvalidArgumentError, match=r"labels\[0\]=7"):
        jax.value_and_grad(loss)(jnp.ones((2, 3)))


def test_tensorflow_unknown_class_count_is_a_clear_error():
    if "tensorflow" not in requested_backends():
        pytest.skip("tensorflow not requested")
    import tensorflow as tf

    load_backend("tensorflow")  # as any eager call would; AutoGraph then skips numstab
    spec = [tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None], tf.int64)]
    # autograph=False: AutoGraph wraps any error raised while tracing user code in
    # StagingError (the numstab message is kept inside); without it the type is ours.
    fn = tf.function(lambda x, y: ns.cross_entropy(x, y), input_signature=spec, autograph=False)
    with pytest.raises(ns.InvalidArgumentError, match="Expected a static number of classes"):
        fn(tf.zeros((2, 3)), tf.constant([0, 1], tf.int64))
    dynamic_batch = [tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int64)]
    fn = tf.function(
        lambda x, y: ns.cross_entropy(x, y, reduction="none"), input_signature=dynamic_batch
    )
    np.testing.assert_allclose(
        fn(tf.zeros((2, 3)), tf.constant([0, 1], tf.int64)), [np.log(3.0)] * 2, rtol=1e-6
    )
