"""``NonFiniteError.where`` (§14.3) for a Flax or Equinox layer: the user's line that called the
layer, as for ``torch.nn``. Before, it pointed into the layer library
(``flax/nnx/nn/linear.py:422``, ``equinox/nn/_linear.py:97``)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import numstab as ns  # noqa: E402


def _where_of(run) -> str:
    with pytest.raises(ns.NonFiniteError) as info, ns.check_numerics():
        run()
    return info.value.where


def test_flax_nnx_layer():
    nnx = pytest.importorskip("flax.nnx")
    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    layer.kernel.value = layer.kernel.value.at[0, 0].set(jnp.inf)
    line = inspect.currentframe().f_lineno + 1
    where = _where_of(lambda: layer(jnp.ones((1, 3))))
    assert where == f"{__file__}:{line}", where


def test_equinox_layer():
    eqx = pytest.importorskip("equinox")
    layer = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    layer = eqx.tree_at(lambda m: m.weight, layer, layer.weight.at[0, 0].set(np.inf))
    line = inspect.currentframe().f_lineno + 1
    where = _where_of(lambda: layer(jnp.ones(3)))
    assert where == f"{__file__}:{line}", where
