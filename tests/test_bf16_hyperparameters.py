"""Hyperparameters that ``optax.inject_hyperparams`` casts to bfloat16 (it casts them to the
params' dtype) are read as numbers (§10.2, §13.3): ml_dtypes' bfloat16 has NumPy kind "V", and
numstab refused it as "not a real number", in ``tx.init`` already (eager even in jitted
loops)."""

import pytest

optax = pytest.importorskip("optax")
jnp = pytest.importorskip("jax.numpy")

import numpy as np  # noqa: E402

from numstab.integrations.optax import agc, loss_scaled, zclip  # noqa: E402

PARAMS = {"w": jnp.ones((4, 3), jnp.bfloat16)}
GRADS = {"w": jnp.full((4, 3), 0.5, jnp.bfloat16)}


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.inject_hyperparams(loss_scaled)(optax.sgd(0.1), max_norm=1.0),
        lambda: optax.inject_hyperparams(zclip)(max_grad_norm=1.0),
        lambda: optax.inject_hyperparams(agc)(0.01),
    ],
    ids=["loss_scaled", "zclip", "agc"],
)
def test_bf16_injected_hyperparameters_are_read(make):
    tx = make()
    state = tx.init(PARAMS)
    updates, _ = tx.update(GRADS, state, PARAMS)
    assert np.isfinite(np.asarray(updates["w"], np.float32)).all()
