"""Eager jax.grad / jacfwd / jacrev / hessian through values numstab reads on the host
(class weights, probability labels): JaxBackend.can_read and to_numpy agree on tracers
that carry a value, so eager transforms equal jitted ones and a plain-jnp formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numstab import cross_entropy
from numstab.errors import InvalidArgumentError

X = jnp.array([[1.0, 2.0, 0.5], [0.1, -1.0, 2.0], [0.3, 0.3, -2.0]])
Y = jnp.array([0, 2, 1])
W = jnp.array([0.5, 1.0, 2.0])
T = jax.nn.softmax(jnp.array([[0.3, 1.0, -1.0], [2.0, 0.0, 0.5], [0.0, 0.1, 0.2]]))
TRANSFORMS = [jax.grad, jax.jacfwd, jax.jacrev, jax.hessian]


def _weighted_hard(x, w):
    """torch's weighted mean: sum w[y] * nll / sum w[y]."""
    nll = -jnp.take_along_axis(jax.nn.log_softmax(x), Y[:, None], axis=-1)[:, 0]
    return jnp.sum(w[Y] * nll) / jnp.sum(w[Y])


def _weighted_soft(x, t, w):
    return jnp.mean(-jnp.sum(w * t * jax.nn.log_softmax(x), axis=-1))


CASES = {
    "weight": (lambda w: cross_entropy(X, Y, weight=w), lambda w: _weighted_hard(X, w), W),
    "logits, weighted": (
        lambda x: cross_entropy(x, Y, weight=W),
        lambda x: _weighted_hard(x, W),
        X,
    ),
    "probability labels": (lambda t: cross_entropy(X, t), lambda t: _weighted_soft(X, t, 1.0), T),
    "probability labels, weighted": (
        lambda t: cross_entropy(X, t, weight=W),
        lambda t: _weighted_soft(X, t, W),
        T,
    ),
    "weight, probability labels": (
        lambda w: cross_entropy(X, T, weight=w),
        lambda w: _weighted_soft(X, T, w),
        W,
    ),
}


def _close(a, b, scale=1.0):
    tol = 64 * float(jnp.finfo(jnp.float32).eps) * max(scale, 1.0)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: t.__name__)
@pytest.mark.parametrize("case", list(CASES))
def test_eager_transform_equals_jit_and_formula(transform, case):
    fn, formula, arg = CASES[case]
    eager = transform(fn)(arg)
    jitted = jax.jit(transform(fn))(arg)
    reference = transform(formula)(arg)
    scale = float(jnp.max(jnp.abs(reference)))
    _close(eager, jitted, scale)
    _close(eager, reference, scale)


def test_eager_grad_still_checks_weight_values():
    """The weight is read (not skipped) under an eager grad: a negative one is refused."""
    bad = jnp.array([0.5, -1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match=r"weight\[1\]"):
        jax.grad(lambda w: cross_entropy(X, Y, weight=w))(bad)


def test_backend_reads_a_tracer_with_a_value():
    from numstab.frameworks.jax.backend import BACKEND

    seen = []

    def f(w):
        seen.append((BACKEND.can_read(w), BACKEND.to_numpy(w)))
        return jnp.sum(w)

    jax.grad(f)(W)
    assert seen[0][0] and np.array_equal(seen[0][1], np.asarray(W))
    jax.jit(lambda w: seen.append(BACKEND.can_read(w)) or w)(W)
    assert seen[-1] is False
