"""cross_entropy and fused_linear_cross_entropy under torch's transforms and AMP: autocast,
create_graph, torch.func (grad, vjp, vmap), torch.compile warnings; GradScaler's scaled loss
dtype; TensorFlow 1 graph labels; nested tensors in the finiteness readers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import numstab as ns  # noqa: E402
from numstab.errors import InvalidArgumentError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EPS64 = torch.finfo(torch.float64).eps


def _close64(got, want):
    """float64 results of the same sums in another order (D = 8, V = 40 terms): a few ulps
    of the largest value."""
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=32 * EPS64 * scale)


V, D, ROWS = 40, 8, 12


def _data(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(ROWS, D, generator=g, dtype=dtype)
    w = torch.randn(V, D, generator=g, dtype=dtype)
    y = torch.randint(0, V, (ROWS,), generator=g)
    y[3] = -100
    return h, w, y


def _unfused(h, w, y, reduction="mean", label_smoothing=0.0):
    return F.cross_entropy(h @ w.T, y, reduction=reduction, label_smoothing=label_smoothing)


# -- 1: autocast ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_under_autocast_matches_unfused_autocast(dtype, bias):
    """fp32 master weights under CPU autocast, several chunks: what F.linear + F.cross_entropy
    compute under the same autocast (the logits in ``dtype``, the loss in float32)."""
    h, w, y = _data(torch.float32)
    b = torch.randn(V) if bias else None
    grads = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (h, w) + ((b,) if bias else ())]
        with torch.autocast("cpu", dtype=dtype):
            if fused:
                bb = leaves[2] if bias else None
                loss = ns.fused_linear_cross_entropy(leaves[0], leaves[1], y, bias=bb, chunk_size=4)
            else:
                loss = F.cross_entropy(F.linear(*leaves), y)
        loss.backward()
        assert loss.dtype == torch.float32
        grads.append((loss.detach(), [t.grad for t in leaves]))
    (got, got_grads), (want, want_grads) = grads
    eps = torch.finfo(dtype).eps
    # the same 16-bit logits, then float32 (the unfused rounds dlogits to 16 bits, the fused
    # sums dweight in float32 over chunks): a few 16-bit ulps of the largest entry
    torch.testing.assert_close(got, want, rtol=8 * eps, atol=0)
    for a, e in zip(got_grads, want_grads, strict=True):
        assert a.dtype == e.dtype == torch.float32
        torch.testing.assert_close(a, e, rtol=0, atol=4 * eps * float(e.abs().max()))


def test_fused_mixed_dtypes_outside_autocast_still_raise():
    h, w, y = _data(torch.float32)
    with pytest.raises(InvalidArgumentError, match="weight of hidden's dtype"):
        ns.fused_linear_cross_entropy(h.bfloat16(), w, y)


# -- 2: higher-order gradients ---------------------------------------------------------------
def test_fused_create_graph_raises_typed():
    h, w, y = _data()
    h.requires_grad_()
    loss = ns.fused_linear_cross_entropy(h, w, y, chunk_size=5)
    with pytest.raises(InvalidArgumentError, match=r"cross_entropy\(hidden @ weight.T"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_fused_second_order_torch_func_raises_typed():
    h, w, y = _data()
    f = lambda h: ns.fused_linear_cross_entropy(h, w, y, chunk_size=5)
    with pytest.raises(InvalidArgumentError, match="higher-order"):
        torch.func.grad(lambda h: torch.func.grad(f)(h).square().sum())(h)
    with pytest.raises(InvalidArgumentError, match="jvp of its gradient"):
        torch.func.hessian(f)(h)


def test_fused_jacfwd_matches_unfused():
    """No input needs a reverse-mode gradient: forward-mode AD runs through the chunk loop."""
    h, w, y = _data()
    for reduction in ("mean", "none"):
        got = torch.func.jacfwd(
            lambda h, r=reduction: ns.fused_linear_cross_entropy(h, w, y, chunk_size=5, reduction=r)
        )(h)
        want = torch.func.jacfwd(lambda h, r=reduction: _unfused(h, w, y, r))(h)
        _close64(got, want)


# -- 3: torch.func on the fused loss -----------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"label_smoothing": 0.1}, {"reduction": "sum"}])
def test_fused_torch_func_grad_matches_unfused(kwargs):
    h, w, y = _data()
    fused = lambda h, w: ns.fused_linear_cross_entropy(h, w, y, chunk_size=5, **kwargs)
    unfused = lambda h, w: _unfused(h, w, y, **kwargs)
    got = torch.func.grad(fused, argnums=(0, 1))(h, w)
    want = torch.func.grad(unfused, argnums=(0, 1))(h, w)
    for a, e in zip(got, want, strict=True):  # float64: the same sums in another order
        _close64(a, e)


def test_fused_vmap_and_jacrev_match_unfused():
    h, w, _ = _data()
    hb = torch.stack([h, 2 * h, -h])
    yb = torch.randint(0, V, (3, ROWS), generator=torch.Generator().manual_seed(1))
    yb[1, 4] = -100
    for reduction in ("mean", "none"):
        fn = lambda h, y, r=reduction: ns.fused_linear_cross_entropy(
            h, w, y, chunk_size=5, reduction=r
        )
        got = torch.vmap(fn)(hb, yb)
        want = torch.stack([_unfused(hb[i], w, yb[i], reduction) for i in range(3)])
        _close64(got, want)
    got = torch.vmap(torch.func.grad(lambda h, y: ns.fused_linear_cross_entropy(h, w, y)))(hb, yb)
    want = torch.vmap(torch.func.grad(lambda h, y: _unfused(h, w, y)))(hb, yb)
    _close64(got, want)
    y = yb[0]
    got = torch.func.jacrev(
        lambda h: ns.fused_linear_cross_entropy(h, w, y, reduction="none", chunk_size=5)
    )(h)
    want = torch.func.jacrev(lambda h: _unfused(h, w, y, "none"))(h)
    _close64(got, want)


# -- 4: torch.vmap over cross_entropy ------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"label_smoothing": 0.1},
        {"z_loss": 1e-2},
        {"reduction": "none"},
        {"reduction": "sum", "label_smoothing": 0.2, "z_loss": 1e-3},
    ],
)
def test_cross_entropy_vmap_over_logits_and_labels(kwargs):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (3, 4), generator=g)
    y[0, 1] = -100
    got = torch.vmap(lambda x, y: ns.cross_entropy(x, y, **kwargs))(x, y)
    want = torch.stack([ns.cross_entropy(x[i], y[i], **kwargs) for i in range(3)])
    _close64(got, want)


def test_cross_entropy_vmap_out_of_range_label_is_a_nan_row():
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    y = torch.tensor([[0, 1, 2], [3, 7, 4]])
    rows = torch.vmap(lambda x, y: ns.cross_entropy(x, y, reduction="none"))(x, y)
    assert torch.isnan(rows[1, 1]) and torch.isfinite(rows.flatten()[[0, 1, 2, 3, 5]]).all()
    means = torch.vmap(lambda x, y: ns.cross_entropy(x, y))(x, y)
    assert torch.isfinite(means[0]) and torch.isnan(means[1])


# -- 5: torch.compile without Dynamo warnings ------------------------------------------------------
def test_compiling_cross_entropy_emits_no_lru_cache_warning():
    torch._dynamo.reset()
    x, y = torch.randn(4, 6), torch.randint(0, 6, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(lambda x, y: ns.cross_entropy(x, y, label_smoothing=0.1), backend="eager")(
            x, y
        )
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "lru_cache" in m], messages


# -- 6: GradScaler's scaled loss ----------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (3,)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_grad_scaler_scaled_loss_as_torch_amp(shape, dtype):
    from numstab.integrations.torch import GradScaler

    loss = torch.full(shape, 3.0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.amp.GradScaler on CPU
        want = torch.amp.GradScaler("cpu").scale(loss)
    got = GradScaler("cpu").scale(loss)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if shape == () and dtype is torch.float16:  # 3 * 2**16 overflows float16, not float32
        assert got.item() == 3.0 * 2**16


# -- 8: nested tensors in the backend's readers ---------------------------------------------------
def test_finiteness_readers_take_nested_tensors():
    from numstab.frameworks.torch.backend import BACKEND

    clean = torch.nested.nested_tensor([torch.tensor([1.0, -5.0, 2.0]), torch.tensor([3.0])])
    dirty = torch.nested.nested_tensor([torch.randn(3), torch.tensor([1.0, math.nan])])
    assert ns.find_nonfinite(clean) == []
    assert not bool(ns.all_finite(dirty)) and bool(ns.all_finite(clean))
    norms = BACKEND.native_leaf_norms([clean, torch.tensor([-7.0])], math.inf, "float32")
    assert norms.tolist() == [5.0, 7.0]
    assert BACKEND.native_leaf_norms([clean], 2, "float32").item() == pytest.approx(math.sqrt(39))


# -- 7: TensorFlow 1 graph labels -----------------------------------------------------------
_TF1 = """
import numpy as np, tensorflow as tf, numstab as ns
tf.compat.v1.disable_eager_execution()
with tf.Graph().as_default():
    h = tf.compat.v1.placeholder(tf.float32, (6, 4))
    w = tf.compat.v1.placeholder(tf.float32, (9, 4))
    y = tf.compat.v1.placeholder(tf.int64, (6,))
    loss = ns.fused_linear_cross_entropy(h, w, y, chunk_size=4)
    rng = np.random.default_rng(0)
    hv, wv = rng.normal(size=(6, 4)).astype("f4"), rng.normal(size=(9, 4)).astype("f4")
    yv = np.array([1, 2, -100, 3, 4, 5])
    with tf.compat.v1.Session() as s:
        out = s.run(loss, {h: hv, w: wv, y: yv})
x = hv.astype("f8") @ wv.T.astype("f8")
m = yv != -100
lse = np.log(np.exp(x).sum(-1))
print(out, (lse[m] - x[m, yv[m]]).mean(), np.abs(lse[m]).max())
"""


def test_fused_with_tensorflow1_graph_labels():
    """Graph tensors of TF 1 compare by identity (``y == -100`` is False): the masks must
    not take that bool for a mask. A subprocess: disable_eager_execution is global."""
    pytest.importorskip("tensorflow")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _TF1],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got, want, scale = map(float, done.stdout.split()[-3:])
    # float32 logits and log-sum-exps, each rounded before the subtraction
    assert abs(got - want) <= 16 * np.finfo(np.float32).eps * scale, (got, want)
