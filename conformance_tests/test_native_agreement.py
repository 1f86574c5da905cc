"""numstab against each framework's own loss: equal where the semantics coincide, and the
deliberate differences (docs/semantics.md) pinned, so a change on either side is noticed."""

from __future__ import annotations

import os

import numpy as np
import pytest

import numstab as ns
from conformance_tests.conftest import requested_backends
from conformance_tests.tolerances import NATIVE

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

RNG = np.random.default_rng(11)
LOGITS = RNG.normal(0, 3, (6, 9)).astype(np.float32)
LABELS = np.array([0, 3, 8, -100, 2, 5])
WEIGHT = RNG.uniform(0.2, 2.0, 9).astype(np.float32)
SOFT = RNG.uniform(0, 1, (6, 9)).astype(np.float32)
SOFT /= SOFT.sum(-1, keepdims=True)
MASKED = LOGITS.copy()
MASKED[:, [2, 7]] = -np.inf
UNMASKED_LABELS = np.array([0, 3, 8, 1, 4, 5])  # no target on the masked classes 2 and 7


def _needs(name):
    if name not in requested_backends():
        pytest.skip(f"{name} not in NUMSTAB_TEST_BACKENDS")
    return pytest.importorskip(name)


def _close(a, b):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=NATIVE[0], atol=NATIVE[1]
    )


# -- torch ----------------------------------------------------------------------------------
TORCH_CASES = {
    "plain": ({}, LABELS),
    "smoothing": ({"label_smoothing": 0.1}, LABELS),
    "weight_smoothing_ignore": ({"label_smoothing": 0.2, "weight": WEIGHT}, LABELS),
    "negative_ignore_index": (
        {"label_smoothing": 0.1, "weight": WEIGHT, "ignore_index": -1},
        np.where(LABELS < 0, -1, LABELS),
    ),
    "probabilities": ({"label_smoothing": 0.3, "weight": WEIGHT}, SOFT),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", TORCH_CASES)
def test_torch_cross_entropy(name, reduction):
    torch = _needs("torch")
    kwargs, labels = TORCH_CASES[name]
    kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    results = []
    for fn in (torch.nn.functional.cross_entropy, ns.cross_entropy):
        x = torch.tensor(LOGITS, requires_grad=True)
        loss = fn(x, torch.tensor(labels), reduction=reduction, **kwargs)
        loss.sum().backward()
        results.append((loss.detach(), x.grad))
    _close(results[1][0], results[0][0])
    _close(results[1][1], results[0][1])


def test_torch_class_axis_1():
    torch = _needs("torch")
    x = torch.tensor(RNG.normal(0, 2, (3, 5, 4)).astype(np.float32))
    y = torch.tensor(RNG.integers(0, 5, (3, 4)))
    want = torch.nn.functional.cross_entropy(x, y, label_smoothing=0.1, reduction="none")
    _close(ns.cross_entropy(x, y, label_smoothing=0.1, axis=1, reduction="none"), want)


def test_torch_differences_are_deliberate():
    torch = _needs("torch")
    F = torch.nn.functional
    ignored = torch.full((3,), -100)
    x = torch.zeros(3, 4)
    assert torch.isnan(F.cross_entropy(x, ignored))  # torch: 0/0
    assert ns.cross_entropy(x, ignored) == 0.0
    masked = torch.tensor(MASKED)
    y = torch.tensor(UNMASKED_LABELS)
    assert torch.isinf(F.cross_entropy(masked, y, label_smoothing=0.1))  # mass on -inf classes
    assert torch.isfinite(ns.cross_entropy(masked, y, label_smoothing=0.1))
    half = torch.zeros(2, 100_000, dtype=torch.float16)
    labels = torch.tensor([0, 1])
    assert not torch.isfinite(F.cross_entropy(half, labels))  # CPU fp16 log_softmax overflows
    _close(ns.cross_entropy(half, labels), np.log(100_000.0))


# -- jax / optax ----------------------------------------------------------------------------
def test_optax_cross_entropy():
    _needs("jax")
    import jax
    import jax.numpy as jnp
    import optax

    y = np.where(LABELS < 0, 0, LABELS)
    x = jnp.asarray(LOGITS)
    native = lambda a: optax.softmax_cross_entropy_with_integer_labels(a, y).mean()
    ours = lambda a: ns.cross_entropy(a, jnp.asarray(y))
    for fn in (native, ours):
        assert jax.grad(fn)(x).shape == x.shape
    _close(ours(x), native(x))
    _close(jax.grad(ours)(x), jax.grad(native)(x))
    smoothed = optax.smooth_labels(jax.nn.one_hot(y, 9), 0.1)
    native = lambda a: optax.softmax_cross_entropy(a, smoothed).mean()
    ours = lambda a: ns.cross_entropy(a, jnp.asarray(y), label_smoothing=0.1)
    _close(ours(x), native(x))
    _close(jax.grad(ours)(x), jax.grad(native)(x))
    _close(ns.smooth_labels(jnp.asarray(y), 0.1, num_classes=9), smoothed)


def test_optax_differences_are_deliberate():
    _needs("jax")
    import jax
    import jax.numpy as jnp
    import optax

    half = jnp.zeros((2, 100_000), jnp.float16)
    y = jnp.asarray([0, 1])
    assert not np.isfinite(optax.softmax_cross_entropy_with_integer_labels(half, y)).all()
    _close(ns.cross_entropy(half, y), np.log(100_000.0))
    masked = jnp.asarray(MASKED)
    safe = UNMASKED_LABELS
    smoothed = optax.smooth_labels(jax.nn.one_hot(safe, 9), 0.1)
    assert not np.isfinite(optax.softmax_cross_entropy(masked, smoothed)).all()
    assert np.isfinite(ns.cross_entropy(masked, jnp.asarray(safe), label_smoothing=0.1))
    out_of_range = jnp.asarray([0, 12])
    gathered = jnp.arange(18.0).reshape(2, 9)[jnp.arange(2), out_of_range]
    assert gathered[1] == 17.0  # a plain JAX gather clamps index 12 to class 8
    rows = jax.jit(lambda a: ns.cross_entropy(a, out_of_range, reduction="none"))(jnp.zeros((2, 9)))
    assert np.isfinite(rows[0]) and np.isnan(rows[1])


# -- tensorflow / keras ---------------------------------------------------------------------
def test_tensorflow_and_keras_cross_entropy():
    tf = _needs("tensorflow")
    import keras

    y = np.where(LABELS < 0, 0, LABELS)
    x = tf.constant(LOGITS)
    native = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=x)
    _close(ns.cross_entropy(x, tf.constant(y), reduction="none"), native)
    onehot = tf.one_hot(y, 9)
    keras_loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        want = keras_loss(onehot, x)
        got = ns.cross_entropy(x, tf.constant(y), label_smoothing=0.1)
        got_soft = ns.cross_entropy(x, onehot, label_smoothing=0.1)
    _close(got, want)
    _close(got_soft, want)
    _close(tape.gradient(got, x), tape.gradient(want, x))
    soft = tf.nn.softmax_cross_entropy_with_logits(labels=SOFT, logits=x)
    _close(ns.cross_entropy(x, tf.constant(SOFT), reduction="none"), soft)


def test_keras_differences_are_deliberate():
    tf = _needs("tensorflow")
    import keras

    safe = UNMASKED_LABELS
    masked = tf.constant(MASKED)
    keras_loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    assert not np.isfinite(keras_loss(tf.one_hot(safe, 9), masked).numpy())
    assert np.isfinite(ns.cross_entropy(masked, tf.constant(safe), label_smoothing=0.1).numpy())
