"""locate_nonfinite passes keyword arguments to the model: Hugging Face's ``attention_mask=``,
Flax's ``deterministic=True``. Before, Python's TypeError ("unexpected keyword argument"),
and wrapping the model in a lambda to pass them lost every layer name.

Each model is ``l2(l1(x) + shift)``, times 1e30 twice when ``blow_up`` (a Python bool the
model branches on: on JAX it must stay static). A NaN ``shift`` (an input) makes ``l2`` the
first layer with a non-finite output; ``blow_up=True`` makes the model's own code (``""``)
the one that made it (§15.3)."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

X = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)


def _check(model, x, shift, nan_shift, loss_fn=None, layer="l2"):
    clean = ns.locate_nonfinite(model, x, shift=shift, loss_fn=loss_fn)
    assert not clean.found, clean
    # a NaN shift (an input) reaches l2 first; blow_up's inf is made by the model's own code
    for kwargs, where in (({"shift": nan_shift}, layer), ({"shift": shift, "blow_up": True}, "")):
        report = ns.locate_nonfinite(model, x, loss_fn=loss_fn, **kwargs)
        assert report.found and report.phase == "forward" and report.layer == where, report
    again = ns.locate_nonfinite(model, x, shift=shift, blow_up=False, loss_fn=loss_fn)
    assert not again.found  # a static keyword is part of the compiled pass's cache key


def test_torch_module_with_keyword_arguments():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

        def forward(self, x, *, shift, blow_up=False):
            h = self.l1(x) + shift
            return self.l2(h * 1e30 * 1e30 if blow_up else h)

    _check(Net(), torch.from_numpy(X), torch.zeros(8), torch.full((8,), float("nan")), torch.sum)


def test_nnx_equinox_linen_and_plain_jax_with_keyword_arguments():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    x, shift, nan_shift = jnp.asarray(X), jnp.zeros(8), jnp.full((8,), jnp.nan)

    nnx = pytest.importorskip("flax.nnx")

    class NNXNet(nnx.Module):
        def __init__(self):
            self.l1, self.l2 = (
                nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
                nnx.Linear(8, 2, rngs=nnx.Rngs(1)),
            )

        def __call__(self, x, *, shift, blow_up=False):
            h = self.l1(x) + shift
            return self.l2(h * 1e30 * 1e30 if blow_up else h)

    _check(NNXNet(), x, shift, nan_shift, jnp.sum)

    eqx = pytest.importorskip("equinox")

    class EqxNet(eqx.Module):
        l1: eqx.nn.Linear
        l2: eqx.nn.Linear

        def __init__(self):
            self.l1 = eqx.nn.Linear(4, 8, key=jax.random.PRNGKey(0))
            self.l2 = eqx.nn.Linear(8, 2, key=jax.random.PRNGKey(1))

        def __call__(self, x, *, shift, blow_up=False):  # one sample, Equinox's idiom
            h = self.l1(x) + shift
            return self.l2(h * 1e30 * 1e30 if blow_up else h)

    _check(EqxNet(), x[0], shift, nan_shift, jnp.sum)

    class VmappedNet(EqxNet):
        def __call__(self, x, *, shift, blow_up=False):
            return jax.vmap(lambda row: super(VmappedNet, self).__call__(row, shift=shift))(x)

    # layers inside the model's own vmap: their values cannot leave it (before, JAX's
    # UnexpectedTracerError); one sample of the same model locates
    with pytest.raises(ns.InvalidArgumentError, match=r"jax\.vmap"):
        ns.locate_nonfinite(VmappedNet(), x, shift=shift)

    linen = pytest.importorskip("flax.linen")

    class LinenNet(linen.Module):
        @linen.compact
        def __call__(self, x, *, shift, blow_up=False):
            h = linen.Dense(8, name="l1")(x) + shift
            return linen.Dense(2, name="l2")(h * 1e30 * 1e30 if blow_up else h)

    net = LinenNet()
    variables = net.init(jax.random.PRNGKey(0), x, shift=shift)
    _check(net.bind(variables), x, shift, nan_shift, jnp.sum)

    from numstab.locate.jax import layer

    w1, w2 = jnp.ones((4, 8)) / 4, jnp.ones((8, 2)) / 8

    def plain(x, *, shift, blow_up=False):
        h = layer("l1", lambda w, x: x @ w, w1, x) + shift
        return layer("l2", lambda w, h: h @ w, w2, h * 1e30 * 1e30 if blow_up else h)

    _check(plain, x, shift, nan_shift, jnp.sum)


def test_keras_model_with_keyword_arguments():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras on its other backends: conformance_tests/test_locate_keras_backends")

    class KerasNet(keras.Model):
        def __init__(self):
            super().__init__()
            self.l1 = keras.layers.Dense(8, name="l1")
            self.l2 = keras.layers.Dense(2, name="l2")

        def call(self, x, shift=None, blow_up=False):
            h = self.l1(x) + shift
            return self.l2(h * 1e30 * 1e30 if blow_up else h)

    import tensorflow as tf

    model = KerasNet()
    x, shift = tf.constant(X), tf.zeros(8)
    model(x, shift=shift)
    _check(model, x, shift, tf.fill([8], float("nan")), tf.reduce_sum)
