"""The optax guard with None gradients where params hold arrays: Equinox's
``filter_value_and_grad`` gives None for an integer array the model holds, while
``eqx.filter(model, eqx.is_array)`` keeps it in params. Before, ``og.step`` ended in
``TypeError: unsupported operand type(s) for +: 'ArrayImpl' and 'NoneType'``, and the history
filed each norm under the previous leaf's name (the weight's under ``.idx``). Now a None
update leaves its leaf (``eqx.apply_updates``), the layer names are those of params' floating
leaves, and a None gradient at floating leaves counts as norm 0 in ``og.step``."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
eqx = pytest.importorskip("equinox")
import jax.numpy as jnp  # noqa: E402

import numstab as ns  # noqa: E402


class M(eqx.Module):
    idx: jax.Array
    a: eqx.nn.Linear

    def __init__(self, key):
        self.idx = jnp.arange(4)
        self.a = eqx.nn.Linear(4, 1, key=key)

    def __call__(self, x):
        return self.a(x[self.idx])


def setup(tx, init_filter=eqx.is_array):
    model, x = M(jax.random.PRNGKey(0)), jnp.arange(4.0)
    params = eqx.filter(model, eqx.is_array)
    opt_state = tx.init(eqx.filter(model, init_filter))
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    og = ns.TrainingGuard().for_optax()
    return og, params, opt_state, og.init(params, opt_state), loss, grads


@pytest.mark.parametrize(
    "tx, init_filter",
    # adam's state made for the floating leaves only (optax's adam refuses None gradients
    # against its moments of an integer leaf, an error of its own)
    [(optax.sgd(1e-2), eqx.is_array), (optax.adam(1e-2), eqx.is_inexact_array)],
    ids=["sgd", "adam"],
)
def test_step_leaves_a_leaf_whose_update_is_none(tx, init_filter):
    og, params, opt_state, gstate, loss, grads = setup(tx, init_filter)
    assert grads.idx is None
    new, new_opt, _, d = jax.jit(og.step, static_argnums=0)(
        tx, params, opt_state, gstate, loss, grads
    )
    assert bool(d.apply)
    updates, want_opt = tx.update(grads, opt_state, params)
    want = eqx.apply_updates(params, updates)
    for got, expected in zip(jax.tree.leaves(new), jax.tree.leaves(want), strict=True):
        assert got.dtype == expected.dtype
        # the same float32 ops, fused by XLA under jit: a few ulps
        np.testing.assert_allclose(got, expected, rtol=4 * np.finfo(np.float32).eps)
    np.testing.assert_array_equal(new.idx, params.idx)
    equal = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), new_opt, want_opt)
    assert all(jax.tree.leaves(equal))


def norms_of(grads):
    return [float(jnp.linalg.norm(grads.a.weight)), float(jnp.linalg.norm(grads.a.bias))]


@pytest.mark.parametrize("how", ["check", "step"])
def test_history_names_match_the_norms(how):
    tx = optax.sgd(1e-2)
    og, params, opt_state, gstate, loss, grads = setup(tx)
    if how == "check":
        d, gstate = og.check(gstate, loss, grads)
    else:
        params, opt_state, gstate, d = og.step(tx, params, opt_state, gstate, loss, grads)
    og.after_step(d, params, opt_state, gstate)
    h = og.history.as_arrays()
    assert list(h["names"]) == [".a.weight", ".a.bias"]
    # float32 norms of 4 and 1 elements: a few ulps
    np.testing.assert_allclose(h["layer_norms"][0], norms_of(grads), rtol=1e-6)


def test_a_none_gradient_of_a_floating_leaf_counts_as_norm_zero():
    """A frozen floating leaf (None gradient, as a ``filter_grad`` over a partition gives)
    keeps its name, with norm 0, so the names after it stay in place."""
    tx = optax.sgd(1e-2)
    params = {"frozen": jnp.ones(3), "w": jnp.ones(2)}
    opt_state = tx.init(params)
    og = ns.TrainingGuard().for_optax()
    gstate = og.init(params, opt_state)
    grads = {"frozen": None, "w": jnp.array([3.0, 4.0])}
    new, opt_state, gstate, d = og.step(tx, params, opt_state, gstate, jnp.float32(1.0), grads)
    np.testing.assert_array_equal(new["frozen"], params["frozen"])
    np.testing.assert_allclose(new["w"], [0.97, 0.96], rtol=1e-6)
    og.after_step(d, new, opt_state, gstate)
    h = og.history.as_arrays()
    assert list(h["names"]) == ["['frozen']", "['w']"]
    np.testing.assert_allclose(h["layer_norms"][0], [0.0, 5.0], rtol=1e-6)


def test_check_alone_takes_params_or_refuses_norms_it_cannot_name():
    """``og.check`` sees no params: a None gradient at a floating leaf left one norm fewer
    than names, and the history filed ``w``'s norm under ``frozen``; now ``after_step``
    refuses it, and ``check(..., params=params)`` counts the None gradient as norm 0."""
    tx = optax.sgd(1e-2)
    params = {"frozen": jnp.ones(3), "w": jnp.ones(2)}
    opt_state = tx.init(params)
    og = ns.TrainingGuard().for_optax()
    gstate = og.init(params, opt_state)
    grads = {"frozen": None, "w": jnp.array([3.0, 4.0])}
    d, new_gstate = og.check(gstate, jnp.float32(1.0), grads)
    with pytest.raises(ns.InvalidArgumentError, match=r"og\.check\(\.\.\., params=params\)"):
        og.after_step(d, params, opt_state, new_gstate)
    assert len(og.history) == 0  # refused before anything was recorded
    d, new_gstate = og.check(gstate, jnp.float32(1.0), grads, params)
    og.after_step(d, params, opt_state, new_gstate)
    np.testing.assert_allclose(og.history.as_arrays()["layer_norms"][0], [0.0, 5.0], rtol=1e-6)
