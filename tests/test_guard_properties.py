"""Property (hypothesis, every backend): whatever step a NaN or inf strikes, and in what,
the guarded parameters stay finite and equal to the run without that step."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numstab as ns
from numstab.backends import BACKEND_NAMES, load_backend

EXAMPLES = int(os.environ.get("NUMSTAB_HYPOTHESIS_EXAMPLES", "200"))
BACKENDS = [
    n.strip() for n in os.environ.get("NUMSTAB_TEST_BACKENDS", ",".join(BACKEND_NAMES)).split(",")
]
STEPS = 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 3)).astype(np.float32)
Y = X @ np.array([1.0, -2.0, 0.5], np.float32)


def _train(backend: str, strike: dict | None) -> tuple[np.ndarray, list[bool]]:
    """SGD on least squares; the guard's decide() (on ``backend``) gates every update."""
    be = load_backend(backend)
    guard = ns.TrainingGuard(snapshot_every=1000)
    state = guard.init_state(backend)
    w = np.zeros(3, np.float32)
    applied = []
    for step in range(STEPS):
        residual = X @ w - Y
        loss = np.float32(np.mean(residual**2))
        grad = (2.0 / len(X) * X.T @ residual).astype(np.float32)
        if strike is not None and strike["step"] == step:
            if strike["what"] == "loss":
                loss = np.float32(strike["value"])
            else:
                grad[strike["index"]] = strike["value"]
        norm = np.float32(np.sqrt(np.sum(grad.astype(np.float64) ** 2)))
        decision, state = guard.decide(state, be.asarray(loss), be.asarray(norm), backend)
        ok = bool(np.asarray(be.to_numpy(decision.apply)))
        applied.append(ok)
        if ok:
            w = w - 0.05 * grad
    return w, applied


@st.composite
def strikes(draw):
    return {
        "step": draw(st.integers(0, STEPS - 1)),
        "what": draw(st.sampled_from(["loss", "grad"])),
        "index": draw(st.integers(0, 2)),
        "value": draw(st.sampled_from([np.nan, np.inf, -np.inf])),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_stay_finite_whatever_step_a_nan_strikes(backend):
    clean, _ = _train(backend, None)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(strikes())
    def check(strike):
        w, applied = _train(backend, strike)
        assert np.isfinite(w).all()
        assert applied.count(False) == 1 and not applied[strike["step"]]
        # the run equals the clean run with that one update left out
        skipped, _ = _train_without(strike["step"])
        np.testing.assert_array_equal(w, skipped)

    check()
    assert np.isfinite(clean).all()


def _train_without(skip: int) -> tuple[np.ndarray, None]:
    w = np.zeros(3, np.float32)
    for step in range(STEPS):
        residual = X @ w - Y
        grad = (2.0 / len(X) * X.T @ residual).astype(np.float32)
        if step != skip:
            w = w - 0.05 * grad
    return w, None
