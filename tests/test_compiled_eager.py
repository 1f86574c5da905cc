"""Eager losses compiled as one kernel (``Backend.compiled_eager``) on JAX."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import numstab as ns
from numstab.backends._base import FORCE_GENERIC_ENV

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _spy(monkeypatch, cls, name):
    calls = []
    original = getattr(cls, name)

    def spy(self, *args, **kwargs):
        calls.append(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, spy)
    return calls


def test_generic_and_native_paths_are_compiled_apart(monkeypatch):
    """NUMSTAB_FORCE_GENERIC flipped in one process (as the conformance suite does) must
    trace the generic composites, not reuse the native kernel's trace of the same shapes."""
    from numstab.frameworks.jax.backend import JaxBackend

    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 7)), jnp.float32)
    y = jnp.asarray([0, 6, 2, 3, 1])
    monkeypatch.delenv(FORCE_GENERIC_ENV, raising=False)
    native = ns.cross_entropy(x, y)
    monkeypatch.setenv(FORCE_GENERIC_ENV, "1")
    generic_calls = _spy(monkeypatch, JaxBackend, "softmax_nll")
    generic = ns.cross_entropy(x, y)
    assert generic_calls == ["softmax_nll"]
    np.testing.assert_allclose(generic, native, rtol=1e-6)


def test_eager_loss_is_one_compiled_call_and_differentiable():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(6, 9)), jnp.float32)
    y = jnp.asarray([0, 8, -100, 3, 3, -100])
    loss = ns.cross_entropy(x, y, label_smoothing=0.1, z_loss=1e-3)
    compiled = jax.jit(lambda a: ns.cross_entropy(a, y, label_smoothing=0.1, z_loss=1e-3))
    np.testing.assert_allclose(loss, compiled(x), rtol=1e-6)
    # jax.grad without jit sees concrete values: the eager path, through the compiled kernel
    grad = jax.grad(lambda a: ns.cross_entropy(a, y, label_smoothing=0.1, z_loss=1e-3))(x)
    np.testing.assert_allclose(grad, jax.grad(compiled)(x), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[[2, 5]] == 0.0)  # ignored rows get no gradient


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_probability_labels_take_the_compiled_kernel_eagerly(monkeypatch, reduction):
    from numstab import losses

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32).at[0, 1, 4].set(-jnp.inf)
    t = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32))
    kwargs = dict(label_smoothing=0.2, z_loss=1e-3, reduction=reduction)
    traced = jax.jit(lambda a: ns.cross_entropy(a, t, **kwargs))(x)
    seen = []
    kernel = losses._probability_kernel
    spy = functools.wraps(kernel)(lambda *a: seen.append(1) or kernel(*a))  # keeps argnames
    monkeypatch.setattr(losses, "_probability_kernel", spy)
    eager = ns.cross_entropy(x, t, **kwargs)
    assert eager.shape == traced.shape
    np.testing.assert_allclose(eager, traced, rtol=1e-6)
    assert seen == [1]  # traced once, inside the compiled kernel
    ns.cross_entropy(x, t, **kwargs)
    assert seen == [1]  # the second call reuses the compiled kernel: no Python re-run


LABEL_CASES = [
    ([0, 3, 1, 2], -100),
    ([-100, 3, 1, -100], -100),
    ([-100, -100], -100),
    ([0, 3, 1, 3], 3),
    ([-100, -1, 7], -100),
    ([], -100),
]


@pytest.mark.parametrize("labels, ignore_index", LABEL_CASES)
def test_label_summaries_agree_with_the_numpy_reference(labels, ignore_index):
    """Every ``label_summary`` (the generic NumPy read, JAX through it, torch on CPU, and
    torch's on-device form that GPUs take, run here on CPU) gives the same three numbers."""
    from numstab.frameworks.numpy.backend import BACKEND as reference

    y = np.array(labels, dtype=np.int64)
    want = reference.label_summary(y, ignore_index)
    assert ns.backends.load_backend("jax").label_summary(jnp.asarray(y), ignore_index) == want
    torch = pytest.importorskip("torch")
    from numstab.frameworks.torch import backend as torch_backend

    t = torch.as_tensor(y)
    assert torch_backend.BACKEND.label_summary(t, ignore_index) == want
    if y.size:
        assert torch_backend._label_summary_on_device(t, ignore_index) == want
