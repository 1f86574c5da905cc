"""``fused_linear_cross_entropy`` on clean, finite inputs under ``check_numerics()`` (op mode)
raises nothing, forward and backward, on every backend (docs/semantics.md §11, §14), while
traced out-of-range labels still give NaN rows with zero gradient and an all-masked vocabulary
still gives +inf with NaN gradients.

Before the fix, torch raised ``NonFiniteError`` at ``aten.scalar_tensor.default``: the chunk
loop applied ``where(out_of_range, nan, rows)`` on every call, even on labels already read and
checked eagerly, and a bias added ``where(count < 0.5, nan, ...)``; torch turns the Python NaN
into a 0-d tensor holding NaN, which the op check reports.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import numstab as ns
from numstab.fused_cross_entropy import fused_linear_cross_entropy

TOKENS, WIDTH, VOCAB, CHUNK = 7, 8, 11, 3  # two full chunks and a short one
SETTINGS = {
    "plain": {},
    "bias": {"bias": True},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "none": {"reduction": "none"},
    "sum_chunked": {"reduction": "sum", "chunk_size": CHUNK},
    "everything": {
        "bias": True,
        "label_smoothing": 0.1,
        "z_loss": 1e-2,
        "reduction": "none",
        "chunk_size": CHUNK,
    },
    "no_ignorable_label": {"bias": True, "ignore_index": -(2**70), "chunk_size": CHUNK},
}


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((TOKENS, WIDTH)).astype(np.float32)
    weight = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    bias = rng.standard_normal(VOCAB).astype(np.float32)
    labels = rng.integers(0, VOCAB, TOKENS).astype(np.int64)
    return hidden, weight, bias, labels


def _kwargs(setting: dict, bias, labels: np.ndarray) -> tuple[dict, np.ndarray]:
    """The call's keyword arguments; one row ignored where ignore_index can match."""
    kwargs = dict(setting)
    kwargs["bias"] = bias if kwargs.pop("bias", False) else None
    labels = labels.copy()
    if "ignore_index" not in kwargs:
        labels[2] = -100
    return kwargs, labels


def _skip_missing(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} not installed")


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
def test_torch_clean_inputs_raise_nothing(setting):
    """Failed before the fix (aten.scalar_tensor.default, forward) for every setting."""
    _skip_missing("torch")
    import torch

    hidden, weight, bias, labels = _data()
    kwargs, labels = _kwargs(setting, torch.tensor(bias, requires_grad=True), labels)
    h = torch.tensor(hidden, requires_grad=True)
    w = torch.tensor(weight, requires_grad=True)
    with ns.check_numerics():
        loss = fused_linear_cross_entropy(h, w, torch.tensor(labels), **kwargs)
        loss.sum().backward()
    assert torch.isfinite(loss).all()
    grads = [h.grad, w.grad] + ([] if kwargs["bias"] is None else [kwargs["bias"].grad])
    assert all(torch.isfinite(g).all() for g in grads)
    # the same values as without the check (the fix changes no arithmetic)
    again = fused_linear_cross_entropy(h, w, torch.tensor(labels), **kwargs)
    torch.testing.assert_close(loss, again, rtol=0, atol=0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("setting", ["plain", "everything"])
def test_jax_clean_inputs_raise_nothing(setting, jit):
    _skip_missing("jax")
    import jax
    import jax.numpy as jnp

    hidden, weight, bias, labels = _data()
    kwargs, labels = _kwargs(SETTINGS[setting], True, labels)
    with_bias = kwargs.pop("bias") is not None

    def loss(h, w, b):
        out = fused_linear_cross_entropy(h, w, labels, bias=b if with_bias else None, **kwargs)
        return jnp.sum(out)

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    fn = jax.jit(fn) if jit else fn
    with ns.check_numerics():
        value, grads = jax.block_until_ready(fn(hidden, weight, bias))
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("function", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("setting", ["plain", "everything"])
def test_tensorflow_clean_inputs_raise_nothing(setting, function):
    _skip_missing("tensorflow")
    import tensorflow as tf

    hidden, weight, bias, labels = _data()
    h, w, b = tf.Variable(hidden), tf.Variable(weight), tf.Variable(bias)
    kwargs, labels = _kwargs(SETTINGS[setting], b, labels)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fused_linear_cross_entropy(h, w, tf.constant(labels), **kwargs))
        return loss, tape.gradient(loss, [h, w, b])

    step = tf.function(step) if function else step
    with ns.check_numerics():
        loss, grads = step()
    assert np.isfinite(loss.numpy())
    assert all(g is None or np.isfinite(g.numpy()).all() for g in grads)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_traced_out_of_range_label_is_still_a_nan_row_with_zero_gradient(with_bias):
    """Under jax.jit the labels are not read: the out-of-range row is NaN (§11)."""
    _skip_missing("jax")
    import jax
    import jax.numpy as jnp

    hidden, weight, bias, labels = _data()
    labels[4] = VOCAB
    b = bias if with_bias else None

    def rows(h, y):
        return fused_linear_cross_entropy(h, weight, y, bias=b, reduction="none", chunk_size=3)

    got = np.asarray(jax.jit(rows)(hidden, labels))
    assert np.isnan(got[4]) and np.isfinite(np.delete(got, 4)).all()
    mean = jax.jit(
        jax.grad(lambda h, y: fused_linear_cross_entropy(h, weight, y, bias=b, chunk_size=3))
    )
    grad = np.asarray(mean(hidden, labels))
    assert np.all(grad[4] == 0.0) and np.isfinite(grad).all()
    unfused = jax.jit(lambda y: ns.cross_entropy(jnp.asarray(hidden @ weight.T), y))
    assert np.isnan(unfused(labels))  # the same contract as the unfused loss


def test_torch_every_class_masked_still_inf_loss_nan_gradients():
    """The bias's all-masked fill is 0/K_valid: NaN only when K_valid = 0."""
    _skip_missing("torch")
    import torch

    hidden, weight, _, labels = _data()
    h = torch.tensor(hidden, requires_grad=True)
    b = torch.full((VOCAB,), float("-inf"), requires_grad=True)
    loss = fused_linear_cross_entropy(h, torch.tensor(weight), torch.tensor(labels), bias=b)
    loss.backward()
    assert loss.item() == float("inf")
    assert torch.isnan(h.grad).all()
