"""Every state numstab makes can be donated to a jitted step (``donate_argnums``, Equinox's
``donate="all"``, ``nnx.jit(donate_argnums=...)``): no two of its leaves share one buffer.
Before, ``ZClip.init`` gave ``mean``, ``var`` and ``norm`` one array, so a donated step holding
``zclip()`` failed on its first call ("Attempt to donate the same buffer twice"), and crashed
the process with the state sharded over four devices."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import numstab as ns  # noqa: E402
from numstab.integrations.optax import agc, loss_scaled, zclip  # noqa: E402

PARAMS = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}


def _optax_states():
    return {
        "zclip": zclip(warmup_steps=2),
        "agc": agc(),
        "loss_scaled(zclip, adam)": loss_scaled(
            optax.chain(zclip(), optax.adam(1e-3)), ns.LossScaler(), max_norm=1.0
        ),
        "inject_hyperparams(zclip)": optax.inject_hyperparams(zclip)(alpha=0.9),
    }


def _buffers(tree):
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.parametrize("name", list(_optax_states()))
def test_no_two_leaves_of_an_optax_state_share_a_buffer(name):
    pointers = _buffers(_optax_states()[name].init(PARAMS))
    assert len(pointers) == len(set(pointers)), name


def test_no_two_leaves_of_the_functional_states_share_a_buffer():
    states = {
        "ZClip": ns.ZClip().init(PARAMS),
        "LossScaler": ns.LossScaler().init(backend="jax"),
        "TrainingGuard": ns.TrainingGuard().init_state("jax"),
    }
    for name, state in states.items():
        pointers = _buffers(state)
        assert len(pointers) == len(set(pointers)), name


@pytest.mark.parametrize("name", list(_optax_states()))
def test_a_donated_step_runs_and_equals_the_undonated_one(name):
    tx = _optax_states()[name]
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), PARAMS)

    def step(params, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    plain, donated = jax.jit(step), jax.jit(step, donate_argnums=(0, 1))
    want = (PARAMS, tx.init(PARAMS))
    got = (jax.tree.map(jnp.copy, PARAMS), tx.init(PARAMS))
    for _ in range(3):  # past zclip's warmup of 2
        want, got = plain(*want), donated(*got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
