"""Out-of-range labels under torch.func and vmap (docs/semantics.md §4.4.6, §4.3): labels
that are not traced raise ``InvalidArgumentError`` naming the first bad value and its
position (``torch.func.grad``; ``vmap`` over the logits only, torch's and JAX's); traced
labels (``vmap`` over the labels, ``jax.jit``) give NaN rows, unread.

Before: ``torch.func.grad`` raised torch's "Cannot access data pointer of Tensor that
doesn't have storage" while the message was built, and ``vmap`` over the logits only gave
NaN rows for concrete labels."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numstab as ns
from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError

BAD = [2, 0, -100, 7]  # labels[3]=7 is out of range for K = 3 (-100 is ignore_index)
GOOD = [2, 0, -100, 1]
MESSAGE = r"labels\[3\]=7 \(1 label\(s\) out of range\)"
SMOOTH_MESSAGE = r"labels\[0\]=5 \(1 label\(s\) out of range\)"
REDUCTIONS = ["none", "sum", "mean"]


def _reduce(loss, reduction):
    return loss.sum() if reduction == "none" else loss


def _no_host_read(monkeypatch, name):
    """Fail on any host read of labels (traced labels must never be read)."""
    be = load_backend(name)

    def refuse(*args, **kwargs):
        raise AssertionError("traced labels were read on the host")

    monkeypatch.setattr(be, "label_summary", refuse)
    monkeypatch.setattr(be, "to_numpy", refuse)


# -- torch --------------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_torch_func_grad_names_the_bad_label(torch, reduction, smoothing):
    logits, labels = torch.randn(4, 3), torch.tensor(BAD)

    def loss(x):
        out = ns.cross_entropy(x, labels, reduction=reduction, label_smoothing=smoothing)
        return _reduce(out, reduction)

    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        torch.func.grad(loss)(logits)


def test_torch_func_grad_smooth_labels_and_fused_name_the_bad_label(torch):
    logits = torch.randn(2, 3)
    with pytest.raises(InvalidArgumentError, match=SMOOTH_MESSAGE):
        torch.func.grad(lambda x: (ns.smooth_labels(torch.tensor([5, 0]), 0.1, 3) * x).sum())(
            logits
        )
    hidden, weight = torch.randn(4, 5), torch.randn(3, 5)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        torch.func.grad(lambda h: ns.fused_linear_cross_entropy(h, weight, torch.tensor(BAD)))(
            hidden
        )


def test_torch_func_grad_reads_labels_made_inside_the_transform(torch):
    logits, labels = torch.randn(4, 3), torch.tensor(BAD, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        torch.func.grad(lambda x: ns.cross_entropy(x, labels.long() + 0))(logits)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_vmap_over_the_logits_only_names_the_bad_label(torch, reduction):
    logits, labels = torch.randn(2, 4, 3), torch.tensor(BAD)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        torch.vmap(lambda x: ns.cross_entropy(x, labels, reduction=reduction))(logits)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):  # vmap of grad
        torch.vmap(torch.func.grad(lambda x: ns.cross_entropy(x, labels)))(logits)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):  # grad of vmap
        torch.func.grad(lambda x: torch.vmap(lambda r: ns.cross_entropy(r, labels))(x).sum())(
            logits
        )
    with pytest.raises(InvalidArgumentError, match=SMOOTH_MESSAGE):
        torch.vmap(lambda x: ns.smooth_labels(torch.tensor([5, 0]), 0.1, 3) * x)(logits[:, :2])
    hidden, weight = torch.randn(2, 4, 5), torch.randn(3, 5)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        torch.vmap(lambda h: ns.fused_linear_cross_entropy(h, weight, labels))(hidden)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_torch_vmap_over_the_logits_only_equals_the_loop(torch, reduction, smoothing):
    logits, labels = torch.randn(3, 4, 3, dtype=torch.float64), torch.tensor(GOOD)

    def fn(x):
        return ns.cross_entropy(x, labels, reduction=reduction, label_smoothing=smoothing)

    torch.testing.assert_close(torch.vmap(fn)(logits), torch.stack([fn(x) for x in logits]))


def test_torch_vmap_over_the_labels_gives_nan_rows_unread(torch, monkeypatch):
    logits, labels = torch.randn(4, 3), torch.tensor([BAD, GOOD])
    want = ns.cross_entropy(logits, torch.tensor(GOOD), reduction="none")
    hidden, weight = torch.randn(4, 5), torch.randn(3, 5)
    fused_want = ns.fused_linear_cross_entropy(hidden, weight, torch.tensor(GOOD), reduction="none")
    _no_host_read(monkeypatch, "torch")
    for got, good in (
        (torch.vmap(lambda y: ns.cross_entropy(logits, y, reduction="none"))(labels), want),
        (
            torch.vmap(lambda x, y: ns.cross_entropy(x, y, reduction="none"))(
                torch.stack([logits, logits]), labels
            ),
            want,
        ),
        (
            torch.vmap(
                lambda y: ns.fused_linear_cross_entropy(hidden, weight, y, reduction="none")
            )(labels),
            fused_want,
        ),
    ):
        assert math.isnan(got[0, 3])
        torch.testing.assert_close(got[0, :3], good[:3])
        torch.testing.assert_close(got[1], good)
    got = torch.vmap(lambda y: ns.cross_entropy(logits, y))(labels)  # mean: NaN row
    assert math.isnan(got[0]) and math.isfinite(got[1])
    smoothed = torch.vmap(lambda y: ns.smooth_labels(y, 0.3, 3))(torch.tensor([[5, 0], [1, 2]]))
    torch.testing.assert_close(smoothed[0, 0], torch.full((3,), 0.1))  # unchecked: alpha / K


# -- JAX ----------------------------------------------------------------------------------


@pytest.fixture
def jax():
    return pytest.importorskip("jax")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_jax_vmap_over_the_logits_only_names_the_bad_label(jax, reduction):
    jnp = jax.numpy
    logits, labels = jnp.zeros((2, 4, 3)), jnp.array(BAD)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        jax.vmap(lambda x: ns.cross_entropy(x, labels, reduction=reduction))(logits)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):  # labels made inside, NumPy's
        jax.vmap(lambda x: ns.cross_entropy(x, np.array(BAD), reduction=reduction))(logits)
    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        jax.vmap(jax.grad(lambda x: ns.cross_entropy(x, labels)))(logits)
    with pytest.raises(InvalidArgumentError, match=SMOOTH_MESSAGE):
        jax.vmap(lambda x: ns.smooth_labels(jnp.array([5, 0]), 0.1, 3) * x)(logits[:, :2])
    hidden, weight = jnp.ones((2, 4, 5)), jnp.ones((3, 5))
    with pytest.raises(InvalidArgumentError, match=MESSAGE):
        jax.vmap(lambda h: ns.fused_linear_cross_entropy(h, weight, labels))(hidden)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_jax_vmap_over_the_logits_only_equals_the_loop(jax, reduction):
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 3))
    labels = jax.numpy.array(GOOD)

    def fn(x):
        return ns.cross_entropy(x, labels, reduction=reduction, label_smoothing=0.1)

    want = np.stack([np.asarray(fn(x)) for x in logits])
    np.testing.assert_allclose(np.asarray(jax.vmap(fn)(logits)), want, rtol=1e-6, atol=1e-6)


def test_jax_traced_labels_give_nan_rows_unread(jax, monkeypatch):
    jnp = jax.numpy
    logits, labels, bad = jnp.zeros((4, 3)), jnp.array([BAD, GOOD]), jnp.array(BAD)
    hidden, weight = jnp.ones((4, 5)), jnp.ones((3, 5))
    _no_host_read(monkeypatch, "jax")
    for got in (
        jax.vmap(lambda y: ns.cross_entropy(logits, y, reduction="none"))(labels),
        jax.vmap(lambda x, y: ns.cross_entropy(x, y, reduction="none"))(
            jnp.stack([logits, logits]), labels
        ),
        jax.vmap(lambda y: ns.fused_linear_cross_entropy(hidden, weight, y, reduction="none"))(
            labels
        ),
        # jit: closed-over constant labels are traced too, vmap of the logits or not
        jax.jit(jax.vmap(lambda x: ns.cross_entropy(x, bad, reduction="none")))(
            jnp.stack([logits, logits])
        ),
        jax.vmap(jax.jit(lambda x: ns.cross_entropy(x, bad, reduction="none")))(
            jnp.stack([logits, logits])
        ),
    ):
        got = np.asarray(got)
        assert np.isnan(got[0, 3]) and not np.isnan(got[0, :3]).any()
    got = np.asarray(jax.vmap(lambda y: ns.cross_entropy(logits, y))(labels))
    assert np.isnan(got[0]) and np.isfinite(got[1])
