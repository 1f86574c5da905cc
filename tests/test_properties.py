"""Invariants at extreme but legal values (docs/semantics.md §2, "Extreme but legal values"),
checked with hypothesis on every backend of ``NUMSTAB_TEST_BACKENDS`` (default: all four).

Each property runs ``NUMSTAB_HYPOTHESIS_EXAMPLES`` examples (default 200), derandomized, so a
failure reproduces; raise the count for a longer search.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import numstab as ns
from conformance_tests.harness import HARNESSES
from numstab.backends import BACKEND_NAMES, load_backend

EXAMPLES = int(os.environ.get("NUMSTAB_HYPOTHESIS_EXAMPLES", "200"))
BACKENDS = [
    n.strip() for n in os.environ.get("NUMSTAB_TEST_BACKENDS", ",".join(BACKEND_NAMES)).split(",")
]
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
EPS32 = float(np.finfo(np.float32).eps)
F32_MAX = float(np.finfo(np.float32).max)
LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": F32_MAX}
LARGEST["float64"] = float(np.finfo(np.float64).max)


@pytest.fixture(params=BACKENDS)
def h(request):
    harness = HARNESSES[request.param]("cpu")
    load_backend(request.param)
    return harness


def _dtypes(h) -> list[str]:
    """float64 where the backend holds it (JAX without x64 does not)."""
    probe = h.asarray(np.zeros(1), "float64")
    wide = ns.resolve_backend(probe).dtype_name(probe) == "float64"
    return ["float16", "bfloat16", "float32"] + (["float64"] if wide else [])


def _held(h, x: np.ndarray, dtype: str):
    """(backend array of ``dtype``, the float64 values it holds)."""
    arr = h.asarray(x, dtype)
    return arr, h.numpy(arr)


# -- cross-entropy ----------------------------------------------------------------------------
@st.composite
def logits_problems(draw, dtypes):
    """Logits of any dtype at any finite magnitude: a common offset and a spread, each up to
    a quarter of the dtype's largest value (so that max - min, the largest loss, is finite
    in the compute dtype), with labels hard or probabilities and any smoothing."""
    dtype = draw(st.sampled_from(dtypes))
    limit = min(LARGEST[dtype], LARGEST["float64" if dtype == "float64" else "float32"]) / 4
    offset = draw(st.floats(-limit, limit))
    spread = draw(st.floats(0.0, limit))
    rows, classes = draw(st.sampled_from([(2, 1), (3, 5)]))  # few shapes: JAX traces each
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.clip(offset + spread * rng.uniform(-1, 1, (rows, classes)), -limit, limit)
    eps = draw(st.sampled_from([0.0, 0.1, 1.0]))
    probabilities = draw(st.booleans())
    labels = (
        rng.dirichlet(np.ones(classes), rows) if probabilities else rng.integers(0, classes, rows)
    )
    return dtype, x, labels, eps


def test_cross_entropy_is_finite_for_finite_logits(h):
    """Every per-row loss of finite logits is finite and >= 0 (to rounding), at any offset
    and spread the dtype holds, native and generic kernels alike."""

    @PROPERTY
    @given(logits_problems(_dtypes(h)), st.booleans())
    def check(problem, generic):
        dtype, x, labels, eps = problem
        logits, seen = _held(h, x, dtype)
        assume(np.isfinite(seen).all())
        y = h.asarray(labels, "float32" if labels.dtype.kind == "f" else None)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NUMSTAB_FORCE_GENERIC", "1" if generic else "0")
            rows = h.numpy(ns.cross_entropy(logits, y, label_smoothing=eps, reduction="none"))
        assert np.isfinite(rows).all(), (dtype, seen, rows)
        span = np.ptp(seen, axis=-1) if seen.size else 0.0
        assert (rows >= -4 * EPS32 * (1 + span)).all()

    check()


def test_smoothed_targets_sum_to_one(h):
    """smooth_labels of class ids, or of probabilities summing to one, sums to one along the
    classes to float32 rounding (K terms), for any alpha in [0, 1]."""

    @PROPERTY
    @given(
        st.floats(0.0, 1.0),
        st.sampled_from([1, 2, 7, 1000]),
        st.integers(0, 2**32 - 1),
        st.booleans(),
    )
    def check(alpha, classes, seed, probabilities):
        rng = np.random.default_rng(seed)
        if probabilities:
            labels = h.asarray(rng.dirichlet(np.ones(classes), 3), "float32")
            out = ns.smooth_labels(labels, alpha)
        else:
            out = ns.smooth_labels(h.asarray(rng.integers(0, classes, 3)), alpha, classes)
        total = h.numpy(out).sum(-1)
        np.testing.assert_allclose(total, 1.0, rtol=0, atol=(classes + 2) * EPS32)

    check()


# -- clipping ---------------------------------------------------------------------------------
def clipped_norm_bound(max_norm: float, size: int) -> float:
    """max_norm times float32's rounding of the norm (``size`` terms), of the factor and of
    the product, plus float32's subnormal spacing: max_norm itself rounds to a multiple of
    2**-149, and float32 leaves round to nearest (half a spacing each, sqrt(size) of them in
    the norm). 16-bit leaves round toward zero: nothing of their own coarser rounding."""
    return max_norm * (1 + (size + 3) * EPS32) + (1 + math.sqrt(size) / 2) * 2.0**-149


@st.composite
def gradient_trees(draw, dtypes):
    """Two leaves of any dtype whose float32 norm neither overflows nor underflows (the
    documented range: squares accumulate in float32), sometimes all zero."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    leaves = []
    for size in (7, 30):
        dtype = draw(st.sampled_from(dtypes))
        high = min(LARGEST[dtype], 1e15)
        magnitude = draw(st.one_of(st.just(0.0), st.floats(1e-15, high)))
        leaves.append((rng.normal(0, 1, size) * magnitude / 3, dtype))
    return leaves


