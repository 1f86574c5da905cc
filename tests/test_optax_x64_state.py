"""Every numstab optax transformation keeps each state leaf's dtype and shape through
``update``, in x64 and default mode: a leaf that changes dtype breaks ``lax.scan`` and
recompiles a jitted loop. x64 is switched on only inside ``jax.enable_x64`` blocks."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest

import numstab
from numstab.integrations import optax as nso


def _schedule():
    return numstab.warmup_cosine_schedule(1e-3, warmup_steps=2, total_steps=10).for_optax()


TRANSFORMS = {
    "loss_scaled": lambda: nso.loss_scaled(optax.sgd(0.1)),
    "loss_scaled max_norm": lambda: nso.loss_scaled(optax.sgd(0.1), max_norm=1.0),
    "loss_scaled max_norm inf": lambda: nso.loss_scaled(
        optax.adam(0.1), max_norm=1.0, norm_type=math.inf
    ),
    "loss_scaled max_norm p=3": lambda: nso.loss_scaled(optax.adam(0.1), max_norm=1.0, norm_type=3),
    "zclip": lambda: nso.zclip(warmup_steps=1),
    "agc": lambda: nso.agc(),
    "chain with schedule": lambda: nso.loss_scaled(
        optax.chain(nso.zclip(warmup_steps=1), nso.agc(), optax.adamw(_schedule())), max_norm=1.0
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(nso.loss_scaled)(
        optax.inject_hyperparams(optax.adam)(learning_rate=_schedule()), max_norm=1.0
    ),
}


def _same_types(before, after):
    same = jax.tree.map(lambda a, b: (a.dtype, a.shape) == (b.dtype, b.shape), before, after)
    return all(jax.tree.leaves(same))


def _params(dtype):
    return {"w": jnp.ones((3, 2), dtype), "b": jnp.full((2,), 0.5, dtype)}


@pytest.mark.parametrize("x64, dtype", [(True, "float64"), (True, "float32"), (False, "float32")])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_update_keeps_state_dtypes_and_shapes(name, x64, dtype):
    with jax.enable_x64(x64):
        tx, params = TRANSFORMS[name](), _params(dtype)
        grads = jax.tree.map(lambda p: p * 3, params)
        state = tx.init(params)
        for _ in range(2):  # zclip's warmup, then its active step
            _, new_state = tx.update(grads, state, params)
            assert _same_types(state, new_state), (state, new_state)
            state = new_state
        jitted = jax.jit(tx.update)(grads, state, params)[1]
        assert _same_types(state, jitted)


def test_guard_step_keeps_state_dtypes_under_x64():
    with jax.enable_x64(True):
        params = _params("float64")
        grads = jax.tree.map(lambda p: p * 3, params)
        tx = nso.loss_scaled(optax.adam(1e-3), max_norm=1.0)
        og = numstab.TrainingGuard().for_optax()
        opt_state = tx.init(params)
        gstate = og.init(params, opt_state, packed=False)
        out = og.step(tx, params, opt_state, gstate, jnp.asarray(1.0), grads)
        assert _same_types((params, opt_state, gstate), out[:3])


@pytest.mark.parametrize("x64", [True, False])
def test_scan_over_loss_scaled_with_max_norm(x64):
    """The audit's repro: lax.scan raised 'the input carry ... float32 ... float64'."""
    with jax.enable_x64(x64):
        params = {"w": jnp.ones(3)}
        tx = nso.loss_scaled(optax.sgd(0.1), max_norm=1.0)

        def body(carry, _):
            p, s = carry
            u, s = tx.update(p, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, s), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=3)
        assert s.grad_norm.dtype == jnp.float32
        carry = (params, tx.init(params))
        for _ in range(3):  # the same steps, one by one
            carry = body(carry, None)[0]
        eps = float(jnp.finfo(p["w"].dtype).eps)
        assert jnp.allclose(p["w"], carry[0]["w"], rtol=4 * eps, atol=0)
        assert jnp.array_equal(s.loss_scale.scale, carry[1].loss_scale.scale)
