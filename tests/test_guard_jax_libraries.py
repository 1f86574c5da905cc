"""The training guard and loss scaling inside Equinox's and Flax NNX's own training steps
(eqx.filter_jit + filter_value_and_grad; nnx.jit + nnx.value_and_grad, nnx.Optimizer). A NaN
batch at step 3 ends an unguarded run with NaN weights; guarded, that step is skipped."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import numstab as ns  # noqa: E402
from numstab.frameworks.jax.guard import guarded_step  # noqa: E402
from numstab.integrations.optax import loss_scaled, scale_loss  # noqa: E402

GUARD = ns.TrainingGuard(snapshot_every=1000)
TX = optax.adam(1e-2)
X = jax.random.normal(jax.random.PRNGKey(1), (6, 8, 4))
Y = jnp.sum(X, -1, keepdims=True)
X = X.at[3, 0, 0].set(jnp.nan)  # the poisoned batch


def _finite(tree) -> bool:
    return all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


def test_equinox_filter_jit_step():
    eqx = pytest.importorskip("equinox")

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @eqx.filter_jit
    def plain_step(model, opt, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        updates, opt = TX.update(grads, opt, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt

    @eqx.filter_jit
    def guarded(model, opt, gstate, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        params, static = eqx.partition(model, eqx.is_array)
        params, opt, gstate, decision = guarded_step(GUARD, TX, params, opt, gstate, loss, grads)
        return eqx.combine(params, static), opt, gstate, decision

    model = eqx.nn.MLP(4, 1, 8, 2, key=jax.random.PRNGKey(0))
    plain, opt = model, TX.init(eqx.filter(model, eqx.is_array))
    for x, y in zip(X, Y, strict=True):
        plain, opt = plain_step(plain, opt, x, y)
    assert not _finite(eqx.filter(plain, eqx.is_array))  # the test can fail

    og = GUARD.for_optax()
    params = eqx.filter(model, eqx.is_array)
    opt = TX.init(params)
    gstate = og.init(params, opt)
    applied = []
    for x, y in zip(X, Y, strict=True):
        model, opt, gstate, decision = guarded(model, opt, gstate, x, y)
        params, opt, gstate = og.after_step(decision, eqx.filter(model, eqx.is_array), opt, gstate)
        model = eqx.combine(params, eqx.filter(model, eqx.is_array, inverse=True))
        applied.append(bool(decision.apply))
    assert applied == [True, True, True, False, True, True]
    assert _finite(eqx.filter(model, eqx.is_array))


def test_nnx_jit_step_and_optimizer_with_loss_scaling():
    nnx = pytest.importorskip("flax.nnx")

    def make():
        return nnx.Sequential(
            nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(8, 1, rngs=nnx.Rngs(1))
        )

    @nnx.jit
    def guarded(model, opt, gstate, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        params = nnx.state(model, nnx.Param)
        params, opt, gstate, decision = guarded_step(GUARD, TX, params, opt, gstate, loss, grads)
        nnx.update(model, params)
        return opt, gstate, decision

    model = make()
    og = GUARD.for_optax()
    opt = TX.init(nnx.state(model, nnx.Param))
    gstate = og.init(nnx.state(model, nnx.Param), opt)
    skipped = []
    for x, y in zip(X, Y, strict=True):
        opt, gstate, decision = guarded(model, opt, gstate, x, y)
        params, opt, gstate = og.after_step(decision, nnx.state(model, nnx.Param), opt, gstate)
        nnx.update(model, params)
        skipped.append(decision.reason_names)
    assert skipped[3] == ["nonfinite_loss", "nonfinite_grad"] and skipped.count([]) == 5
    assert _finite(nnx.state(model, nnx.Param))

    # nnx.Optimizer over numstab's loss-scaled optax chain: the NaN step is dropped there
    for scaled in (False, True):
        model = make()
        tx = loss_scaled(optax.adam(1e-2), ns.LossScaler(init_scale=2.0**10)) if scaled else TX
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, x, y, scaled=scaled):
            def loss_fn(m):
                loss = jnp.mean((m(x) - y) ** 2)
                return scale_loss(loss, optimizer.opt_state) if scaled else loss

            optimizer.update(model, nnx.grad(loss_fn)(model))

        for x, y in zip(X, Y, strict=True):
            step(model, optimizer, x, y)
        assert _finite(nnx.state(model, nnx.Param)) is scaled


@pytest.mark.parametrize("library", ["equinox", "nnx"])
def test_check_numerics_inside_the_libraries_jitted_steps(library):
    x = jnp.ones((3, 4)).at[0, 0].set(jnp.nan)
    if library == "equinox":
        eqx = pytest.importorskip("equinox")
        model = eqx.nn.MLP(4, 1, 8, 2, key=jax.random.PRNGKey(0))
        step = eqx.filter_jit(lambda m, x: jnp.sum(jax.vmap(m)(x)))
    else:
        nnx = pytest.importorskip("flax.nnx")
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        step = nnx.jit(lambda m, x: jnp.sum(m(x)))
    assert jnp.isnan(step(model, x))  # unchecked: a silent NaN
    with pytest.raises(ns.NonFiniteError, match="forward"), ns.check_numerics(backend="jax"):
        step(model, x)


def test_loss_scaled_takes_the_whole_equinox_model_as_params():
    """optax's own transformations take ``update(grads, state, model)``; loss_scaled raised
    "Expected gradients with the structure of params" (filter_grad's None where the model
    holds a function), and numstab's trees read an Equinox module's static int fields as
    leaves ("Expected floating-point gradients ... dtype=int32")."""
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 1, 8, 2, key=jax.random.PRNGKey(0))
    x = jnp.ones((5, 4))
    tx = loss_scaled(optax.adam(1e-3))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    loss = lambda m: scale_loss(jnp.mean(jax.vmap(m)(x) ** 2), opt_state)
    grads = eqx.filter_grad(loss)(model)
    updates, opt_state = tx.update(grads, opt_state, model)
    stepped = eqx.apply_updates(model, updates)
    assert bool(opt_state.last_finite)
    assert not jnp.array_equal(stepped.layers[0].weight, model.layers[0].weight)