def test_clipping_never_raises_the_norm_past_max_norm(h):
    """clip_by_global_norm for any max_norm from the smallest positive double to the largest:
    the clipped norm stays under ``clipped_norm_bound``, finite leaves stay finite, and a
    tree under the limit comes back exactly unchanged."""

    @PROPERTY
    @given(
        gradient_trees(_dtypes(h)),
        st.one_of(st.floats(5e-324, 1.7976931348623157e308), st.sampled_from([5e-324, 1e-45])),
        st.sampled_from([2.0, math.inf]),
    )
    def check(leaves, max_norm, norm_type):
        held = [_held(h, np.clip(x, -LARGEST[d], LARGEST[d]), d) for x, d in leaves]
        tree = [arr for arr, _ in held]
        clipped, norm = ns.clip_by_global_norm(tree, max_norm, norm_type=norm_type)
        out = [h.numpy(c) for c in clipped]
        assert all(np.isfinite(o).all() for o in out)
        flat = np.concatenate([o.ravel() for o in out])
        got = np.abs(flat).max() if norm_type == math.inf else np.sqrt(np.sum(flat**2))
        assert got <= clipped_norm_bound(max_norm, flat.size), (max_norm, got)
        if float(h.numpy(norm)) <= max_norm:
            for o, (_, seen) in zip(out, held, strict=True):
                np.testing.assert_array_equal(o, seen)

    check()


# -- loss scaling -----------------------------------------------------------------------------
@st.composite
def scaler_configs(draw):
    """Any legal LossScaler configuration, bounds anywhere in (0, inf)."""
    init = draw(st.floats(2.0**-126, F32_MAX))
    low = draw(st.one_of(st.none(), st.floats(5e-324, init)))
    high = draw(st.one_of(st.none(), st.floats(init, 1e300)))
    return {
        "init_scale": init,
        "growth_factor": draw(st.floats(1.0, 1e10, exclude_min=True)),
        "backoff_factor": draw(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
        "growth_interval": draw(st.integers(1, 3)),
        "hysteresis": draw(st.integers(1, 3)),
        "min_scale": low,
        "max_scale": high,
        "consecutive_hysteresis": draw(st.booleans()),
        "growth_delay_after_overflow": draw(st.integers(0, 2)),
    }


def test_loss_scale_stays_positive_finite_and_in_bounds(h):
    """For any legal configuration and any run of finite / non-finite steps the scale is
    positive, finite, >= 2**-126 and within [min_scale, max_scale]."""

    @PROPERTY
    @given(scaler_configs(), st.lists(st.booleans(), min_size=1, max_size=25))
    def check(config, steps):
        try:
            scaler = ns.LossScaler(**config)
        except ns.InvalidArgumentError:  # min and max within one float32 gap: refused
            assume(False)
        state = scaler.init(backend=h.name)
        low, high = config["min_scale"] or 0.0, config["max_scale"] or math.inf
        for finite in steps:
            state = scaler.update(state, finite)
            scale = float(h.numpy(state.scale))
            assert 2.0**-126 <= scale <= F32_MAX and low <= scale <= high, (config, scale)

    check()
