"""The eager one-call cross-entropy (``losses._fast_mean``): wherever it answers, it answers
as the full path does; wherever the full path defines something the framework's kernel does
not (masked classes, nothing counted, bad labels), it declines. ``backend="torch"`` (or
"tensorflow") skips the one-call path, so each case compares the two paths in one process."""

import math

import numpy as np
import pytest

import numstab
from numstab.errors import InvalidArgumentError

ROWS, CLASSES = 64, 11
EPS32 = float(np.finfo(np.float32).eps)


def _frameworks():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("tensorflow")
    return {
        "torch": (lambda a: torch.tensor(a), lambda y: torch.tensor(y, dtype=torch.int64)),
        "tensorflow": (lambda a: tf.constant(a), lambda y: tf.constant(y, dtype=tf.int64)),
    }


@pytest.fixture(params=["torch", "tensorflow"])
def framework(request):
    make_x, make_y = _frameworks()[request.param]
    return request.param, make_x, make_y


def _data(seed=0, ignored=0, masked=False):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((ROWS, CLASSES)) * 3).astype(np.float32)
    y = rng.integers(0, CLASSES, ROWS)
    y[:ignored] = -100
    if masked:  # a -inf class in every row, never the target
        x[:, 0] = -np.inf
        y[y == 0] = 1
    return x, y


def _both(name, make_x, make_y, x, y, **kw):
    fast = numstab.cross_entropy(make_x(x), make_y(y), **kw)
    full = numstab.cross_entropy(make_x(x), make_y(y), backend=name, **kw)
    return float(np.asarray(fast)), float(np.asarray(full))


@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("ignored", [0, 5])
def test_one_call_matches_the_full_path(framework, eps, ignored):
    fast, full = _both(*framework, *_data(ignored=ignored), label_smoothing=eps)
    # two float32 sums of <= ROWS terms, in different orders: each off by <= ROWS ulps
    assert fast == pytest.approx(full, rel=2 * ROWS * EPS32)


def test_masked_classes_get_no_smoothing_mass(framework):
    name, make_x, make_y = framework
    x, y = _data(masked=True)
    fast, full = _both(name, make_x, make_y, x, y, label_smoothing=0.1)
    assert math.isfinite(fast)  # the kernel's +inf is declined, the full path answers
    assert fast == full
    oracle = numstab.cross_entropy(x.astype(np.float64), y, label_smoothing=0.1)
    assert fast == pytest.approx(float(oracle), rel=2 * ROWS * EPS32)


def test_nothing_counted_is_zero(framework):
    fast, full = _both(*framework, *_data(ignored=ROWS), label_smoothing=0.1)
    assert fast == full == 0.0


@pytest.mark.parametrize("label", [-1, CLASSES])
def test_out_of_range_labels_raise_the_typed_error(framework, label):
    _, make_x, make_y = framework
    x, y = _data()
    y[3] = label
    with pytest.raises(InvalidArgumentError, match="labels"):
        numstab.cross_entropy(make_x(x), make_y(y), label_smoothing=0.1)


@pytest.mark.parametrize("eps", [-0.1, 1.5, float("nan")])
def test_bad_smoothing_raises_the_typed_error(framework, eps):
    _, make_x, make_y = framework
    x, y = _data()
    with pytest.raises(InvalidArgumentError, match="label_smoothing"):
        numstab.cross_entropy(make_x(x), make_y(y), label_smoothing=eps)


def test_torch_gradient_matches_the_full_path():
    torch = pytest.importorskip("torch")
    x, y = _data(ignored=5)
    grads = []
    for kw in ({}, {"backend": "torch"}):
        t = torch.tensor(x, requires_grad=True)
        numstab.cross_entropy(t, torch.tensor(y), label_smoothing=0.1, **kw).backward()
        grads.append(t.grad.numpy())
    # per element a softmax and a few products: a few ulps of the largest entry
    np.testing.assert_allclose(grads[0], grads[1], rtol=0, atol=8 * EPS32 * np.abs(grads[1]).max())
