"""ZClip with float64 gradients whose (finite, float64) global norm is past float32's range:
the norm was cast to float32 (inf), so the step was taken as non-finite and the gradients
passed unclipped. The factor is now taken in the norm's dtype; the state stays float32."""

import os

import numpy as np
import pytest

from numstab import ZClip

BIG = 1e39  # finite in float64, inf in float32
EPS64 = float(np.finfo(np.float64).eps)
# the clipped value BIG * limit / (norm + 1e-6) is float64 arithmetic on exact inputs (limit 1.0
# or the float32 mean 0.5): at most 8 roundings of <= eps64 each (leaf and global norm: squares,
# sum, sqrt; + 1e-6, divide, multiply); a float32 factor would be eps32-far and fail
RTOL64 = 8 * EPS64


def _convert(name, x):
    if name == "torch":
        torch = pytest.importorskip("torch")
        return torch.tensor(x, dtype=torch.float64)
    if name == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        return tf.constant(x, tf.float64)
    return np.asarray(x, np.float64)


def _state_dtypes(state):
    return [np.asarray(x).dtype.name for x in state]


@pytest.mark.parametrize("name", ["numpy", "torch", "tensorflow"])
def test_warmup_clips_a_float64_norm_past_float32(name):
    z = ZClip(warmup_steps=2, max_grad_norm=1.0)  # its state, still in the warmup, below
    g = _convert(name, [BIG, 0.0])
    out, state = z.update([g], z.init(g))
    np.testing.assert_allclose(np.asarray(out[0]), [1.0, 0.0], rtol=RTOL64, atol=0)
    assert np.asarray(out[0]).dtype == np.float64
    assert int(np.asarray(state.count)) == 1  # a finite norm: collected
    assert _state_dtypes(state) == ["int32", "float32", "float32", "float32", "float32"]
    # a non-finite float64 gradient still passes untouched and changes no statistics
    out, state = z.update([_convert(name, [np.inf, 0.0])], state)
    np.testing.assert_array_equal(np.asarray(out[0]), [np.inf, 0.0])
    assert int(np.asarray(state.count)) == 1


@pytest.mark.parametrize("name", ["numpy", "torch", "tensorflow"])
def test_active_step_clips_a_float64_spike_past_float32(name):
    z = ZClip(warmup_steps=2, max_grad_norm=None)
    state = z.init(_convert(name, [0.0]))
    for _ in range(2):
        _, state = z.update([_convert(name, [0.5, 0.0])], state)
    out, state = z.update([_convert(name, [BIG, 0.0])], state)
    np.testing.assert_allclose(np.asarray(out[0]), [0.5, 0.0], rtol=RTOL64, atol=0)  # to the mean
    out, _ = z.update([_convert(name, [0.25, 0.0])], state)  # small norms untouched
    np.testing.assert_array_equal(np.asarray(out[0]), [0.25, 0.0])


def test_torch_integration_clips_a_float64_model():
    torch = pytest.importorskip("torch")
    from numstab.integrations.torch import ZClip as TorchZClip

    model = torch.nn.Linear(2, 1).double()
    model.weight.grad = torch.tensor([[BIG, 0.0]], dtype=torch.float64)
    model.bias.grad = torch.zeros(1, dtype=torch.float64)
    clipper = TorchZClip(warmup_steps=1, max_grad_norm=1.0)
    norm = clipper.step(model)
    assert float(norm) == BIG
    np.testing.assert_allclose(model.weight.grad.numpy(), [[1.0, 0.0]], rtol=RTOL64, atol=0)
    assert clipper.state.mean.dtype == torch.float32


def test_optax_zclip_scans_float64_leaves_under_x64():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from numstab.integrations.optax import zclip

    with jax.enable_x64(True):
        tx = zclip(warmup_steps=2, max_grad_norm=None)
        params = {"w": jnp.ones(2, jnp.float64), "b": jnp.ones(2, jnp.float32)}
        w = jnp.asarray([[0.5, 0.0], [0.5, 0.0], [BIG, 0.0]], jnp.float64)
        grads = {"w": w, "b": jnp.zeros((3, 2), jnp.float32)}

        def body(state, g):
            updates, state = tx.update(g, state, params)
            return state, updates

        state0 = tx.init(params)
        state, updates = jax.jit(lambda s: jax.lax.scan(body, s, grads))(state0)
        assert [x.dtype for x in state] == [x.dtype for x in state0]
        np.testing.assert_allclose(np.asarray(updates["w"][-1]), [0.5, 0.0], rtol=RTOL64, atol=0)


def test_keras_zclip_optimizer_clips_float64_variables():
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow backend")
    tf = pytest.importorskip("tensorflow")
    from numstab.integrations.keras_clipping import ZClipOptimizer

    var = keras.Variable(np.array([1.0, 2.0]), dtype="float64")
    opt = ZClipOptimizer(keras.optimizers.SGD(1.0), warmup_steps=1, max_grad_norm=1.0)
    opt.apply([tf.constant([BIG, 0.0], tf.float64)], [var])
    # 1 - (1 +- RTOL64): the subtraction is exact (Sterbenz), so RTOL64 of the step's 1.0
    np.testing.assert_allclose(var.numpy(), [0.0, 2.0], rtol=0, atol=RTOL64)
    assert int(opt.zclip_state.count) == 1
