"""torch ``cross_entropy`` with a class ``weight`` that requires grad and label smoothing:
the gradient with respect to the weight, as JAX's and a finite difference's (§4.4.8). Before,
torch's fused ``F.cross_entropy`` was taken, and backward raised torch's own "The function
'nll_loss_forward' is not differentiable with respect to argument 'weight'"."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

torch = pytest.importorskip("torch")
EPS64 = float(np.finfo(np.float64).eps)

X = np.random.default_rng(0).standard_normal((6, 4))
Y = np.array([0, 1, 2, 3, -100, 1])
W = np.array([1.0, 0.5, 2.0, 0.25])


def _loss(x: np.ndarray, w: np.ndarray, reduction: str) -> float:
    return float(
        ns.cross_entropy(x, Y, weight=w, label_smoothing=0.1, reduction=reduction, backend="numpy")
    )


def _finite_difference(reduction: str, h: float = 1e-6) -> np.ndarray:
    """Central differences of the float64 NumPy loss: error O(h**2) + O(eps / h)."""
    grad = np.zeros_like(W)
    for i in range(len(W)):
        step = np.zeros_like(W)
        step[i] = h
        grad[i] = (_loss(X, W + step, reduction) - _loss(X, W - step, reduction)) / (2 * h)
    return grad


@pytest.mark.parametrize("impl", ["native", "generic"], indirect=True)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_weight_gradient_with_label_smoothing(impl, reduction):
    w = torch.tensor(W, requires_grad=True)
    x = torch.tensor(X, requires_grad=True)
    loss = ns.cross_entropy(x, torch.tensor(Y), weight=w, label_smoothing=0.1, reduction=reduction)
    loss.sum().backward()
    reduce = "sum" if reduction == "none" else reduction
    # the loss is O(1), so the difference quotient is good to ~eps / h + h**2 ~ 1e-10
    np.testing.assert_allclose(w.grad.numpy(), _finite_difference(reduce), rtol=0, atol=1e-8)
    jax = pytest.importorskip("jax")
    with jax.enable_x64(True):
        f = lambda w, x: ns.cross_entropy(
            x, jax.numpy.asarray(Y), weight=w, label_smoothing=0.1, reduction=reduce
        )
        gw, gx = jax.grad(f, argnums=(0, 1))(jax.numpy.asarray(W), jax.numpy.asarray(X))
    np.testing.assert_allclose(w.grad.numpy(), np.asarray(gw), rtol=0, atol=64 * EPS64)
    np.testing.assert_allclose(x.grad.numpy(), np.asarray(gx), rtol=0, atol=64 * EPS64)


def test_weight_gradient_under_torch_func():
    want = _finite_difference("mean")
    grad = torch.func.grad(
        lambda w: ns.cross_entropy(torch.tensor(X), torch.tensor(Y), weight=w, label_smoothing=0.1)
    )(torch.tensor(W))
    np.testing.assert_allclose(grad.numpy(), want, rtol=0, atol=1e-8)
