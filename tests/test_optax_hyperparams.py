"""optax.inject_hyperparams with numstab's zclip, agc and loss_scaled, as with optax's
own transformations: numeric hyperparameters become arrays in state.hyperparams (used in
array math, changeable there); settings that pick code or a shape are static."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numstab.errors import InvalidArgumentError
from numstab.integrations import optax as nso

PARAMS = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0], [2.0, 0.0]]), "b": jnp.array([0.1, -0.2])}
GRADS = {"w": jnp.array([[4.0, 1.0], [-3.0, 2.0], [1.0, -5.0]]), "b": jnp.array([2.0, 1.0])}
TOL = 8 * float(jnp.finfo(jnp.float32).eps)


def _close(a, b):
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(b))
    check = lambda x, y: np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL * scale)
    jax.tree.map(check, a, b)


def _run(tx, steps=3, jit=False, grads=GRADS):
    update = jax.jit(tx.update) if jit else tx.update
    state, out = tx.init(PARAMS), None
    for i in range(steps):
        out, state = update(jax.tree.map(lambda g, k=1 + i: g * k, grads), state, PARAMS)
    return out, state


CASES = {
    "agc": (nso.agc, {"clip_factor": 0.05, "eps": 1e-3}),
    "zclip": (nso.zclip, {"max_grad_norm": 3.0, "warmup_steps": 1, "z_thresh": 0.5}),
    "zclip defaults": (nso.zclip, {"max_grad_norm": 1.0}),
    # unscaled (by 2**16) the norms are ~1e-4: clipped to 1e-5
    "loss_scaled": (functools.partial(nso.loss_scaled, optax.sgd(1.0)), {"max_norm": 1e-5}),
    "loss_scaled, adam": (functools.partial(nso.loss_scaled, optax.adam(1e-2)), {}),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_injected_equals_plain(name, jit):
    make, kwargs = CASES[name]
    plain, _ = _run(make(**kwargs), jit=jit)
    injected, state = _run(optax.inject_hyperparams(make)(**kwargs), jit=jit)
    _close(injected, plain)
    for key in kwargs:
        if key != "warmup_steps":
            assert key in state.hyperparams


def test_agc_clip_factor_changed_in_state():
    tx = optax.inject_hyperparams(nso.agc)(clip_factor=0.01)
    state = tx.init(PARAMS)
    state.hyperparams["clip_factor"] = jnp.asarray(0.5)
    for update in (tx.update, jax.jit(tx.update)):
        out, _ = update(GRADS, state, PARAMS)
        _close(out, nso.agc(0.5).update(GRADS, (), PARAMS)[0])
        assert not np.allclose(out["w"], nso.agc(0.01).update(GRADS, (), PARAMS)[0]["w"])


def test_zclip_max_grad_norm_changed_in_state():
    tx = optax.inject_hyperparams(nso.zclip)(max_grad_norm=100.0)
    state = tx.init(PARAMS)
    state.hyperparams["max_grad_norm"] = jnp.asarray(0.5)
    for update in (tx.update, jax.jit(tx.update)):
        out, _ = update(GRADS, state, PARAMS)  # warmup: clipped to max_grad_norm
        norm = optax.global_norm(out)
        assert abs(float(norm) - 0.5) < 1e-5, float(norm)


def test_loss_scaled_max_norm_changed_in_state():
    tx = optax.inject_hyperparams(nso.loss_scaled)(optax.sgd(1.0), max_norm=1e9)
    state = tx.init(PARAMS)
    state.hyperparams["max_norm"] = jnp.asarray(1e-6)  # gradients are scaled by 2**16
    for update in (tx.update, jax.jit(tx.update)):
        out, new = update(GRADS, state, PARAMS)
        assert abs(float(optax.global_norm(out)) - 1e-6) < 1e-6 * TOL * 4
        assert new.inner_state.grad_norm.dtype == jnp.float32


def test_static_settings_name_static_args():
    """Traced settings that pick code or a shape raise a typed error naming static_args."""
    tx = optax.inject_hyperparams(nso.loss_scaled)(optax.sgd(1.0), max_norm=1.0, norm_type=1.0)
    state = tx.init(PARAMS)  # readable: accepted
    with pytest.raises(InvalidArgumentError, match=r"norm_type.*static_args=\('norm_type',\)"):
        jax.jit(tx.update)(GRADS, state, PARAMS)
    fixed = optax.inject_hyperparams(nso.loss_scaled, static_args=("norm_type",))
    tx = fixed(optax.sgd(1.0), max_norm=1.0, norm_type=1.0)
    _close(jax.jit(tx.update)(GRADS, tx.init(PARAMS), PARAMS)[0], _run_l1())
    tx = optax.inject_hyperparams(nso.agc)(axis=0)
    with pytest.raises(InvalidArgumentError, match=r"axis.*static_args=\('axis',\)"):
        jax.jit(tx.update)(GRADS, tx.init(PARAMS), PARAMS)


def _run_l1():
    tx = nso.loss_scaled(optax.sgd(1.0), max_norm=1.0, norm_type=1.0)
    return tx.update(GRADS, tx.init(PARAMS), PARAMS)[0]


def test_zclip_warmup_steps_is_fixed_by_the_state():
    tx = optax.inject_hyperparams(nso.zclip)(warmup_steps=3)
    state = tx.init(PARAMS)
    assert state.inner_state.buffer.shape == (3,)
    state.hyperparams["warmup_steps"] = jnp.asarray(5)
    with pytest.raises(InvalidArgumentError, match="warmup_steps"):
        tx.update(GRADS, state, PARAMS)


def test_zclip_signature_is_zclips():
    import inspect

    from numstab.adaptive_clipping import ZClip

    ours = dict(inspect.signature(nso.zclip).parameters)
    assert ours.pop("axis_name").kind is inspect.Parameter.KEYWORD_ONLY  # the optax extra
    theirs = inspect.signature(ZClip).parameters
    assert [(n, p.default) for n, p in ours.items()] == [(n, p.default) for n, p in theirs.items()]
