"""LossScaleState and ZClipState fields are checked for kind and static shape (§8, §13.1):
a vector field was broadcast silently (NumPy, JAX, TensorFlow) or raised torch's
"scalar tensor expected"; None or a string raised Python's TypeError."""

import numpy as np
import pytest

import numstab as ns
from numstab.errors import InvalidArgumentError

BACKENDS = {"numpy": np.asarray}
torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")
jnp = pytest.importorskip("jax.numpy")
BACKENDS.update(torch=torch.as_tensor, tensorflow=tf.constant, jax=jnp.asarray)


def _loss_state(mk, **fields):
    base = {
        "scale": np.float32(4.0),
        "growth_tracker": np.int32(0),
        "hysteresis_left": np.int32(1),
    }
    base.update(fields)
    return ns.LossScaleState(
        **{k: (v if v is None or isinstance(v, str) else mk(v)) for k, v in base.items()}
    )


BAD_LOSS_FIELDS = [
    ("scale", np.array([4.0, 8.0], np.float32)),
    ("growth_tracker", np.zeros(2, np.int32)),
    ("hysteresis_left", np.ones((1, 1), np.int32)),
    ("scale", np.int32(4)),
    ("growth_tracker", np.float32(0)),
    ("growth_tracker", None),
    ("scale", "a"),
]


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize(("field", "value"), BAD_LOSS_FIELDS)
def test_loss_scale_state_field_rejected(name, field, value):
    mk = BACKENDS[name]
    state = _loss_state(mk, **{field: value})
    scaler = ns.LossScaler()
    grads = [mk(np.ones(2, np.float32))]
    with pytest.raises(InvalidArgumentError, match=rf"state\.{field}"):
        scaler.unscale(grads, state)
    with pytest.raises(InvalidArgumentError, match=rf"state\.{field}"):
        scaler.update(state, True)
    with pytest.raises(InvalidArgumentError, match=rf"state\.{field}"):
        scaler.scale(mk(np.float32(1.0)), state)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_loss_scale_state_of_python_numbers_accepted(name):
    mk = BACKENDS[name]
    state = ns.LossScaleState(4.0, 0, 1)
    grads, finite = ns.LossScaler().unscale([mk(np.ones(2, np.float32))], state)
    np.testing.assert_array_equal(np.asarray(grads[0]), [0.25, 0.25])
    assert bool(np.asarray(finite))


def _zclip_state(mk, **fields):
    base = {
        "count": np.int32(1),
        "buffer": np.zeros(1, np.float32),
        "mean": np.float32(1.0),
        "var": np.float32(0.01),
        "norm": np.float32(0.0),
    }
    base.update(fields)
    return ns.ZClipState(**{k: (v if v is None else mk(v)) for k, v in base.items()})


BAD_ZCLIP_FIELDS = [
    ("mean", np.array([1.0, 100.0], np.float32)),
    ("var", np.array([0.01, 0.01], np.float32)),
    ("count", np.ones(2, np.int32)),
    ("norm", np.zeros(1, np.float32)),
    ("count", np.float32(1)),
    ("mean", np.int32(1)),
    ("var", None),
]


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize(("field", "value"), BAD_ZCLIP_FIELDS)
def test_zclip_state_field_rejected(name, field, value):
    mk = BACKENDS[name]
    zclip = ns.ZClip(warmup_steps=1, max_grad_norm=None)
    state = _zclip_state(mk, **{field: value})
    with pytest.raises(InvalidArgumentError, match=rf"state\.{field}"):
        zclip.update([mk(np.array([3.0, 4.0], np.float32))], state)
    with pytest.raises(InvalidArgumentError, match=rf"state\.{field}"):
        zclip.coefficient(mk(np.float32(5.0)), state)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_zclip_good_state_still_clips(name):
    mk = BACKENDS[name]
    zclip = ns.ZClip(warmup_steps=1, max_grad_norm=None)
    grads, _ = zclip.update([mk(np.array([3.0, 4.0], np.float32))], _zclip_state(mk))
    out = np.asarray(grads[0])
    np.testing.assert_allclose(out / out[0], [1.0, 4.0 / 3.0], rtol=1e-6)  # one factor


def test_jit_state_fields_are_static():
    import jax

    zclip = ns.ZClip(warmup_steps=1, max_grad_norm=None)
    state = zclip.init(backend="jax")
    run = jax.jit(lambda g, s: zclip.update(g, s))
    _, new = run([jnp.array([3.0, 4.0])], state)
    assert new.count.shape == ()
    bad = state._replace(mean=jnp.zeros(2, jnp.float32))
    with pytest.raises(InvalidArgumentError, match=r"state\.mean"):
        run([jnp.array([3.0, 4.0])], bad)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.5, 1.5])
def test_backoff_factor_message_states_open_interval(value):
    with pytest.raises(InvalidArgumentError, match=r"backoff_factor in \(0, 1\)\. "):
        ns.LossScaler(backoff_factor=value)
