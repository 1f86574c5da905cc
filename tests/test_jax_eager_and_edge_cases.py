"""JAX: eager fused cross-entropy compiled once per settings and shapes, ZClip's masked 0/0
under check_numerics, and optax-adapter steps past int32."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

jax = pytest.importorskip("jax")
jnp = jax.numpy
EPS32 = float(np.finfo(np.float32).eps)


def _compiles():
    """A list that collects every XLA compilation while the returned context is open."""
    import contextlib

    import jax.monitoring

    compiles: list[float] = []

    def count(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    @contextlib.contextmanager
    def listening():
        jax.monitoring.register_event_duration_secs_listener(count)
        try:
            yield compiles
        finally:
            jax.monitoring.unregister_event_duration_listener(count)

    return listening()


def _fused_data(rows=37, width=16, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(vocab, width)) * 0.3, jnp.float32)
    b = jnp.asarray(rng.normal(size=(vocab,)), jnp.float32)
    y = jnp.asarray(rng.integers(0, vocab, rows)).at[3].set(-100)
    return h, w, b, y


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_size": 8},
        {"chunk_size": 5, "label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"},
        {"chunk_size": 4, "reduction": "none"},
    ],
)
def test_eager_fused_cross_entropy_compiles_once(kwargs):
    """Eager calls (and jax.grad without jit) with the same settings and shapes reuse one
    compiled call: each built a new lax.scan body and compiled it again (~0.1-0.5 s a call).
    Values and gradients equal the jitted call's."""
    h, w, b, y = _fused_data()

    def loss(h, w, b):
        return jnp.sum(ns.fused_linear_cross_entropy(h, w, y, bias=b, **kwargs))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    first, first_grads = loss(h, w, b), grad(h, w, b)  # compiles
    h2, w2, b2, _ = _fused_data(seed=1)  # other values, same shapes
    with _compiles() as compiles:
        again = loss(h2, w2, b2)
        again_grads = grad(h2, w2, b2)
    assert compiles == []
    want, want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(h2, w2, b2)
    np.testing.assert_allclose(again, want, rtol=16 * EPS32)
    for g, g_want in zip(again_grads, want_grads, strict=True):
        scale = float(np.abs(g_want).max())
        np.testing.assert_allclose(g, g_want, rtol=16 * EPS32, atol=16 * EPS32 * scale)
    assert np.isfinite(first) and all(np.isfinite(g).all() for g in first_grads)


def test_eager_fused_cross_entropy_recompiles_for_other_settings():
    """The cache is keyed on the settings: another chunk size or smoothing is its own call."""
    h, w, _, y = _fused_data()
    a = ns.fused_linear_cross_entropy(h, w, y, chunk_size=8)
    for settings in ({"chunk_size": 8, "label_smoothing": 0.5}, {"chunk_size": 37}):
        with _compiles() as compiles:  # a cache that ignored a setting would reuse a's
            out = ns.fused_linear_cross_entropy(h, w, y, **settings)
        assert compiles, settings
    b = ns.fused_linear_cross_entropy(h, w, y, chunk_size=8, label_smoothing=0.5)
    c = ns.fused_linear_cross_entropy(h, w, y, chunk_size=37)
    np.testing.assert_array_equal(out, c)
    want = ns.cross_entropy(h @ w.T, y)
    np.testing.assert_allclose(a, want, rtol=16 * EPS32)
    np.testing.assert_allclose(c, want, rtol=16 * EPS32)
    np.testing.assert_allclose(
        b, ns.cross_entropy(h @ w.T, y, label_smoothing=0.5), rtol=16 * EPS32
    )


@pytest.mark.parametrize("compiled", [False, True])
def test_zclip_all_zero_gradients_pass_check_numerics(compiled):
    """All-zero gradients: z = 0 and std = 0 made the (unused) spike threshold a 0/0, which
    jax_debug_nans reported eagerly although a where discarded it."""
    zclip = ns.ZClip(warmup_steps=2)
    zeros = {"a": jnp.zeros((3, 3)), "b": jnp.zeros(4)}
    update = jax.jit(zclip.update) if compiled else zclip.update
    state = zclip.init(zeros)
    with ns.check_numerics():
        for _ in range(4):  # warmup, then active with mean = var = 0
            out, state = update(zeros, state)
    assert all(np.all(np.asarray(x) == 0.0) for x in jax.tree.leaves(out))
    assert float(state.mean) == 0.0 and float(state.var) == 0.0


def test_zclip_spike_threshold_is_unchanged():
    """The spike threshold still follows zclip's formula, computed here in float32 NumPy in
    the same order: clip_factor * (mean + z_thresh * std / (z / z_thresh))."""
    zclip = ns.ZClip(warmup_steps=3, clip_factor=0.7, max_grad_norm=None)
    state = zclip.init({"a": jnp.ones(2)})
    for norm in (1.0, 2.0, 1.5):
        _, state = zclip.update({"a": jnp.asarray([norm, 0.0])}, state)
    mean, var = np.float32(state.mean), np.float32(state.var)
    g = np.float32(40.0)
    with ns.check_numerics():
        out, _ = zclip.update({"a": jnp.asarray([g, 0.0])}, state)
    std = np.sqrt(var)
    z = (g - mean) / (std + np.float32(zclip.eps))
    t = np.float32(zclip.z_thresh)
    threshold = (mean + (t * std) / (z / t)) * np.float32(0.7)
    np.testing.assert_allclose(
        out["a"][0], g * (threshold / (g + np.float32(1e-6))), rtol=4 * EPS32
    )


@pytest.mark.parametrize(
    "step", [2**31, 2**40, 10**400, np.int64(2**40)], ids=["2^31", "2^40", "10^400", "int64"]
)
def test_optax_adapter_takes_python_int_steps_past_int32(step):
    """A Python int step past int32 raised OverflowError from jnp.asarray; every step past
    total_steps is the end value, as optax's own schedule at its last representable step."""
    optax = pytest.importorskip("optax")
    sched = ns.warmup_cosine_schedule(1e-3, warmup_steps=10, total_steps=100, min_lr=1e-5)
    ref = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100, 1e-5)
    got = sched.for_optax()(step)
    assert got.dtype == jnp.float32
    assert float(got) == float(ref(2**31 - 1)) == float(ref(100))
    assert float(sched.for_optax()(-(2**40))) == float(ref(-1)) == 0.0
