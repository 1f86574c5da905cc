"""AGC with None gradient leaves (Equinox filter_grad on a whole model, a frozen torch
parameter): a None gradient matches any params subtree (docs §6 rules 2 and 5); counts
in the structure error name only the gradients that are not None."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from numstab import AGC
from numstab.errors import InvalidArgumentError
from numstab.integrations import optax as nso


def _model_and_grads():
    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(4)) ** 2) * 100.0)(model)
    return model, grads


def _assert_trees_close(a, b):
    tol = 4 * float(jnp.finfo(jnp.float32).eps)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * float(jnp.max(jnp.abs(y))))


def test_agc_on_a_whole_equinox_model_equals_optax():
    model, grads = _model_and_grads()
    clipped = AGC(0.01).clip(grads, model)
    arrays = eqx.filter(model, eqx.is_array)
    expected, _ = optax.adaptive_grad_clip(0.01).update(
        eqx.filter(grads, eqx.is_array), optax.EmptyState(), arrays
    )
    assert clipped.activation is None and clipped.final_activation is None
    _assert_trees_close(eqx.filter(clipped, eqx.is_array), expected)


def test_loss_scaled_chain_with_agc_on_a_whole_model():
    """The audit's repro: 'Received: 8 gradient leaves and 6 parameter leaves'."""
    model, grads = _model_and_grads()
    tx = nso.loss_scaled(optax.chain(nso.agc(0.01), optax.adam(1e-3)))
    state = tx.init(eqx.filter(model, eqx.is_array))
    updates, state = tx.update(grads, state, model)
    assert bool(state.last_finite)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_none_gradient_over_a_params_subtree():
    params = {"a": jnp.ones((3, 2)), "b": {"c": jnp.ones(2), "d": jnp.ones(3)}}
    grads = {"a": jnp.full((3, 2), 5.0), "b": None}
    out = AGC(0.01).clip(grads, params)
    assert out["b"] is None
    _assert_trees_close(out["a"], AGC(0.01).clip({"a": grads["a"]}, {"a": params["a"]})["a"])
    assert AGC(0.01).clip({"a": None, "b": None}, params) == {"a": None, "b": None}


def test_structure_errors_count_only_real_gradients():
    params = {"a": jnp.ones((3, 2)), "b": {"c": jnp.ones(2)}}
    agc = AGC(0.01)
    with pytest.raises(InvalidArgumentError, match=r"1 gradient leaves .*; no gradient at"):
        agc.clip({"a": jnp.ones((3, 2))}, params)  # params without any gradient path
    with pytest.raises(InvalidArgumentError, match=r"2 gradient leaves .*no parameter at \['e'\]"):
        agc.clip({"a": jnp.ones((3, 2)), "b": None, "e": jnp.ones(1), "f": None}, params)
    model, _ = _model_and_grads()
    with pytest.raises(InvalidArgumentError, match=r"no parameter at \['weight'\]"):
        agc.clip({"weight": jnp.ones(2)}, model)
