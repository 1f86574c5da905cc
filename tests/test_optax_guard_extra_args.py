"""``og.step`` / ``guarded_step`` forward optax's extra arguments (``value=`` of
``optax.contrib.reduce_on_plateau``, line searches: ``GradientTransformationExtraArgs``) to
``tx.update``. Before, they called ``tx.update(grads, opt_state, params)``: ``TypeError: ...
missing 1 required keyword-only argument: 'value'``."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytest.importorskip("optax.contrib")
import jax.numpy as jnp  # noqa: E402

import numstab as ns  # noqa: E402
from numstab.frameworks.jax.guard import guarded_step  # noqa: E402

PARAMS = {"w": jnp.ones(3)}
GRADS = {"w": jnp.array([0.1, -0.2, 0.3])}


def plateau():
    return optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=2))


def start(tx, guard=None):
    og = (guard or ns.TrainingGuard()).for_optax()
    opt_state = tx.init(PARAMS)
    return og, opt_state, og.init(PARAMS, opt_state)


@pytest.mark.parametrize("how", ["og.step", "guarded_step under jit"])
def test_value_reaches_reduce_on_plateau(how):
    tx = plateau()
    guard = ns.TrainingGuard()
    og, opt_state, gstate = start(tx, guard)
    params, want_params, want_opt = PARAMS, PARAMS, opt_state
    step = og.step
    if how != "og.step":
        step = jax.jit(lambda *a, value: guarded_step(guard, tx, *a, value=value))
    for loss in [2.0, 2.0, 2.0, 2.0, 2.0]:  # a plateau: the scale drops after patience
        loss = jnp.float32(loss)
        args = (params, opt_state, gstate, loss, GRADS)
        params, opt_state, gstate, d = (
            step(*args, value=loss) if how != "og.step" else (step(tx, *args, value=loss))
        )
        assert bool(d.apply)
        updates, want_opt = tx.update(GRADS, want_opt, want_params, value=loss)
        want_params = optax.apply_updates(want_params, updates)
        # the same float32 ops (fused by XLA under jit): a few ulps on each of 5 steps
        np.testing.assert_allclose(params["w"], want_params["w"], rtol=1e-6)
    for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(want_opt), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(opt_state[1].scale) < 1.0  # the plateau was seen through value=


def test_extra_args_reach_a_plain_transformation_harmlessly():
    tx = optax.sgd(0.1)  # no extra arguments: ignored, as optax.chain does
    og, opt_state, gstate = start(tx)
    params, *_ = og.step(tx, PARAMS, opt_state, gstate, jnp.float32(1.0), GRADS, value=1.0)
    np.testing.assert_allclose(params["w"], [0.99, 1.02, 0.97], rtol=1e-6)


@pytest.mark.parametrize("name", ["params", "state", "updates"])
def test_extra_args_named_as_update_own_arguments_are_refused(name):
    tx = plateau()
    og, opt_state, gstate = start(tx)
    with pytest.raises(ns.InvalidArgumentError, match=rf"extra argument\(s\) \['{name}'\]"):
        og.step(tx, PARAMS, opt_state, gstate, jnp.float32(1.0), GRADS, **{name: PARAMS})


def test_guard_arguments_are_positional_so_extra_names_cannot_collide():
    """An optax extra argument may share a name with the guard's own (``loss``, ``grads``):
    the guard's are positional only, so every keyword goes to ``tx.update``."""
    seen = {}

    def update(updates, state, params=None, *, loss, grads):
        seen.update(loss=loss, grads=grads)
        return updates, state

    tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    og, opt_state, gstate = start(tx)
    og.step(tx, PARAMS, opt_state, gstate, jnp.float32(1.0), GRADS, loss=7.0, grads="g")
    assert seen == {"loss": 7.0, "grads": "g"}
