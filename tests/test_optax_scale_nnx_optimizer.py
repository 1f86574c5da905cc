"""current_scale / find_loss_scale_state under ``flax.nnx.Optimizer``, which wraps every leaf of
the optax state in an ``nnx.OptArray``: they return arrays (a 0-d float32 jax.Array for the
scale, docs/semantics.md §10.2), not the OptArray Variables, which ``jax.device_get`` and
``jax.jit(lambda a: a)`` handed back as OptArrays. Before, both returned OptArrays.
``loss_scaled`` still runs inside ``nnx.Optimizer`` (eager and ``nnx.jit`` steps).
"""

from __future__ import annotations

import numpy as np
import pytest

from numstab import LossScaler
from numstab.integrations.optax import (
    current_scale,
    find_loss_scale_state,
    loss_scaled,
    scale_loss,
)

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
jnp = jax.numpy


def _optimizer(scaler=None):
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, loss_scaled(optax.adam(1e-3), scaler), wrt=nnx.Param)


def _is_array(x, dtype):
    return isinstance(x, jax.Array) and x.shape == () and x.dtype == dtype


def test_current_scale_is_a_float32_array():
    model, optimizer = _optimizer()
    scale = current_scale(optimizer.opt_state)
    assert _is_array(scale, jnp.float32), type(scale)
    assert float(scale) == LossScaler().init_scale  # 2**16, exact in float32
    host = jax.device_get(scale)
    assert isinstance(host, np.ndarray | np.generic) and host == 2.0**16, type(host)
    assert _is_array(jax.jit(lambda a: a)(scale), jnp.float32)

    state = find_loss_scale_state(optimizer.opt_state)
    dtypes = (jnp.float32, jnp.int32, jnp.int32)
    assert all(map(_is_array, state, dtypes)), [type(x) for x in state]
    plain = loss_scaled(optax.adam(1e-3)).init(nnx.state(model, nnx.Param))
    assert [int(a) for a in state] == [int(b) for b in find_loss_scale_state(plain)]
    # the LossScaledState and the LossScaleState themselves are taken as before
    assert _is_array(current_scale(plain), jnp.float32)
    assert _is_array(current_scale(plain.loss_scale), jnp.float32)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_loss_scaled_steps_inside_nnx_optimizer(jit):
    """§10.2's sequence: jmp preset, growth_interval=2; finite, NaN, finite, finite steps."""
    model, optimizer = _optimizer(LossScaler.preset("jmp", growth_interval=2))
    x = jnp.ones((2, 4))

    def step(model, optimizer, poison):
        def loss(m):
            return scale_loss(jnp.mean(m(x * poison) ** 2), optimizer.opt_state)

        optimizer.update(model, nnx.grad(loss)(model))
        return current_scale(optimizer.opt_state)

    step = nnx.jit(step) if jit else step
    scales, counts = [], []
    for poison in (1.0, jnp.nan, 1.0, 1.0):
        scale = step(model, optimizer, jnp.float32(poison))
        assert _is_array(scale, jnp.float32), type(scale)
        scales.append(float(scale))
        counts.append(int(optimizer.opt_state.inner_state[0].count[...]))
    assert scales == [32768.0, 16384.0, 16384.0, 32768.0]
    assert counts == [1, 1, 2, 3]
    assert bool(jnp.all(jnp.isfinite(model.kernel[...])))
