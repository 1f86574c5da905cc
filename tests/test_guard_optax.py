"""numstab.guard in a functional optax loop: the decision under jit, actions outside; a NaN at
step k kills an unguarded run and not a guarded one; rollback; the LR factor; jax == numpy."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

from numstab.backends import load_backend  # noqa: E402
from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.frameworks.jax.guard import guarded_step  # noqa: E402
from numstab.guard import SpikeDetector, TrainingGuard  # noqa: E402

STEPS, BATCH = 150, 32
X = jax.random.normal(jax.random.PRNGKey(0), (256, 8))
Y = X @ jax.random.normal(jax.random.PRNGKey(1), (8, 1))
Y = Y + 0.1 * jax.random.normal(jax.random.PRNGKey(2), (256, 1))
TX = optax.adam(0.05)


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    return {
        "l1": {"w": jax.random.normal(k1, (8, 16)) * 0.3, "b": jnp.zeros(16)},
        "l2": {"w": jax.random.normal(k2, (16, 1)) * 0.3, "b": jnp.zeros(1)},
    }


def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    return jnp.mean((h @ p["l2"]["w"] + p["l2"]["b"] - y) ** 2)


@jax.jit
def plain_step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


# the guard config is hashable: a static argument, so every test shares one compilation
GUARD = TrainingGuard(snapshot_every=10, rollback_after=3)


@functools.partial(jax.jit, static_argnums=0)
def step_fn(guard, params, opt_state, gstate, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return guarded_step(guard, TX, params, opt_state, gstate, loss, grads)


def batch(step, nan_steps=()):
    i = (step % 8) * BATCH
    x = X[i : i + BATCH]
    return (x.at[0, 0].set(jnp.nan) if step in nan_steps else x), Y[i : i + BATCH]


def train(guard=None, nan_steps=(), steps=STEPS, on_step=None):
    params, opt_state = init_params(), TX.init(init_params())
    og = guard.for_optax() if guard is not None else None
    if og is not None:
        gstate = og.init(params, opt_state)

    for step in range(steps):
        x, y = batch(step, nan_steps)
        if og is None:
            params, opt_state = plain_step(params, opt_state, x, y)
            continue
        if og.skip_batch():
            continue
        params, opt_state, gstate, decision = step_fn(guard, params, opt_state, gstate, x, y)
        params, opt_state, gstate = og.after_step(decision, params, opt_state, gstate)
        if on_step is not None:
            on_step(step, params, opt_state, gstate)
    finite = all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(params))
    return float(loss_fn(params, X, Y)), finite, og


def test_nan_at_step_k_kills_the_plain_loop_and_the_guard_survives_it():
    clean, clean_finite, _ = train()
    dead, dead_finite, _ = train(nan_steps={40})
    kept, finite, og = train(GUARD, nan_steps={40})
    assert clean_finite and math.isfinite(clean)
    assert not dead_finite and math.isnan(dead)
    assert finite and abs(kept - clean) <= 0.05 * clean, (kept, clean)
    assert [(e["event"], e["step"]) for e in og.events if e["event"] != "snapshot"] == [
        ("skip", 40)
    ]
    h = og.history.as_arrays()
    assert h["layer_norms"].shape == (STEPS, 4)
    assert h["names"] == ["['l1']['b']", "['l1']['w']", "['l2']['b']", "['l2']['w']"]


def test_rollback_restores_params_and_state_and_scales_updates():
    seen = {}

    def on_step(step, params, opt_state, gstate):
        if step == 19:
            seen["params"], seen["opt"] = params, opt_state
        if step == 22:
            seen["after"], seen["opt_after"], seen["gstate"] = params, opt_state, gstate

    final, finite, og = train(GUARD, nan_steps={20, 21, 22}, steps=30, on_step=on_step)
    for a, b in zip(jax.tree.leaves(seen["params"]), jax.tree.leaves(seen["after"]), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(seen["opt"]), jax.tree.leaves(seen["opt_after"]), strict=True):
        np.testing.assert_array_equal(a, b)  # Adam's count and moments included
    assert float(seen["gstate"].lr_factor) == 0.5
    assert finite and math.isfinite(final)
    rollback = next(e for e in og.events if e["event"] == "rollback")
    assert rollback["step"] == 22 and rollback["to_step"] == 20

    # the factor halves the applied update, inside jit, exactly
    params, opt_state = init_params(), TX.init(init_params())
    gstate = GUARD.for_optax().init(params, opt_state)
    x, y = batch(0)
    full = step_fn(GUARD, params, opt_state, gstate, x, y)[0]
    half = step_fn(GUARD, params, opt_state, gstate._replace(lr_factor=jnp.float32(0.5)), x, y)[0]
    for p, f, h in zip(*map(jax.tree.leaves, (params, full, half)), strict=True):
        # updates read back from float32 params: f and h each rounded to an ulp of p
        atol = float(np.finfo(np.float32).eps) * np.abs(np.asarray(p)).max()
        np.testing.assert_allclose(h - p, 0.5 * (f - p), rtol=1e-5, atol=atol)


def test_jitted_decision_equals_the_numpy_one():
    guard = TrainingGuard(
        loss_spikes=SpikeDetector(window=16, sigma=3.0, warmup=6),
        grad_norm_spikes=SpikeDetector(window=16, sigma=3.0, warmup=6, two_sided=True),
        rollback_after=3,
        rollback_window=5,
        snapshot_every=4,
    )
    rng = np.random.default_rng(0)
    losses = (2.0 + 0.1 * rng.standard_normal(40)).astype(np.float32)
    norms = (1.0 + 0.05 * rng.standard_normal(40)).astype(np.float32)
    losses[[12, 25, 26, 27]] = [9.0, np.nan, 7.0, np.inf]
    norms[[18, 30]] = [0.0, 50.0]
    decide = jax.jit(lambda s, loss, n: guard.decide(s, loss, n, be="jax"))
    s_np, s_jax = guard.init_state("numpy"), guard.init_state("jax")
    for loss, norm in zip(losses, norms, strict=True):
        d_np, s_np = guard.decide(s_np, loss, norm)
        d_jax, s_jax = decide(s_jax, jnp.float32(loss), jnp.float32(norm))
        for field in ("apply", "rollback", "snapshot", "reasons", "step"):
            assert getattr(d_np, field) == getattr(d_jax, field), field
        np.testing.assert_allclose(d_np.loss_z, d_jax.loss_z, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(d_np.grad_norm_z, d_jax.grad_norm_z, rtol=1e-4, atol=1e-4)
    assert load_backend("jax").name == "jax"


def test_optax_bad_arguments():
    og = TrainingGuard().for_optax()
    with pytest.raises(InvalidArgumentError, match="init"):
        og.skip_batch()
    params = init_params()
    with pytest.raises(InvalidArgumentError, match=r"packed to be None or a bool.*'yes'"):
        og.init(params, TX.init(params), packed="yes")
    assert og.runner is None  # rejected before it started
    # JAX's "Error interpreting argument to copy_tree as an abstract array" before
    with pytest.raises(InvalidArgumentError, match=r"a leaf of type custom_jvp at params\['act'\]"):
        og.init({**params, "act": jax.nn.relu}, TX.init(params))
    assert og.runner is None
    gstate = og.init(params, TX.init(params))
    with pytest.raises(InvalidArgumentError, match="decision of type dict"):  # AttributeError
        og.after_step({"apply": True}, params, TX.init(params), gstate)
    grads = jax.tree.map(jnp.zeros_like, params)
    with pytest.raises(InvalidArgumentError, match=r"loss to be a scalar \(one element\)"):
        og.check(gstate, jnp.ones(2), grads)
    # the rule of TrainingGuard.decide and the torch guard: JAX's TypeError / ValueError for
    # a string or None, a complex loss's imaginary part dropped, a bool taken as a number
    for loss in ("x", None, jnp.complex64(1 + 1j), jnp.bool_(True)):
        with pytest.raises(InvalidArgumentError, match="Expected loss"):
            og.check(gstate, loss, grads)
    assert bool(og.check(gstate, jnp.ones(1), grads)[0].apply)  # one element: as decide
    with pytest.raises(InvalidArgumentError, match="floating-point gradients"):
        og.check(gstate, 1.0, {"w": "x"})  # JAX's TypeError before
    # a state of a guard with other settings: JAX's "Incompatible shapes" before
    other = TrainingGuard(rollback_window=4, rollback_after=2).for_optax()
    with pytest.raises(InvalidArgumentError, match=r"gstate\.bad_flags of shape \(16,\)"):
        og.check(other.init(params, TX.init(params)), 1.0, grads)
    with pytest.raises(InvalidArgumentError, match="gstate to be a GuardState"):
        og.check(None, 1.0, grads)
    with pytest.raises(InvalidArgumentError, match="floating-point gradients"):
        og.check(gstate, jnp.float32(1), {"w": jnp.ones(2, jnp.int32)})
