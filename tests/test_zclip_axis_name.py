"""``zclip(axis_name=...)``: each device holds a disjoint slice of the gradients (``shard_map``,
``vmap`` with an axis name), and the norm ZClip thresholds is the whole tree's, so every
slice is clipped by the same factor and keeps the same statistics, equal to ``zclip`` on the
whole gradient. Before, ``zclip`` had no ``axis_name``: inside ``loss_scaled(...,
axis_name=)`` each device clipped by its own slice's norm (factors 0.91 to 0.17 where the
global one was 0.13). Also: an ``axis_name`` that no transformation binds is a typed error
(was JAX's ``NameError: Found an unbound axis name``)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import numstab as ns  # noqa: E402
from numstab.integrations.optax import loss_scaled, zclip  # noqa: E402

SLICES = 4
# four slices of very different norms (as the audit's FSDP shards), past the warmup of 1
GRADS = jnp.stack([jnp.full((3,), float(k + 1) ** 2) for k in range(SLICES)])


def _sharded_and_whole(tx_sharded, tx_whole, steps=3):
    """The per-slice results of ``tx_sharded`` under ``vmap(axis_name="d")``, and
    ``tx_whole`` on the concatenated gradient, each for ``steps`` updates."""
    state = jax.vmap(tx_sharded.init)(GRADS)
    whole_state = tx_whole.init(GRADS.reshape(-1))
    update = jax.vmap(tx_sharded.update, axis_name="d")
    for step in range(steps):
        scale = 1.0 + step
        out, state = update(GRADS * scale, state)
        whole, whole_state = tx_whole.update((GRADS * scale).reshape(-1), whole_state)
    return out, state, whole, whole_state


def test_every_slice_is_clipped_by_the_global_norm():
    kwargs = {"warmup_steps": 1, "max_grad_norm": 5.0}
    out, state, whole, whole_state = _sharded_and_whole(
        zclip(**kwargs, axis_name="d"), zclip(**kwargs)
    )
    np.testing.assert_allclose(np.asarray(out).reshape(-1), np.asarray(whole), rtol=1e-6)
    for field in ("mean", "var", "norm", "count"):
        per_slice = np.asarray(getattr(state, field))
        assert (per_slice == per_slice[0]).all(), field  # every device keeps the same state
        np.testing.assert_allclose(per_slice[0], np.asarray(getattr(whole_state, field)), 1e-6)


def test_inside_loss_scaled_with_the_same_axis():
    scaler = ns.LossScaler(init_scale=1.0, dynamic=False)

    def chain(axis_name):
        inner = optax.chain(zclip(warmup_steps=1, max_grad_norm=5.0, axis_name=axis_name))
        return loss_scaled(inner, scaler, axis_name=axis_name)

    out, _, whole, _ = _sharded_and_whole(chain("d"), chain(None))
    np.testing.assert_allclose(np.asarray(out).reshape(-1), np.asarray(whole), rtol=1e-6)


@pytest.mark.parametrize(
    "make", [lambda: zclip(axis_name="d"), lambda: loss_scaled(optax.sgd(0.1), axis_name="d")]
)
def test_an_unbound_axis_name_is_a_typed_error(make):
    tx = make()
    grads = jnp.ones(3)
    state = tx.init(grads)
    with pytest.raises(ns.InvalidArgumentError, match="axis_name='d'"):
        tx.update(grads, state)


def test_an_unhashable_axis_name_is_refused_at_construction():
    with pytest.raises(ns.InvalidArgumentError, match="hashable axis_name"):
        zclip(axis_name=["d"])
