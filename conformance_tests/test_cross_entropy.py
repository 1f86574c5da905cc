"""cross_entropy, log_softmax, logsumexp and smooth_labels on every backend against the
float64 oracle: values and gradients, eager and compiled, native and generic kernels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numstab as ns
from conformance_tests import oracle
from conformance_tests.cases import (
    CASES,
    NONFINITE_CASES,
    UNMATCHABLE_IGNORE_INDEX,
    build_magnitude_cases,
    magnitude_offsets,
)
from conformance_tests.tolerances import GRADIENT, VALUE

DTYPES = ["float32", "float16", "bfloat16"]


def _inputs(target, case, dtype):
    h = target.h
    logits = h.asarray(case.logits, dtype)
    labels_dtype = dtype if case.labels.dtype.kind == "f" else None
    labels = h.asarray(case.labels, labels_dtype)
    weight = None if case.weight is None else h.asarray(case.weight, "float32")
    return logits, labels, weight


def _check(actual, expected, tolerance, what):
    rtol, atol = tolerance
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(target, impl, dtype, case):
    h = target.h
    logits, labels, weight = _inputs(target, case, dtype)
    x64, t64 = h.numpy(logits), h.numpy(labels)  # the values the backend actually sees
    w64 = None if weight is None else h.numpy(weight)
    # "sum" shares every kernel with "mean"; compiled runs check "mean" alone to save traces.
    for reduction in ("mean",) if target.compiled else ("mean", "sum"):
        fn = lambda x, r=reduction: ns.cross_entropy(
            x, labels, weight=weight, reduction=r, **case.kwargs
        )
        value, grad = h.value_and_grad(fn, logits, target.compiled)
        want, want_grad = oracle.cross_entropy(
            x64, t64, weight=w64, reduction=reduction, **case.kwargs
        )
        _check(value, want, VALUE[dtype], f"{reduction} value")
        assert np.asarray(value).dtype == np.float64  # harness upcasts; dtype checked below
        if grad is not None:
            assert grad.shape == x64.shape
            _check(grad, want_grad, GRADIENT[dtype], f"{reduction} gradient")
    rows = h.call(
        lambda x: ns.cross_entropy(x, labels, weight=weight, reduction="none", **case.kwargs),
        target.compiled,
        logits,
    )
    want_rows, _ = oracle.cross_entropy(x64, t64, weight=w64, reduction="none", **case.kwargs)
    assert rows.shape == want_rows.shape
    _check(rows, want_rows, VALUE[dtype], "per-row values")


@pytest.mark.parametrize("case", NONFINITE_CASES, ids=lambda c: c.name)
def test_nonfinite_rows(target, impl, case):
    h = target.h
    logits, labels, _ = _inputs(target, case, "float32")
    rows = h.call(
        lambda x: ns.cross_entropy(x, labels, reduction="none", **case.kwargs),
        target.compiled,
        logits,
    )
    want, _ = oracle.cross_entropy(
        h.numpy(logits), h.numpy(labels), reduction="none", **case.kwargs
    )
    np.testing.assert_array_equal(np.isnan(rows), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(rows), np.isposinf(want))
    finite = np.isfinite(want)
    _check(rows[finite], want[finite], VALUE["float32"], "finite rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtype_is_float32(target, dtype):
    h = target.h
    logits = h.asarray(np.zeros((2, 3)), dtype)
    labels = h.asarray(np.array([0, 2]))
    out = ns.cross_entropy(logits, labels, reduction="none")
    assert ns.resolve_backend(out).dtype_name(out) == "float32"
    assert ns.resolve_backend(out).dtype_name(ns.log_softmax(logits)) == "float32"


def test_out_of_range_label(target):
    h = target.h
    logits = h.asarray(np.zeros((3, 4)), "float32")
    labels = h.asarray(np.array([1, 4, -100]))
    fn = lambda x, y: ns.cross_entropy(x, y, reduction="none")
    if not target.compiled:
        with pytest.raises(ns.InvalidArgumentError, match=r"labels\[1\]=4"):
            fn(logits, labels)
        return
    rows = h.call(fn, True, logits, labels)  # never a silently clamped, plausible number
    assert np.isfinite(rows[0]) and np.isnan(rows[1]) and rows[2] == 0.0


@pytest.mark.parametrize(("ignore_index", "label_dtype"), UNMATCHABLE_IGNORE_INDEX)
def test_ignore_index_no_label_can_equal(target, ignore_index, label_dtype):
    """An ignore_index outside the labels' index dtype ignores nothing, eagerly and compiled;
    an out-of-range label still raises eagerly, or is a NaN row."""
    h = target.h
    logits = h.asarray(np.random.default_rng(4).normal(0, 2, (3, 4)), "float32")
    labels = np.array([1, 3, 0], label_dtype)
    kwargs = {"ignore_index": ignore_index, "label_smoothing": 0.1}
    y = h.asarray(labels)
    fn = lambda x: ns.cross_entropy(x, y, **kwargs)
    value, grad = h.value_and_grad(fn, logits, target.compiled)
    want, want_grad = oracle.cross_entropy(h.numpy(logits), labels, label_smoothing=0.1)
    _check(value, want, VALUE["float32"], "value")
    if grad is not None:
        _check(grad, want_grad, GRADIENT["float32"], "gradient")
    bad = h.asarray(np.array([1, 4, 0], label_dtype))
    rows_fn = lambda x, t: ns.cross_entropy(x, t, reduction="none", **kwargs)
    if not target.compiled:
        with pytest.raises(ns.InvalidArgumentError, match=r"ignore_index=.*labels\[1\]=4 "):
            rows_fn(logits, bad)
        return
    rows = h.call(rows_fn, True, logits, bad)
    assert np.isfinite(rows[0]) and np.isnan(rows[1]) and np.isfinite(rows[2])


def test_all_ignored_mean_is_zero_with_zero_gradient(target, impl):
    h = target.h
    logits = h.asarray(np.ones((3, 4)), "float32")
    labels = h.asarray(np.full(3, 7))
    fn = lambda x: ns.cross_entropy(x, labels, ignore_index=7, label_smoothing=0.2)
    value, grad = h.value_and_grad(fn, logits, target.compiled)
    assert value == 0.0
    if grad is not None:
        assert np.all(grad == 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_and_logsumexp(target, impl, dtype):
    h = target.h
    x = np.random.default_rng(3).normal(0, 4, (3, 4, 5))
    x[0, 0, :] = -np.inf
    x[1, 2, 3] = -np.inf
    arr = h.asarray(x, dtype)
    x64 = h.numpy(arr)
    with np.errstate(all="ignore"):
        m = np.max(x64, axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        lse = np.log(np.sum(np.exp(x64 - m), axis=1, keepdims=True)) + m
    got_lse = h.call(lambda a: ns.logsumexp(a, axis=1, keepdims=True), target.compiled, arr)
    _check(got_lse, lse, VALUE[dtype], "logsumexp")
    got_lse = h.call(lambda a: ns.logsumexp(a, axis=1), target.compiled, arr)
    _check(got_lse, lse[:, 0], VALUE[dtype], "logsumexp keepdims=False")
    got = h.call(lambda a: ns.log_softmax(a, axis=1), target.compiled, arr)
    with np.errstate(all="ignore"):
        _check(got, x64 - lse, VALUE[dtype], "log_softmax")


def test_smooth_labels(target):
    h = target.h
    ids = h.asarray(np.array([0, 2, 1]))
    got = h.call(lambda y: ns.smooth_labels(y, 0.1, num_classes=4), target.compiled, ids)
    want = 0.9 * np.eye(4)[[0, 2, 1]] + 0.1 / 4
    _check(got, want, VALUE["float32"], "integer ids")
    probs = np.array([[0.2, 0.8], [1.0, 0.0]])
    got = h.call(lambda t: ns.smooth_labels(t, 0.5), target.compiled, h.asarray(probs, "float32"))
    _check(got, 0.5 * probs + 0.25, VALUE["float32"], "probabilities")


# Hypothesis: random shapes, masks, labels and options, eagerly, against the oracle.
@st.composite
def problems(draw):
    n = draw(st.sampled_from([0, 3, 6]))  # few shapes: JAX compiles each op per shape
    k = draw(st.sampled_from([1, 4, 9]))
    scale = draw(st.sampled_from([0.1, 3.0, 300.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.normal(0, scale, (n, k))
    if draw(st.booleans()) and k > 1:
        x[rng.uniform(size=(n, k)) < 0.3] = -np.inf
    labels = rng.integers(0, k, n)
    labels[rng.uniform(size=n) < 0.2] = -100
    kwargs = {
        "label_smoothing": draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
        "z_loss": draw(st.sampled_from([0.0, 1e-4, 0.1])),
    }
    weight = rng.uniform(0.1, 3.0, k) if draw(st.booleans()) else None
    return x, labels, weight, kwargs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_random(eager_target, dtype):
    """Eager only: compiled modes would retrace for every random shape."""
    h = eager_target.h

    @settings(
        max_examples=30,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(problems())
    def check(problem):
        x, labels, weight, kwargs = problem
        logits, y = h.asarray(x, dtype), h.asarray(labels)
        w = None if weight is None else h.asarray(weight, "float32")
        fn = lambda a: ns.cross_entropy(a, y, weight=w, **kwargs)
        value, grad = h.value_and_grad(fn, logits, False)
        w64 = None if w is None else h.numpy(w)
        want, want_grad = oracle.cross_entropy(h.numpy(logits), labels, weight=w64, **kwargs)
        if not np.isfinite(want):  # a counted row whose target class is masked
            assert np.isposinf(value)
            return
        _check(value, want, (1e-4, 1e-4), "value")
        if grad is not None:
            _check(grad, want_grad, GRADIENT[dtype], "gradient")

    check()


def _loss(labels, weight, reduction, case):
    return lambda x: ns.cross_entropy(x, labels, weight=weight, reduction=reduction, **case.kwargs)


MAGNITUDE_DTYPES = ["float32", "float16", "bfloat16", "float64"]


@pytest.mark.parametrize("dtype", MAGNITUDE_DTYPES)
def test_cross_entropy_at_every_magnitude(target, impl, dtype):
    """Every label kind at common offsets from 1e4 to max/2 of the dtype (see
    cases.build_magnitude_cases), against the oracle, which shifts by the row max first.

    The backend computes lse(x - m) - (x[c] - m) in float32 (float64): x - m is exact for
    entries within a factor 2 of m, so the error is that of a loss of unit scale at any
    offset, VALUE[dtype] relative to the loss (whose size grows with the spread)."""
    offsets, kinds = magnitude_offsets(dtype), None
    if target.compiled:  # each case is a trace: the kernels jit adds, at one offset
        if dtype != "float32":
            pytest.skip("compiled: float32 only (eager covers every dtype)")
        offsets, kinds = [1e6], ("hard", "masked_smoothed", "probabilities")
    for offset in offsets:
        for case in build_magnitude_cases(dtype, offset):
            if kinds is not None and case.name not in kinds:
                continue
            logits, labels, weight = _inputs(target, case, dtype)
            if ns.resolve_backend(logits).dtype_name(logits) != dtype:
                pytest.skip(f"{target.name} holds no {dtype} here (JAX without x64)")
            x64, t64 = target.h.numpy(logits), target.h.numpy(labels)
            w64 = None if weight is None else target.h.numpy(weight)
            rows = target.h.call(_loss(labels, weight, "none", case), target.compiled, logits)
            want, _ = oracle.cross_entropy(x64, t64, weight=w64, reduction="none", **case.kwargs)
            _check(rows, want, VALUE[dtype], f"{case.name} at {offset:g}")
            mean = _loss(labels, weight, "mean", case)
            value, grad = target.h.value_and_grad(mean, logits, target.compiled)
            want, want_grad = oracle.cross_entropy(x64, t64, weight=w64, **case.kwargs)
            _check(value, want, VALUE[dtype], f"{case.name} mean at {offset:g}")
            if grad is not None:
                _check(grad, want_grad, GRADIENT[dtype], f"{case.name} gradient at {offset:g}")
