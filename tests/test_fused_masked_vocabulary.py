"""fused_linear_cross_entropy with a ``-inf`` bias on some classes (a masked, e.g. padded,
vocabulary) against the unfused ``cross_entropy(hidden @ weight.T + bias, ...)`` of the same
backend and mode (docs/semantics.md §4.4.2-4.4.3, §11): loss values and the gradients of
hidden, weight and bias, with and without label smoothing (spread over the K_valid unmasked
classes only), z-loss, ignore_index and every reduction; NumPy (values), torch, JAX (eager and
``jax.jit``) and TensorFlow (eager and ``tf.function``), native and generic kernels.

Before the fix, label smoothing made the fused loss ``+inf`` while its gradients were finite
and gave every masked class ``-eps/V``; a row whose label is masked had a nonzero gradient.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import numstab as ns
from conformance_tests.tolerances import GRADIENT, VALUE
from numstab.fused_cross_entropy import fused_linear_cross_entropy
from tests.jax_devices import cpu_devices_env

TOKENS, WIDTH, VOCAB, CHUNK = 14, 8, 11, 4  # 3 full chunks and a short one
MASKED = (3, 9, 10)  # -inf bias: not contiguous, the last class among them
#: float32 on both sides (conformance_tests/tolerances.py); the fused and unfused products
#: sum in different orders, and gradients are compared relative to their largest entry
VALUE_TOL, GRADIENT_TOL = VALUE["float32"], GRADIENT["float32"]
SETTINGS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "smoothing_z_loss": {"label_smoothing": 0.1, "z_loss": 1e-2},
    "all_smoothing": {"label_smoothing": 1.0},
}
MODES = [
    ("numpy", False),
    ("torch", False),
    ("jax", False),
    ("jax", True),
    ("tensorflow", False),
    ("tensorflow", True),
]
MODE_IDS = [f"{name}-{'compiled' if compiled else 'eager'}" for name, compiled in MODES]


def _data(seed=0, masked=MASKED, ignored=(2, 7), masked_targets=()):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(TOKENS, WIDTH)).astype(np.float32)
    weight = (rng.normal(size=(VOCAB, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    bias = (rng.normal(size=VOCAB) * 0.1).astype(np.float32)
    bias[list(masked)] = -np.inf
    valid = [c for c in range(VOCAB) if c not in masked] or [0]
    labels = rng.choice(valid, size=TOKENS)
    for row, cls in masked_targets:
        labels[row] = cls
    labels[list(ignored)] = -100
    cotangent = rng.normal(size=TOKENS).astype(np.float32)
    return hidden, weight, bias, labels, cotangent


def _unfused(h, w, y, b, **kwargs):
    return ns.cross_entropy(h @ _transpose(w) + b, y, **kwargs)


def _fused(h, w, y, b, chunk=CHUNK, **kwargs):
    return fused_linear_cross_entropy(h, w, y, bias=b, chunk_size=chunk, **kwargs)


def _transpose(w):
    return w.T if hasattr(w, "T") else __import__("tensorflow").transpose(w)


def _run(name, compiled, fn, data, kwargs):
    """(loss, [d hidden, d weight, d bias] or None) of sum(loss * cotangent), as NumPy."""
    hidden, weight, bias, labels, cotangent = data
    cot = cotangent if kwargs.get("reduction") == "none" else np.float32(cotangent[0])
    call = lambda h, w, y, b: fn(h, w, y, b, **kwargs)
    if name == "numpy":
        return np.asarray(call(hidden, weight, labels, bias), np.float64), None
    if name == "torch":
        import torch

        h, w, b = (torch.tensor(a, requires_grad=True) for a in (hidden, weight, bias))
        out = call(h, w, torch.tensor(labels), b)
        grads = torch.autograd.grad((out * torch.tensor(cot)).sum(), [h, w, b])
        return out.detach().numpy(), [g.numpy() for g in grads]
    if name == "jax":
        import jax
        import jax.numpy as jnp

        def objective(h, w, b):
            out = call(h, w, jnp.asarray(labels), b)
            return (out * jnp.asarray(cot)).sum(), out

        vg = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)
        (_, out), grads = (jax.jit(vg) if compiled else vg)(
            *(jnp.asarray(a) for a in (hidden, weight, bias))
        )
        return np.asarray(out), [np.asarray(g) for g in grads]
    import tensorflow as tf

    def step(h, w, b):
        with tf.GradientTape() as tape:
            tape.watch([h, w, b])
            out = call(h, w, tf.constant(labels), b)
            total = tf.reduce_sum(out * tf.constant(cot))
        return out, tape.gradient(total, [h, w, b])

    out, grads = (tf.function(step) if compiled else step)(
        *(tf.constant(a) for a in (hidden, weight, bias))
    )
    return out.numpy(), [g.numpy() for g in grads]


def _skip_missing(name):
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")


def _compare(name, compiled, data, kwargs, chunk=CHUNK):
    """Fused (in ``compiled`` mode) against unfused (eager) on backend ``name``."""
    _skip_missing(name)
    got, got_grads = _run(name, compiled, functools.partial(_fused, chunk=chunk), data, kwargs)
    want, want_grads = _run(name, False, _unfused, data, kwargs)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, *VALUE_TOL, err_msg="loss")
    if want_grads is None:
        return got, None
    for arg, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=True):
        assert g.shape == w.shape, arg
        scale = max(float(np.abs(w).max()), 1e-30)  # relative to the gradient's own size
        np.testing.assert_allclose(g / scale, w / scale, *GRADIENT_TOL, err_msg=arg)
    return got, got_grads


def _assert_masked_classes_untouched(grads, masked=MASKED):
    """A masked class gets exactly 0: no smoothing mass, no softmax probability."""
    if grads is None:
        return
    _, dweight, dbias = grads
    assert np.all(dweight[list(masked)] == 0.0), dweight[list(masked)]
    assert np.all(dbias[list(masked)] == 0.0), dbias[list(masked)]
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(("name", "compiled"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_masked_bias_equals_unfused(name, compiled, setting, reduction, impl):
    kwargs = {**SETTINGS[setting], "reduction": reduction}
    got, grads = _compare(name, compiled, _data(), kwargs)
    assert np.isfinite(got).all()
    _assert_masked_classes_untouched(grads)


@pytest.mark.parametrize(("name", "compiled"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("setting", ["plain", "smoothing_z_loss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_masked_classes_get_zero_for_either_cotangent_sign(
    name, compiled, setting, reduction, impl
):
    """The masked rows of dweight and dbias are 0, and every value equals unfused, for a
    negative and a positive cotangent: the mask is folded into backward's multiply by the
    cotangent (one pass over dweight, not a zeroing pass and then the multiply)."""
    for sign in (-1.0, 1.0):
        hidden, weight, bias, labels, cotangent = _data(seed=6)
        data = (hidden, weight, bias, labels, (sign * np.abs(cotangent)).astype(np.float32))
        _, grads = _compare(name, compiled, data, {**SETTINGS[setting], "reduction": reduction})
        _assert_masked_classes_untouched(grads)


@pytest.mark.parametrize(("name", "compiled"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_custom_ignore_index(name, compiled, reduction):
    """An ignore_index that is a valid class id: its rows add nothing."""
    data = list(_data(seed=1, ignored=()))
    data[3] = np.where(np.arange(TOKENS) % 4 == 1, 5, data[3])
    kwargs = {"label_smoothing": 0.1, "z_loss": 1e-3, "ignore_index": 5, "reduction": reduction}
    got, grads = _compare(name, compiled, tuple(data), kwargs)
    if reduction == "none":
        assert np.all(got[1::4] == 0.0)
    _assert_masked_classes_untouched(grads)


@pytest.mark.parametrize(("name", "compiled"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("setting", ["plain", "smoothing_z_loss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_masked_target_costs_inf_with_zero_gradient(name, compiled, setting, reduction, impl):
    """A row whose label is a masked class costs +inf and adds no gradient (§4.4.7)."""
    data = _data(seed=2, masked_targets=((4, 9), (11, 3)))
    kwargs = {**SETTINGS[setting], "reduction": reduction}
    got, grads = _compare(name, compiled, data, kwargs)
    if reduction == "none":
        assert got[4] == np.inf and got[11] == np.inf
        assert np.isfinite(np.delete(got, [4, 11])).all()
    else:
        assert got == np.inf
    if grads is not None:
        assert np.all(grads[0][[4, 11]] == 0.0)
    _assert_masked_classes_untouched(grads)


@pytest.mark.parametrize(("name", "compiled"), MODES, ids=MODE_IDS)
def test_every_class_masked(name, compiled):
    """K_valid = 0 (every logit -inf): +inf loss and NaN gradients, as unfused."""
    _skip_missing(name)
    data = _data(seed=3, masked=tuple(range(VOCAB)))
    kwargs = {"label_smoothing": 0.1}
    got, grads = _run(name, compiled, _fused, data, kwargs)
    want, want_grads = _run(name, False, _unfused, data, kwargs)
    assert got == want == np.inf
    if grads is not None:
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w))


@pytest.mark.parametrize(("name", "compiled"), MODES, ids=MODE_IDS)
def test_non_finite_bias_other_than_minus_inf_stays_non_finite(name, compiled):
    """+inf and NaN bias entries are not masks: the loss is not finite."""
    _skip_missing(name)
    for bad in (np.inf, np.nan):
        data = list(_data(seed=4))
        data[2] = data[2].copy()
        data[2][0] = bad
        got, _ = _run(name, compiled, _fused, tuple(data), {"label_smoothing": 0.1})
        assert not np.isfinite(got)


@pytest.mark.parametrize(("name", "compiled"), MODES, ids=MODE_IDS)
def test_one_chunk_and_chunk_of_one_row(name, compiled):
    """The chunking does not matter: one chunk for all rows, and one row per chunk."""
    for chunk in (TOKENS, 1):
        data, kwargs = _data(seed=5), SETTINGS["smoothing_z_loss"]
        _, grads = _compare(name, compiled, data, kwargs, chunk=chunk)
        _assert_masked_classes_untouched(grads)


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, PartitionSpec as P
import numstab as ns

assert jax.device_count() == 4, jax.devices()
rng = np.random.default_rng(0)
T, D, V, MASKED = 64, 16, 40, [3, 17, 39]
h = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
W = jnp.asarray(rng.normal(size=(V, D)) * 0.3, jnp.float32)
b = jnp.asarray(rng.normal(size=V) * 0.1, jnp.float32).at[jnp.array(MASKED)].set(-jnp.inf)
y = jnp.asarray(rng.choice([c for c in range(V) if c not in MASKED], T)).at[5].set(-100)
kw = dict(label_smoothing=0.1, z_loss=1e-3)
ref = lambda W, h, b: ns.cross_entropy(h @ W.T + b, y, **kw)
want = jax.value_and_grad(ref, argnums=(0, 1, 2))(W, h, b)
def check(got, what):
    for a, c in zip((got[0], *got[1]), (want[0], *want[1])):
        a, c = np.asarray(a), np.asarray(c)
        err = np.abs(a - c).max() / max(np.abs(c).max(), 1)
        assert err < 64 * np.finfo(np.float32).eps, (what, err)
for mode in ("auto", "explicit"):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(getattr(AxisType, mode.title()),))
    rows, rep = jax.NamedSharding(mesh, P("data")), jax.NamedSharding(mesh, P())
    hs, ys = jax.device_put(h, rows), jax.device_put(y, rows)
    Wr, br = jax.device_put(W, rep), jax.device_put(b, rep)
    def local(h, y, W, b):
        out = ns.fused_linear_cross_entropy(h, W, y, bias=b, chunk_size=5, reduction="sum", **kw)
        return jax.lax.psum(jnp.sum(out), "data")
    def loss(W, h, b):
        specs = (P("data"), P("data"), P(), P())
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(h, ys, W, b) / (T - 1)
    with jax.set_mesh(mesh):
        check(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(Wr, hs, br), mode)
        if mode == "explicit":
            f = lambda W, h, b: ns.fused_linear_cross_entropy(h, W, ys, bias=b, chunk_size=8, **kw)
            check(jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(Wr, hs, br), "jit")
            check(jax.value_and_grad(f, argnums=(0, 1, 2))(Wr, hs, br), "eager")
print("OK")
"""


def test_jax_sharded_rows():
    """Rows sharded over 4 host devices, inside shard_map (Auto and Explicit meshes) and on an
    Explicit mesh under jit and eagerly: the mask is computed per device from the replicated
    bias, and loss and gradients equal the unfused ones."""
    jax = pytest.importorskip("jax")
    if not hasattr(jax, "shard_map") or not hasattr(jax.sharding, "AxisType"):
        pytest.skip("needs jax.shard_map and explicit sharding (jax >= 0.7)")
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED],
        capture_output=True,
        text=True,
        timeout=600,
        env=cpu_devices_env(4),
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]
