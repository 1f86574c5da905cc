"""The op names of JAX's ``check_numerics(mode="op")`` (docs §14.3, §14.5).

Eagerly, JAX checks a host value (a NumPy array, a Python scalar) when ``jnp.asarray`` /
``jnp.array`` moves it to the device, in its ``stage`` primitive. Before, a ``-inf`` mask
built with NumPy was reported as ``op="stage"``, ``op_kind=None``; it is ``device_put``, of
kind ``cast`` now (JAX's own message, naming ``stage``, stays in the error's text). Which
events are reported is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from numstab import NonFiniteError, check_numerics

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _mask() -> np.ndarray:
    x = np.zeros((2, 4), np.float32)
    x[:, 3] = -np.inf
    return x


@pytest.mark.parametrize(
    ("value", "make", "produced"),
    [
        (_mask(), jnp.asarray, "inf"),
        (np.array([1.0, np.nan], np.float32), jnp.array, "NaN"),
        (_mask(), lambda x: jax.jit(lambda: jnp.asarray(x) + 1)(), "inf"),  # op by op rerun
    ],
)
def test_a_transfer_to_the_device_is_device_put(value, make, produced):
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="jax"):
        make(value)
    e = info.value
    assert (e.op, e.op_kind, e.phase, e.framework) == ("device_put", "cast", "forward", "jax")
    assert e.where is not None and e.where.startswith(__file__)
    assert f"jax device_put produced {produced}" in str(e)
    assert "encountered in stage" in str(e)


def test_only_the_name_changes():
    """Other primitives keep JAX's names; ``inf=False`` still passes a ``-inf`` mask and
    still reports a NaN moved to the device."""
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="jax"):
        jnp.log(jnp.zeros(2))
    assert (info.value.op, info.value.op_kind) == ("log", "log")
    with check_numerics(backend="jax", inf=False):
        assert float(jnp.asarray(_mask())[0, 3]) == -np.inf
    with pytest.raises(NonFiniteError) as info, check_numerics(backend="jax", inf=False):
        jnp.asarray(np.float32(np.nan) * _mask())
    assert (info.value.op, info.value.op_kind) == ("device_put", "cast")


def test_a_jitted_call_whose_rerun_names_no_primitive():
    """An inf that comes in through a jitted call's NumPy argument: JAX finds it in the
    output, reruns the call op by op, finds no primitive that made it and raises a bare
    ``FloatingPointError("('jit(add_one)', 'inf'). Because ...")``; it is a NonFiniteError
    naming the call (before, the raw error escaped)."""

    @jax.jit
    def add_one(x):
        return x + 1

    with pytest.raises(NonFiniteError) as info, check_numerics(backend="jax"):
        add_one(_mask())
    e = info.value
    assert (e.op, e.phase, e.framework) == ("jit(add_one)", "forward", "jax")
    assert "jax jit(add_one) produced inf" in str(e)
