"""A LossScaleState or ZClipState of Python numbers (written by hand, read from JSON) is the
float32 / int32 state ``init`` makes, on every backend (§8.1, §13.1): before, NumPy, torch and
TensorFlow made it float64 and int64 and JAX float32 and int32, so the backends' next states
disagreed in dtype. A number past those types raises InvalidArgumentError naming the field."""

import numpy as np
import pytest

import numstab as ns
from numstab.adaptive_clipping import ZClipState
from numstab.errors import InvalidArgumentError
from tests.backend_arrays import as_backend

BACKENDS = ("numpy", "torch", "tensorflow", "jax")
NUMBERS = ns.LossScaleState(scale=65536.0, growth_tracker=3, hysteresis_left=1)


def _dtypes(state):
    return [str(np.asarray(x).dtype) for x in state]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("finite", [True, False])
def test_loss_scale_state_of_numbers_updates_as_the_init_state(backend, finite):
    scaler = ns.LossScaler(growth_interval=4)
    flag = as_backend(backend, np.asarray(finite))
    expected = scaler.update(
        scaler.init(backend=backend)._replace(growth_tracker=np.int32(3)), flag, backend=backend
    )
    got = scaler.update(NUMBERS, flag, backend=backend)
    assert _dtypes(got) == ["float32", "int32", "int32"] == _dtypes(expected)
    for a, b in zip(got, expected, strict=True):
        assert np.asarray(a) == np.asarray(b)
    grads, ok = scaler.unscale([as_backend(backend, np.ones(3, np.float32))], NUMBERS)
    assert str(np.asarray(grads[0]).dtype) == "float32" and bool(np.asarray(ok))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zclip_state_of_numbers_is_the_init_state(backend):
    zclip = ns.ZClip(warmup_steps=2)
    buffer = zclip.init(backend="numpy").buffer
    state = ZClipState(count=0, buffer=buffer, mean=0.0, var=0.0, norm=0.0)
    norm = as_backend(backend, np.float32(0.5))
    _, got = zclip.coefficient(norm, state, backend=backend)
    _, expected = zclip.coefficient(norm, zclip.init(backend=backend), backend=backend)
    assert _dtypes(got) == _dtypes(expected) == ["int32", *["float32"] * 4]


@pytest.mark.parametrize(
    "field, value",
    [
        ("scale", 1e300),
        ("scale", -1e39),
        ("growth_tracker", 2**40),
        ("hysteresis_left", -(2**31) - 1),
    ],
)
def test_numbers_past_the_state_types_raise(field, value):
    with pytest.raises(InvalidArgumentError, match=f"state.{field} in"):
        ns.LossScaler().update(NUMBERS._replace(**{field: value}), True, backend="torch")
