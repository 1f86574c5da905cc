"""Sparse gradients through the tree functions. TensorFlow's ``tf.IndexedSlices`` (an
embedding's): norms, finiteness and clipping are the dense gradient's (repeated rows summed),
results stay sparse, also under ``tf.function``. torch's sparse COO gradients: a typed
error naming the leaf, on every tree function."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

try:
    import tensorflow as tf
except ImportError:  # the torch test below still runs
    tf = None
needs_tf = pytest.mark.skipif(tf is None, reason="tensorflow is not installed")

VALUES = np.array([[3.0, 0.0], [1.0, -2.0], [0.5, 4.0]], np.float32)
INDICES = np.array([1, 3, 1], np.int64)  # row 1 twice: the dense gradient sums them


def _grads(values=VALUES, scale=1.0):
    sparse = tf.IndexedSlices(
        tf.constant(values * scale), tf.constant(INDICES), tf.constant([5, 2])
    )
    return {"embedding": sparse, "bias": tf.constant([1.0 * scale, -2.0 * scale])}


def _dense(tree):
    return {k: tf.convert_to_tensor(g).numpy() for k, g in tree.items()}


def _check_sparse(out, want_dense):
    assert isinstance(out["embedding"], tf.IndexedSlices)
    assert sorted(out["embedding"].indices.numpy().tolist()) == [1, 3]  # unique rows
    for k, want in want_dense.items():
        np.testing.assert_allclose(tf.convert_to_tensor(out[k]).numpy(), want, rtol=1e-6)


@needs_tf
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_clip_by_global_norm_uses_the_dense_norm_and_stays_sparse(compiled):
    dense = _dense(_grads())
    want_norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in dense.values()))
    # TF's own clip_by_global_norm takes the raw values' norm: a different number here
    raw = np.sqrt(float(np.sum(VALUES.astype(np.float64) ** 2)) + 5.0)
    assert abs(raw - want_norm) > 0.2  # 5.94 against 6.18
    clip = lambda g: ns.clip_by_global_norm(g, 1.0)
    out, norm = (tf.function(clip) if compiled else clip)(_grads())
    assert float(norm) == pytest.approx(want_norm, rel=1e-6)
    _check_sparse(out, {k: g / want_norm for k, g in dense.items()})
    assert float((tf.function(ns.global_norm) if compiled else ns.global_norm)(_grads())) == (
        pytest.approx(want_norm, rel=1e-6)
    )


@needs_tf
def test_clip_by_value_and_unscale_keep_the_gradient_sparse():
    dense = _dense(_grads())
    _check_sparse(
        ns.clip_by_value(_grads(), -1.0, 1.0), {k: np.clip(g, -1, 1) for k, g in dense.items()}
    )
    scaler = ns.LossScaler()
    state = scaler.init()
    unscale = tf.function(lambda g, s: scaler.unscale(g, s))
    for run in (scaler.unscale, unscale):
        out, finite = run(_grads(scale=float(state.scale)), state)
        assert bool(finite)
        _check_sparse(out, dense)


@needs_tf
def test_non_finite_values_are_found_at_the_gradient_path():
    values = VALUES.copy()
    values[2, 1] = np.nan
    grads = _grads(values)
    assert not bool(ns.all_finite(grads))
    assert not bool(tf.function(ns.all_finite)(grads))
    (record,) = ns.find_nonfinite(grads)  # was silently [] when the slices were one opaque leaf
    assert record.path == "['embedding']" and record.nan_count == 1
    with pytest.raises(ns.NonFiniteError):
        ns.assert_finite(grads)


@needs_tf
def test_agc_makes_sparse_gradients_dense(monkeypatch):
    params = {"embedding": tf.ones([5, 2]), "bias": tf.ones([2])}
    densified = []
    convert = tf.convert_to_tensor

    def counted(x, *args, **kwargs):
        densified.extend([1] if isinstance(x, tf.IndexedSlices) else [])
        return convert(x, *args, **kwargs)

    monkeypatch.setattr(tf, "convert_to_tensor", counted)
    out = ns.AGC(0.1).clip(_grads(), params)
    assert densified == [1]  # the leaves and their paths come from one walk
    monkeypatch.undo()
    want = ns.AGC(0.1).clip(_dense(_grads()), {k: p.numpy() for k, p in params.items()})
    assert not isinstance(out["embedding"], tf.IndexedSlices)
    for k in want:
        np.testing.assert_allclose(out[k].numpy(), want[k], rtol=1e-6)


def test_torch_sparse_gradients_raise_a_typed_error_naming_the_leaf():
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    grads = {"dense": torch.ones(2), "emb": emb.weight.grad}
    assert grads["emb"].layout == torch.sparse_coo
    calls = [
        lambda: ns.global_norm(grads),
        lambda: ns.clip_by_global_norm(grads, 0.5),
        lambda: ns.all_finite(grads),
        lambda: ns.clip_by_value(grads, -0.5, 0.5),
        lambda: ns.find_nonfinite(grads),
        lambda: ns.assert_finite(grads),
        lambda: ns.LossScaler().unscale(grads, ns.LossScaler().init(backend="torch")),
        lambda: ns.ZClip().update(grads, ns.ZClip().init(backend="torch")),
        lambda: ns.AGC().clip(grads, {"dense": torch.ones(2), "emb": emb.weight.detach()}),
    ]
    for call in calls:
        with pytest.raises(ns.InvalidArgumentError, match=r"layout=torch.sparse_coo at \['emb'\]"):
            call()
