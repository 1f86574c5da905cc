"""0-d arrays as hyperparameters (``optax.inject_hyperparams`` makes every numeric one an
array): ZClip and AGC read a readable one on every backend. Before, only NumPy and JAX
arrays were read (by their dtype's ``kind``); torch and TensorFlow scalars were refused as
"not a real number", and a NaN one got a different message than on NumPy and JAX."""

import numpy as np
import pytest

import numstab as ns
from numstab import _validate as v


def _scalars(value, dtype="float32"):
    out = {"numpy": np.asarray(value, dtype)}
    jnp = pytest.importorskip("jax.numpy")
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("tensorflow")
    out["jax"] = jnp.asarray(value, dtype)
    out["torch"] = torch.tensor(value, dtype=getattr(torch, dtype))
    out["tensorflow"] = tf.constant(value, dtype)
    return out


def test_every_backend_scalar_is_read_as_its_value():
    for name, x in _scalars(0.9).items():
        assert ns.ZClip(alpha=x).alpha == float(np.float32(0.9)), name
        assert ns.AGC(clip_factor=x).clip_factor == float(np.float32(0.9)), name
    for name, x in _scalars(7, "int32").items():
        assert v.host_scalar(x) == 7 and type(v.host_scalar(x)) is int, name
    for name, x in _scalars(0.5, "bfloat16").items():
        assert v.host_scalar(x) == 0.5, name


def test_a_nan_scalar_gets_one_message_on_every_backend():
    messages = set()
    for x in _scalars(float("nan")).values():
        with pytest.raises(ns.InvalidArgumentError) as info:
            ns.ZClip(alpha=x)
        messages.add(str(info.value))
    assert messages == {"Expected alpha in [0, 1]. Received: alpha=nan"}


def test_bool_and_complex_scalars_are_not_numbers():
    torch = pytest.importorskip("torch")
    for x in (torch.tensor(True), torch.tensor(1 + 1j), np.asarray(True)):
        with pytest.raises(ns.InvalidArgumentError, match="real number"):
            ns.ZClip(alpha=x)


def test_traced_scalars_are_traced():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("tensorflow")
    seen = []
    torch.vmap(lambda t: seen.append(v.host_scalar(t.sum())) or t)(torch.ones(3, 2))
    tf.function(lambda t: seen.append(v.host_scalar(t)) or t, autograph=False)(tf.constant(1.0))
    assert seen == [v.TRACED, v.TRACED]
