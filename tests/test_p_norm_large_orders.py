"""``global_norm`` / ``clip_by_global_norm`` for every finite p > 0 (§7.2, §7.5): the p-norm
rescaled by the max-abs, exact to float32 rounding and the same on every backend. Before,
x ** (1 / p) ran in float32, where 1 / p rounds or flushes to 0: p = 1e300 gave 1.0 for
[3, 4] (inf ** 0) and left it unclipped, p = 1e3 overflowed to inf, p = 1e38 / 1e40 gave 1.0
on some backends and inf on others, and p = 10**400 raised Python's OverflowError."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numstab as ns
from tests.backend_arrays import as_backend

BACKENDS = ["numpy", "torch", "jax", "tensorflow"]
ORDERS = [1e3, 1e7, 1e38, 1e300]
EPS32 = float(np.finfo(np.float32).eps)


def _trees() -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        [np.array([3.0, 4.0], np.float32)],
        [(rng.standard_normal((40, 25)) * 1e30).astype(np.float32), np.float32([1e-30, 2.0])],
        [rng.standard_normal(64).astype(np.float32), -rng.random((3, 5)).astype(np.float32)],
        [np.float32([2.0, -2.0, 2.0]), np.zeros(4, np.float32)],  # ties at the max
    ]


def _oracle(tree: list[np.ndarray], p: float) -> float:
    """The p-norm in float64, rescaled by the max-abs (no overflow)."""
    a = np.abs(np.concatenate([x.astype(np.float64).ravel() for x in tree]))
    m = a.max()
    return float(m * np.sum((a / m) ** p) ** (1.0 / p)) if m > 0 else 0.0


@pytest.mark.parametrize("impl", ["native", "generic"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", ORDERS)
def test_large_p_norms_match_the_float64_oracle(impl, backend, p):
    for tree in _trees():
        got = ns.global_norm([as_backend(backend, x) for x in tree], norm_type=p)
        # the max-abs is exact; the root of the rescaled sum is 1 + at most ln(n) / p, and
        # each term's rounding moves it by at most eps: within 2 eps of the oracle
        assert float(np.asarray(got)) == pytest.approx(_oracle(tree, p), rel=2 * EPS32, abs=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clipping_by_a_huge_order_clips(backend):
    tree = [as_backend(backend, np.array([3.0, 4.0], np.float32))]
    clipped, norm = ns.clip_by_global_norm(tree, 2.0, norm_type=1e300)
    assert float(np.asarray(norm)) == 4.0  # the max-abs norm, not 1.0
    np.testing.assert_allclose(np.asarray(clipped[0]), [1.5, 2.0], rtol=EPS32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_order_past_float64_is_the_max_abs_norm(backend):
    """10**400 is a finite real > 0 (§7.5): as every p past ``max_norm_from``, its norm is
    the max-abs norm to rounding (before: Python's OverflowError from float())."""
    tree = [as_backend(backend, np.array([3.0, -4.0], np.float32))]
    assert float(np.asarray(ns.global_norm(tree, norm_type=10**400))) == 4.0
    assert float(np.asarray(ns.clip_by_global_norm(tree, 2.0, norm_type=10**400)[1])) == 4.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_moderate_orders_do_not_overflow(backend):
    """(|g| / M) ** p stays in [0, 1]: p = 3 of [1e30, 1e30] is 2**(1/3) * 1e30, not inf."""
    tree = [as_backend(backend, np.float32([1e30, 1e30]))]
    got = float(np.asarray(ns.global_norm(tree, norm_type=3.0)))
    assert got == pytest.approx(2.0 ** (1 / 3) * 1e30, rel=4 * EPS32)


def test_the_max_abs_threshold_is_derived():
    """n ** (1 / p) <= 1 + u for every array size n < 2**63 from this p on."""
    from numstab.backends._tree_ops import max_norm_from

    for dtype, unit in (("float32", 2.0**-24), ("float64", 2.0**-53)):
        p = max_norm_from(dtype)
        assert math.exp(63 * math.log(2) / p) <= 1 + unit * (1 + 1e-12)
        assert math.exp(63 * math.log(2) / (0.99 * p)) > 1 + unit
    assert 7.3e8 < max_norm_from("float32") < 7.4e8


def test_an_order_that_float64_rounds_to_zero_is_refused():
    from fractions import Fraction

    with pytest.raises(ns.InvalidArgumentError, match="norm_type"):
        ns.global_norm([np.float32([1.0])], norm_type=Fraction(1, 10**400))
