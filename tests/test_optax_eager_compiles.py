"""Eager (un-jitted) updates of numstab's optax transformations compile nothing after the
first: loss_scaled's lax.cond got new closures every call and compiled every update."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numstab.integrations import optax as nso

_COMPILES = []


def _listener(event, duration, **kwargs):
    if "backend_compile" in event:
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_listener)

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64), "b": jnp.ones(64)}

TRANSFORMS = {
    "loss_scaled": lambda: nso.loss_scaled(optax.adam(1e-3)),
    "loss_scaled max_norm": lambda: nso.loss_scaled(optax.adam(1e-3), max_norm=1.0),
    "zclip": lambda: nso.zclip(warmup_steps=2),
    "agc": lambda: nso.agc(),
    "inject loss_scaled": lambda: optax.inject_hyperparams(nso.loss_scaled)(
        optax.adam(1e-3), max_norm=1.0
    ),
    "inject zclip": lambda: optax.inject_hyperparams(nso.zclip)(warmup_steps=2),
    "inject agc": lambda: optax.inject_hyperparams(nso.agc)(),
    "loss_scaled chain": lambda: nso.loss_scaled(
        optax.chain(nso.zclip(warmup_steps=2), nso.agc(), optax.adam(1e-3)), max_norm=1.0
    ),
}


def _grads(i):
    return jax.tree.map(lambda p: p * (100.0 + i), PARAMS)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_repeated_eager_updates_compile_nothing_and_match_jit(name):
    tx = TRANSFORMS[name]()
    state = tx.init(PARAMS)
    jitted = jax.jit(tx.update)
    jit_state = state
    for i in range(2):  # warm up: the first calls compile (zclip's warmup and active step)
        out, state = tx.update(_grads(i), state, PARAMS)
        jit_out, jit_state = jitted(_grads(i), jit_state, PARAMS)
    before = len(_COMPILES)
    for i in range(2, 6):
        out, state = tx.update(_grads(i), state, PARAMS)
    assert len(_COMPILES) == before, _COMPILES[before:]
    for i in range(2, 6):
        jit_out, jit_state = jitted(_grads(i), jit_state, PARAMS)
    tol = 8 * float(jnp.finfo(jnp.float32).eps)
    for a, b in zip(
        jax.tree.leaves((out, state)), jax.tree.leaves((jit_out, jit_state)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_eager_update_on_a_whole_equinox_model():
    """Non-array leaves of params (the activation) are static to the cached jit."""
    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    loss = lambda m, k: jnp.sum(m(jnp.full(4, k)) ** 2) * 2.0**16
    tx = nso.loss_scaled(optax.adam(1e-3), max_norm=1.0)
    state = tx.init(eqx.filter(model, eqx.is_array))
    for k in range(2):
        _, state = tx.update(eqx.filter_grad(loss)(model, 1.0 + k), state, model)
    grads = eqx.filter_grad(loss)(model, 3.0)
    before = len(_COMPILES)
    tx.update(grads, state, model)
    assert len(_COMPILES) == before
