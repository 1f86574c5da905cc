"""ZClip, AGC and the warmup-cosine schedule on every backend, eager and compiled, against the
float64 oracles of conformance_tests/oracle_adaptive.py."""

from __future__ import annotations

import numpy as np
import pytest

from conformance_tests import oracle_adaptive as oracle
from conformance_tests.tolerances import GRADIENT
from numstab.adaptive_clipping import AGC, ZClip
from numstab.errors import InvalidArgumentError
from numstab.schedules import warmup_cosine_schedule

SHAPES = [(5, 4), (4,), (3,)]


def _script(steps=30, seed=3):
    """Gradients with global norm ~0.6 and spikes (x12 at 12, x30 at 20 and 21, x8 in the
    warmup at 2), and a NaN at step 25."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        scale = 0.12 * (1 + 0.1 * rng.normal()) * {2: 8, 12: 12, 20: 30, 21: 30}.get(i, 1)
        leaves = [rng.normal(0, scale, s) for s in SHAPES]
        if i == 25:
            leaves[1][2] = np.nan
        out.append(leaves)
    return out


def _runner(target, fn):
    return target.h._compiled(fn) if target.compiled else fn


ZCLIP_CONFIGS = {
    "defaults": {},
    "mean-unbounded": {"max_grad_norm": None, "clip_option": "mean"},
    "percentile-skip": {"mode": "percentile", "skip_update_on_spike": True, "max_grad_norm": 2.0},
    "scaled-0.7": {"clip_factor": 0.7, "alpha": 0.9, "warmup_steps": 0},
    # past float32's range: a bound the float32 norm never reaches (torch and TF raised)
    "bound-1e308": {"max_grad_norm": 1e308},
}


def test_zclip_follows_oracle_step_by_step(target):
    _check_zclip(target, "defaults", "float16")


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ("defaults", "float32"),
        ("defaults", "bfloat16"),
        ("percentile-skip", "float32"),
        ("mean-unbounded", "float32"),
        ("scaled-0.7", "float32"),
        ("bound-1e308", "float16"),
    ],
)
def test_zclip_follows_oracle_eagerly(eager_target, config, dtype):
    _check_zclip(eager_target, config, dtype)


def _check_zclip(target, config, dtype):
    h = target.h
    kwargs = dict(ZCLIP_CONFIGS[config], warmup_steps=ZCLIP_CONFIGS[config].get("warmup_steps", 5))
    zclip, ref = ZClip(**kwargs), oracle.ZClipOracle(**kwargs)
    step = _runner(target, lambda grads, state: zclip.update(grads, state))
    state = zclip.init([h.asarray(np.zeros(s), dtype) for s in SHAPES])
    clipped_steps = 0
    rtol, atol = GRADIENT[dtype]
    for i, values in enumerate(_script()):
        grads = [h.asarray(x, dtype) for x in values]
        seen = [h.numpy(g) for g in grads]
        out, state = step(grads, state)
        want, want_norm = ref.step(seen)
        got = [h.numpy(g) for g in out]
        assert [g.dtype for g in out] == [g.dtype for g in grads]
        np.testing.assert_allclose(h.numpy(state.norm), want_norm, rtol=1e-5)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"step {i}")
        if not np.isfinite(want_norm):  # untouched, NaN and all
            for g, s in zip(got, seen, strict=True):
                np.testing.assert_array_equal(g, s)
        clipped_steps += not all(np.array_equal(g, s) for g, s in zip(got, seen, strict=True))
        if ref.initialized:
            np.testing.assert_allclose(h.numpy(state.mean), ref.mean, rtol=1e-5)
            np.testing.assert_allclose(h.numpy(state.var), ref.var, rtol=1e-4, atol=1e-9)
        assert int(h.numpy(state.count)) == min(i + 1 - (i >= 25), max(kwargs["warmup_steps"], 1))
    assert ref.min_margin > 1e-3  # no borderline spike decision: float32 cannot flip one
    assert clipped_steps >= 3  # the spikes were clipped: the test can fail


AGC_SHAPES = [(), (7,), (1, 5), (6, 4), (3, 3, 2, 4), (2, 2, 1, 3, 4)]


def _agc_data(seed=0):
    """Gradients where some units sit well below and some well above 0.01 * |W|."""
    rng = np.random.default_rng(seed)
    params = [rng.normal(0, 1, s) for s in AGC_SHAPES]
    params[3][:, 1] = 0.0  # a zero-initialised unit: eps decides its limit
    grads = [rng.normal(0, 0.004, s) * rng.choice([0.1, 10.0], s) for s in AGC_SHAPES]
    return grads, params


def test_agc_matches_oracle(target):
    _check_agc(target, "float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_agc_matches_oracle_eagerly(eager_target, dtype):
    _check_agc(eager_target, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_agc_eps_past_float32_clips_nothing(target, dtype):
    """An eps past the compute dtype's range is clamped to it: every unit's limit is at least
    0.01 x float32's largest value, so these gradients pass unclipped, as in the float64
    oracle (torch and TF raised converting the eps)."""
    h = target.h
    grads_np, params_np = _agc_data()
    grads = [h.asarray(g, dtype) for g in grads_np]
    params = [h.asarray(p, "float32") for p in params_np]
    out = _runner(target, lambda g, p: AGC(0.01, eps=1e308).clip(g, p))(grads, params)
    seen = [h.numpy(g) for g in grads]
    assert all(
        np.array_equal(w, s)
        for w, s in zip(oracle.agc(seen, params_np, eps=1e308), seen, strict=True)
    )
    for got, s in zip(out, seen, strict=True):
        np.testing.assert_array_equal(h.numpy(got), s)


def _check_agc(target, dtype):
    h = target.h
    grads_np, params_np = _agc_data()
    grads = [h.asarray(g, dtype) for g in grads_np]
    params = [h.asarray(p, "float32") for p in params_np]
    out = _runner(target, lambda g, p: AGC().clip(g, p))(grads, params)
    seen = [h.numpy(g) for g in grads]
    want = oracle.agc(seen, [h.numpy(p) for p in params])
    rtol, atol = GRADIENT[dtype]
    unchanged = clipped = 0
    for got, w, s in zip(out, want, seen, strict=True):
        assert h.numpy(got).shape == s.shape
        np.testing.assert_allclose(h.numpy(got), w, rtol=rtol, atol=atol)
        same = w == s
        np.testing.assert_array_equal(h.numpy(got)[same], s[same])  # below the limit: exact
        unchanged, clipped = unchanged + same.sum(), clipped + (~same).sum()
    assert unchanged > 0 and clipped > 0


@pytest.mark.parametrize("layout", ["io", "oi"])
def test_agc_layouts_and_axis(eager_target, layout):
    target = eager_target
    h = target.h
    rng = np.random.default_rng(1)
    shapes = [(6, 4), (4, 3, 2, 2)]
    params_np = [rng.normal(0, 1, s) for s in shapes]
    grads_np = [rng.normal(0, 0.03, s) for s in shapes]
    grads = [h.asarray(g, "float32") for g in grads_np]
    params = [h.asarray(p, "float32") for p in params_np]
    out = _runner(target, lambda g, p: AGC(0.02, layout=layout).clip(g, p))(grads, params)
    want = oracle.agc([h.numpy(g) for g in grads], [h.numpy(p) for p in params], 0.02, 1e-3, layout)
    for got, w in zip(out, want, strict=True):
        np.testing.assert_allclose(h.numpy(got), w, rtol=2e-5, atol=1e-7)
    # axis= overrides the layout: axis 0 of the 2-D leaf is the "io" rule
    out = AGC(0.02, layout="oi", axis=0).clip(grads[:1], params[:1])
    want = oracle.agc([h.numpy(grads[0])], [h.numpy(params[0])], 0.02, 1e-3, "io")
    np.testing.assert_allclose(h.numpy(out[0]), want[0], rtol=2e-5, atol=1e-7)


SCHEDULES = [
    {"base_lr": 1e-3, "warmup_steps": 10, "total_steps": 100, "min_lr": 1e-5},
    {"base_lr": 0.5, "warmup_steps": 0, "total_steps": 20, "min_lr": 0.1},
    {"base_lr": 2.0, "warmup_steps": 5, "total_steps": 6, "warmup_start_lr": 0.3},
]


@pytest.mark.parametrize("config", SCHEDULES)
def test_warmup_cosine_schedule(target, config):
    _check_schedule(target, config, "int32")


@pytest.mark.parametrize("step_dtype", ["int64", "float32"])
def test_warmup_cosine_schedule_step_dtypes(eager_target, step_dtype):
    _check_schedule(eager_target, SCHEDULES[0], step_dtype)


def _check_schedule(target, config, step_dtype):
    h = target.h
    schedule = warmup_cosine_schedule(**config)
    steps = np.arange(-2, config["total_steps"] + 5)
    if target.name == "jax" and step_dtype == "int64":
        step_dtype = "int32"  # no int64 without x64
    got = _runner(target, schedule)(h.asarray(steps, step_dtype))
    want = [oracle.warmup_cosine(int(t), **config) for t in steps]
    np.testing.assert_allclose(h.numpy(got), want, rtol=1e-6, atol=1e-7 * config["base_lr"])
    assert "float32" in str(got.dtype)
    # a 0-d step, and a Python int (a float, no backend involved)
    scalar = _runner(target, schedule)(h.asarray(np.asarray(7), step_dtype))
    np.testing.assert_allclose(h.numpy(scalar), oracle.warmup_cosine(7, **config), rtol=1e-6)
    assert schedule(7) == pytest.approx(oracle.warmup_cosine(7, **config), rel=1e-13)


def test_errors_are_typed_and_name_the_argument(eager_target):
    h = eager_target.h
    grads = [h.asarray(np.ones((2, 3)), "float32")]
    with pytest.raises(InvalidArgumentError, match="params with the structure"):
        AGC().clip(grads, [])
    with pytest.raises(InvalidArgumentError, match="param shape"):
        AGC().clip(grads, [h.asarray(np.ones((3, 2)), "float32")])
    with pytest.raises(InvalidArgumentError, match="rank 1 to 5"):
        AGC().clip(
            [h.asarray(np.ones((2,) * 6), "float32")] * 2, [h.asarray(np.ones((2,) * 6))] * 2
        )
    with pytest.raises(InvalidArgumentError, match="floating-point grads"):
        AGC().clip([h.asarray(np.ones(3), "int32")], [h.asarray(np.ones(3), "float32")])
    zclip = ZClip()
    with pytest.raises(InvalidArgumentError, match="floating-point leaves"):
        zclip.update([h.asarray(np.ones(3), "int32")], zclip.init(grads))
    with pytest.raises(InvalidArgumentError, match="integer or floating dtype"):
        warmup_cosine_schedule(1.0, warmup_steps=1, total_steps=3)(h.asarray(np.array(True)))
