"""Dynamic loss scaling on every backend, eager and compiled, against the plain-Python oracle,
and every preset against the algorithm of the library it names."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numstab as ns
from conformance_tests import oracle
from conformance_tests.tolerances import GRADIENT
from numstab.loss_scale import PRESETS

STEPS = 60
MAX_NORM = 5.0
INJECTED = {
    7: ("w", np.inf),
    19: ("b", np.nan),
    20: ("e", -np.inf),
    33: ("w", np.nan),
    34: ("b", np.inf),
    47: ("e", np.nan),
}
DTYPES = {"w": "float32", "b": "float16", "e": "bfloat16"}
SHAPES = {"w": (4, 3), "b": (3,), "e": (2, 2)}


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 data to ``dtype`` the way the backends store it, back in float64."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(dtype).astype(np.float64)


def _script():
    """Per step: unscaled float64 gradients; the test scales them by the current scale."""
    rng = np.random.default_rng(0)
    steps = []
    for step in range(STEPS):
        grads = {k: rng.normal(0, 4.0 if k == "b" else 1.0, SHAPES[k]) for k in SHAPES}
        if step in INJECTED:
            leaf, value = INJECTED[step]
            grads[leaf].flat[1] = value
        steps.append(grads)
    return steps


SCRIPT = _script()


def _step(scaler):
    def step(state, grads):
        unscaled, finite = scaler.unscale(grads, state)
        clipped, norm = ns.clip_by_global_norm(unscaled, MAX_NORM)
        return scaler.update(state, finite), clipped, finite, norm

    return step


@pytest.mark.parametrize("preset", list(PRESETS))
def test_scripted_run_matches_oracle(target, preset):
    """60 steps with natural fp16 overflows and injected inf/NaN: identical scale trajectory
    and skip pattern, and the same clipped gradients as the oracle, on every backend."""
    h = target.h
    overrides = {"init_scale": 2.0**10, "growth_interval": 4}
    scaler = ns.LossScaler.preset(preset, **overrides)
    reference = oracle.ScalerOracle(**{**PRESETS[preset], **overrides})
    step = _step(scaler)
    step = h._compiled(step) if target.compiled else step
    state = scaler.init(like=h.asarray(np.zeros(1), "float32"))
    for i, grads in enumerate(SCRIPT):
        scale = reference.scale
        scaled = {k: _cast(g * scale, DTYPES[k]) for k, g in grads.items()}
        state, clipped, finite, norm = step(
            state, {k: h.asarray(v, DTYPES[k]) for k, v in scaled.items()}
        )
        want_unscaled = [_cast(scaled[k] * (1.0 / scale), DTYPES[k]) for k in SHAPES]
        want_finite = all(np.isfinite(u).all() for u in want_unscaled)
        reference.update(want_finite)
        assert bool(h.numpy(finite)) == want_finite, f"step {i}"
        assert float(h.numpy(state.scale)) == reference.scale, f"step {i}"
        assert int(h.numpy(state.growth_tracker)) == reference.tracker, f"step {i}"
        assert int(h.numpy(state.hysteresis_left)) == reference.hysteresis_left, f"step {i}"
        want_clipped, want_norm = oracle.clip_by_global_norm(want_unscaled, MAX_NORM)
        if not want_finite:
            assert not np.isfinite(h.numpy(norm))
            continue
        np.testing.assert_allclose(h.numpy(norm), want_norm, rtol=1e-6, err_msg=f"step {i}")
        for k, want in zip(SHAPES, want_clipped, strict=True):
            np.testing.assert_allclose(
                h.numpy(clipped[k]),
                _cast(want, DTYPES[k]),
                rtol=GRADIENT[DTYPES[k]][0],
                atol=1e-6,
                err_msg=f"step {i} leaf {k}",
            )


finite_sequences = st.lists(st.booleans(), min_size=1, max_size=80)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(finite_sequences, st.integers(1, 5), st.integers(1, 3), st.booleans())
def test_deepspeed_preset_matches_deepspeed(sequence, window, hysteresis, consecutive):
    scaler = ns.LossScaler.preset(
        "deepspeed",
        init_scale=2.0**8,
        growth_interval=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
    )
    reference = oracle.DeepSpeedScaler(2.0**8, window, 1.0, hysteresis, consecutive)
    state = scaler.init(backend="numpy")
    for finite in sequence:
        state = scaler.update(state, finite)
        reference.update_scale(not finite)
        assert float(state.scale) == reference.cur_scale


@settings(max_examples=60, deadline=None, derandomize=True)
@given(finite_sequences, st.integers(1, 5), st.integers(1, 3))
def test_megatron_preset_matches_megatron(sequence, window, hysteresis):
    scaler = ns.LossScaler.preset(
        "megatron", init_scale=2.0**8, growth_interval=window, hysteresis=hysteresis
    )
    reference = oracle.MegatronScaler(2.0**8, 1.0, 2.0, 0.5, window, hysteresis)
    state = scaler.init(backend="numpy")
    for finite in sequence:
        state = scaler.update(state, finite)
        reference.update(not finite)
        assert float(state.scale) == reference.scale


def test_torch_preset_matches_grad_scaler():
    torch = pytest.importorskip("torch")
    scaler = ns.LossScaler.preset("torch", init_scale=8.0, growth_interval=3)
    state = scaler.init(backend="torch")
    found_inf = torch.zeros(1)
    scale, tracker = torch.full((1,), 8.0), torch.zeros(1, dtype=torch.int32)
    for finite in [True] * 3 + [False] + [True] * 3 + [False, False] + [True] * 7:
        found_inf.fill_(0.0 if finite else 1.0)
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 3)
        state = scaler.update(state, finite)
        assert float(state.scale) == float(scale)
        assert int(state.growth_tracker) == int(tracker)


def test_state_round_trips_with_every_field(target):
    h = target.h
    scaler = ns.LossScaler(
        init_scale=2.0**9,
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=7,
        hysteresis=3,
        min_scale=0.5,
        max_scale=2.0**20,
        consecutive_hysteresis=True,
        growth_delay_after_overflow=2,
    )
    state = scaler.init(like=h.asarray(np.zeros(1), "float32"))
    for finite in (False, False, False, True):  # the third overflow exhausts hysteresis
        state = scaler.update(state, finite)
    data = scaler.state_dict(state)
    assert data["state"] == {"scale": 2.0**9 * 0.25, "growth_tracker": -1, "hysteresis_left": 3}
    restored, restored_state = ns.LossScaler.from_state_dict(data, backend=h.name)
    assert restored == scaler
    assert restored.state_dict(restored_state) == data


def test_scale_never_reaches_zero():
    scaler = ns.LossScaler()
    state = scaler.init(backend="numpy")
    for _ in range(300):
        state = scaler.update(state, False)
    assert float(state.scale) == 2.0**-126  # torch reaches 0.0 and can never grow back
    for _ in range(2000):
        state = scaler.update(state, True)
    assert float(state.scale) == 2.0**-125


@pytest.mark.parametrize(
    ("config", "low", "high"),  # the bounds expected where the config moves them
    [
        ({"min_scale": 1e-50}, 2.0**-126, None),  # below float32: 0 before the clamp
        ({"min_scale": 1e-40, "backoff_factor": 1e-30}, 2.0**-126, None),  # a subnormal
        ({"min_scale": 0.3, "init_scale": 1.0}, 0.30000001192092896, None),  # f32 above 0.3
        ({"max_scale": 1e39, "init_scale": 2.0**120}, None, 3.4028234663852886e38),
        ({"max_scale": 3.0, "init_scale": 1.0, "growth_factor": 2.9999999}, None, 3.0),
    ],
)
def test_scale_stays_in_float32_bounds(eager_target, config, low, high):
    """The documented rule: the scale stays within the float32 values of [min_scale,
    max_scale] and of float32's normal range, on every backend, for runs of overflows and
    of growths."""
    scaler = ns.LossScaler(growth_interval=1, **config)
    h = eager_target.h
    state = scaler.init(backend=h.name)
    got = oracle.ScalerOracle(growth_interval=1, **config)
    for finite in [False] * 40 + [True] * 40 + [False] * 3:
        state = scaler.update(state, finite)
        got.update(finite)
        scale = float(h.numpy(state.scale))
        assert scale == got.scale and 0.0 < scale < np.inf
        assert scale >= (config.get("min_scale") or 0.0) and scale >= 2.0**-126
        assert scale <= config.get("max_scale", np.inf)
    assert scaler.scale_bounds == (got.low, got.high)
    assert (low is None or got.low == low) and (high is None or got.high == high)


def test_for_dtype():
    assert ns.LossScaler.for_dtype("float16") == ns.LossScaler()
    for dtype in ("bfloat16", "float32", np.float32):
        noop = ns.LossScaler.for_dtype(dtype)
        state = noop.init(backend="numpy")
        assert float(state.scale) == 1.0
        assert noop.update(state, False) is state  # never backs off: bf16 has fp32's range
        _, finite = noop.unscale({"g": np.array([np.nan], np.float32)}, state)
        assert not finite  # but non-finite gradients are still reported
    with pytest.raises(ns.InvalidArgumentError, match="dtype='int8'"):
        ns.LossScaler.for_dtype("int8")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_scale": 0.0}, r"Expected init_scale in \[1.17549e-38, 3.40282e\+38\]"),
        ({"init_scale": float("inf")}, "init_scale=inf"),
        ({"growth_factor": 1.0}, r"growth_factor in \(1, inf\)"),
        ({"backoff_factor": 1.0}, r"backoff_factor in \(0, 1\)"),
        ({"backoff_factor": 0.0}, "backoff_factor=0.0"),
        ({"growth_interval": 0}, "growth_interval >= 1"),
        ({"hysteresis": 1.5}, "Expected hysteresis to be an int"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "min_scale <= max_scale"),
    ],
)
def test_bad_scaler_config(kwargs, message):
    with pytest.raises(ns.InvalidArgumentError, match=message):
        ns.LossScaler(**kwargs)
    with pytest.raises(ns.InvalidArgumentError, match="Expected name to be one of"):
        ns.LossScaler.preset("apex")


def test_unscale_rejects_integer_gradients(eager_target):
    h = eager_target.h
    scaler = ns.LossScaler()
    state = scaler.init(like=h.asarray(np.zeros(1), "float32"))
    with pytest.raises(ns.InvalidArgumentError, match="dtype=int32"):
        scaler.unscale([h.asarray(np.ones(3), "float32"), h.asarray(np.ones(2, np.int32))], state)


def test_unscale_keeps_float64_precision():
    scaler = ns.LossScaler(init_scale=4.0)
    state = scaler.init(backend="numpy")
    (g,), finite = scaler.unscale([np.array([1.0 / 3.0])], state)
    assert g.dtype == np.float64 and g[0] == 1.0 / 12.0 and finite


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_scale": 2.0**200}, "init_scale"),
        ({"init_scale": 1e-50}, "init_scale"),
        ({"init_scale": 2.0, "min_scale": 3.0}, "min_scale <= init_scale <= max_scale"),
        ({"dynamic": "no"}, "Expected dynamic to be a bool"),
    ],
)
def test_scale_range_and_flags_are_validated(kwargs, message):
    with pytest.raises(ns.InvalidArgumentError, match=message):
        ns.LossScaler(**kwargs)
    assert ns.LossScaler.for_dtype("bfloat16", init_scale=2.0).init_scale == 2.0
