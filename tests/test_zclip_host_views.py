"""ZClip's statistics on host views: eagerly, on arrays in host memory, ``ZClip.coefficient``
runs its 0-d math on NumPy views of them (``Backend.host_view``), at NumPy's cost per op
instead of the framework's eager dispatch. The results must be the framework's own
arrays, bit for bit those of the same step run on the framework's ops."""

import numpy as np
import pytest

from numstab import ZClip
from numstab.backends import load_backend

NAN, INF = float("nan"), float("inf")
#: warmup (a NaN and an inf in it), a zero, steady norms, spikes, a NaN after the warmup
NORMS = [0.5, NAN, 0.7, INF, 0.6, 0.0, 0.55, 0.65, 9.0, 0.6, 40.0, 0.62, NAN, 0.58, 3.0, 1e-30]
CONFIGS = [
    {"warmup_steps": 4},
    {"warmup_steps": 3, "mode": "percentile", "max_grad_norm": None},
    {"warmup_steps": 3, "clip_option": "mean", "skip_update_on_spike": True, "z_thresh": 1.5},
    {"warmup_steps": 0, "alpha": 0.5, "clip_factor": 0.7, "max_grad_norm": 2.0},
]


def _framework(name):
    if name == "torch":
        torch = pytest.importorskip("torch")
        return lambda x, dtype: torch.tensor(x, dtype=getattr(torch, dtype))
    if name == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return lambda x, dtype: jnp.asarray(x, dtype=dtype)
    tf = pytest.importorskip("tensorflow")
    return lambda x, dtype: tf.constant(x, dtype=dtype)


def _run(zclip, be, norms, monkeypatch, views: bool):
    with monkeypatch.context() as patch:
        if not views:
            patch.setattr(type(be), "host_view", lambda self, x: None)
        state = zclip.init(norms[0], backend=be.name)
        steps = []
        for norm in norms:
            coef, state = zclip.coefficient(norm, state, backend=be.name)
            steps.append((coef, state))
    return steps


def _bits(be, x):
    host = np.asarray(be.to_numpy(x))
    return host.dtype.name, host.tobytes()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(map(str, c.values())))
@pytest.mark.parametrize(
    "name,dtype",
    [("torch", "float32"), ("torch", "float64"), ("jax", "float32"), ("tensorflow", "float32"),
     ("tensorflow", "float64")],
)  # fmt: skip
def test_host_views_give_the_frameworks_bits(name, dtype, config, monkeypatch):
    make, be = _framework(name), load_backend(name)
    norms = [make(x, dtype) for x in NORMS]
    assert be.host_view(norms[0]) is not None  # the fast path is taken here
    zclip = ZClip(**config)
    fast = _run(zclip, be, norms, monkeypatch, views=True)
    slow = _run(zclip, be, norms, monkeypatch, views=False)
    for step, ((coef, state), (want_coef, want_state)) in enumerate(zip(fast, slow, strict=True)):
        for got, want in zip((coef, *state), (want_coef, *want_state), strict=True):
            assert type(got) is type(want), step  # the framework's arrays, not NumPy's
            assert _bits(be, got) == _bits(be, want), (step, got, want)
    assert any(float(be.to_numpy(c)) < 1 for c, _ in fast)  # the norms were clipped


def test_host_view_refuses_what_a_read_would_wait_for():
    torch = pytest.importorskip("torch")
    be = load_backend("torch")
    x = torch.ones(())
    assert be.host_view(x) is not None
    assert be.host_view(torch.ones((), requires_grad=True)) is None
    assert be.host_view(torch.ones((), dtype=torch.bfloat16)) is None  # NumPy lacks it
    assert be.host_view(torch.nn.Parameter(torch.ones(()))) is None
    seen = []
    torch.func.grad(lambda t: seen.append(be.host_view(t)) or t.sum())(torch.ones(2))
    assert seen == [None]
    assert load_backend("numpy").host_view(np.ones(())) is None  # already NumPy: no path


def test_host_view_is_none_under_traces():
    jax = pytest.importorskip("jax")
    tf = pytest.importorskip("tensorflow")
    seen = []
    jax.jit(lambda x: seen.append(load_backend("jax").host_view(x)) or x)(jax.numpy.ones(()))
    tf.function(lambda x: seen.append(load_backend("tensorflow").host_view(x)) or x)(tf.ones(()))
    assert seen == [None, None]


def test_zclip_under_jit_and_tf_function_still_steps():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    zclip = ZClip(warmup_steps=2)
    state = zclip.init(jnp.ones(()))
    step = jax.jit(zclip.coefficient)
    for norm in (0.5, 0.6, 30.0):
        coef, state = step(jnp.asarray(norm), state)
    assert float(coef) < 1 and int(state.count) == 2


def test_a_state_of_another_warmup_length_is_refused_under_jit_and_tf_function():
    """The buffer's static shape is checked: one of another ZClip's warmup_steps was
    broadcast silently (or raised the framework's own error), traced or not."""
    from numstab.errors import InvalidArgumentError

    jax = pytest.importorskip("jax")
    tf = pytest.importorskip("tensorflow")
    zclip, other = ZClip(warmup_steps=3), ZClip(warmup_steps=5)
    jax_state = other.init(backend="jax")
    tf_state = other.init(backend="tensorflow")
    for call in (
        lambda: jax.jit(zclip.coefficient)(jax.numpy.asarray(1.0), jax_state),
        lambda: jax.jit(zclip.update)([jax.numpy.ones(2)], jax_state),
        lambda: tf.function(zclip.coefficient, autograph=False)(tf.constant(1.0), tf_state),
        lambda: tf.function(zclip.update, autograph=False)([tf.ones(2)], tf_state),
    ):
        with pytest.raises(InvalidArgumentError, match=r"state.buffer.shape=\(5,\)"):
            call()
