"""numstab's tree functions on torch.func-transformed tensors (docs/semantics.md §4.5, §7):
per-sample gradient norms and clipping under ``torch.vmap(torch.func.grad(...))`` (Opacus,
DP-SGD) give what a Python loop over the samples gives; ``_foreach_*`` kernels have no
batching rule, so the backend reduces leaf by leaf there. And the drop-in
``clip_grad_norm_`` (§10.1) takes a 0-d tensor ``max_norm`` / ``norm_type`` as torch does."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch.func import functional_call, grad, vmap  # noqa: E402

import numstab  # noqa: E402
from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.torch import clip_grad_norm_  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
BATCH = 7
NORM_TYPES = [2.0, 1.0, 3.0, math.inf]


@pytest.fixture(params=["native", "generic"])
def path(request, monkeypatch):
    """Both kernels: the backend's fused ones and the generic composites."""
    monkeypatch.setenv("NUMSTAB_FORCE_GENERIC", "1" if request.param == "generic" else "0")
    return request.param


def _problem():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(BATCH, 5, generator=g) * torch.logspace(-1, 1, BATCH).unsqueeze(1)
    y = torch.randn(BATCH, 3, generator=g)

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.mse_loss(out.squeeze(0), yi)

    return params, x, y, loss


def _tol(values: torch.Tensor, terms: int) -> float:
    """float32 sums of ``terms`` values in another order (and gradients from a batched
    matmul against a per-sample one): a few ulps per term of the largest magnitude."""
    return 4 * terms * EPS32 * float(values.abs().max())


def _per_sample_grads_by_loop(params, x, y, loss):
    return [grad(loss)(params, x[i], y[i]) for i in range(BATCH)]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_per_sample_global_norms_under_vmap_of_grad_match_a_loop(norm_type, path):
    params, x, y, loss = _problem()

    def norm_of_grad(p, xi, yi):
        return numstab.global_norm(list(grad(loss)(p, xi, yi).values()), norm_type)

    got = vmap(norm_of_grad, in_dims=(None, 0, 0))(params, x, y)
    grads = _per_sample_grads_by_loop(params, x, y, loss)
    want = torch.stack([numstab.global_norm(list(g.values()), norm_type) for g in grads])
    assert got.shape == (BATCH,) and got.dtype == torch.float32
    terms = sum(p.numel() for p in params.values())
    torch.testing.assert_close(got, want, rtol=0, atol=_tol(want, terms))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_per_sample_clipping_under_vmap_of_grad_matches_a_loop(norm_type, path):
    """DP-SGD's per-sample clipping: the median norm as the limit, so some samples are
    clipped and some are not (those exactly unchanged)."""
    params, x, y, loss = _problem()
    grads = _per_sample_grads_by_loop(params, x, y, loss)
    norms = torch.stack([numstab.global_norm(list(g.values()), norm_type) for g in grads])
    limit = float(norms.median())

    def clipped_grad(p, xi, yi):
        return numstab.clip_by_global_norm(grad(loss)(p, xi, yi), limit, norm_type=norm_type)

    got, got_norms = vmap(clipped_grad, in_dims=(None, 0, 0))(params, x, y)
    terms = sum(p.numel() for p in params.values())
    torch.testing.assert_close(got_norms, norms, rtol=0, atol=_tol(norms, terms))
    for i, g in enumerate(grads):
        want, _ = numstab.clip_by_global_norm(g, limit, norm_type=norm_type)
        for k in params:
            scale = torch.stack([want[k].abs().max(), g[k].abs().max()])
            torch.testing.assert_close(got[k][i], want[k], rtol=0, atol=_tol(scale, terms))
    clipped_norms = vmap(lambda t: numstab.global_norm(list(t.values()), norm_type))(got)
    assert bool((clipped_norms <= limit * (1 + 4 * terms * EPS32)).all())


def test_the_gradient_of_the_norm_per_sample_is_the_unit_vector(path):
    """vmap(grad(global_norm)): d||x||/dx = x / ||x|| per row."""
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(1))
    got = vmap(grad(lambda r: numstab.global_norm([r[:2], r[2:]])))(x)
    want = x / torch.linalg.vector_norm(x, dim=1, keepdim=True)
    torch.testing.assert_close(got, want, rtol=0, atol=_tol(want, 6))


def test_all_finite_under_vmap_is_per_sample(path):
    x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(2))
    x[1, 2], x[4, 0], x[5, 3] = math.nan, math.inf, -math.inf
    got = vmap(lambda r: numstab.all_finite([r[:1], r[1:] * 2.0]))(x)
    want = torch.stack([numstab.all_finite([r[:1], r[1:] * 2.0]) for r in x])
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert got.tolist() == [True, False, True, True, False, False, True]


def test_clip_by_value_under_vmap_is_per_sample(path):
    x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(3))
    (got,) = vmap(lambda r: numstab.clip_by_value([r], -0.5, 0.5))(x)
    assert torch.equal(got, x.clamp(-0.5, 0.5))


def test_the_inf_norm_under_vmap_is_the_largest_magnitude(path):
    x = torch.randn(BATCH, 5, generator=torch.Generator().manual_seed(4))
    got = vmap(lambda r: numstab.global_norm([r[:3], r[3:]], norm_type=math.inf))(x)
    assert torch.equal(got, x.abs().amax(dim=1))


# -- the drop-in clip_grad_norm_: 0-d tensor arguments -------------------------------------------
def _params(seed: int = 5) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 5
    return params


@pytest.mark.parametrize(
    ("max_norm", "norm_type"),
    [
        (torch.tensor(1.0), 2.0),
        (torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0)),
        (torch.tensor(2), torch.tensor(math.inf)),
        (torch.tensor(1.5, requires_grad=True), torch.tensor(1)),
    ],
)
def test_clip_grad_norm_takes_0d_tensors_as_torch_does(max_norm, norm_type):
    """What torch accepts (it reads both with ``float()``): the same clipping as the numbers
    they hold, and torch's norm."""
    ours, as_numbers, theirs = _params(), _params(), _params()
    norm = clip_grad_norm_(ours, max_norm, norm_type)
    want = clip_grad_norm_(as_numbers, max_norm.item(), float(norm_type))
    assert torch.equal(norm, want)
    for a, b in zip(ours, as_numbers, strict=True):
        assert torch.equal(a.grad, b.grad)
    norm_t = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(norm, norm_t, rtol=0, atol=_tol(norm_t, 7))


@pytest.mark.parametrize(
    "bad",
    [
        {"max_norm": torch.tensor([1.0])},
        {"max_norm": torch.ones(2)},
        {"max_norm": torch.tensor(math.nan)},
        {"max_norm": torch.tensor(-1.0)},
        {"max_norm": torch.tensor(0.0)},
        {"max_norm": torch.tensor(True)},
        {"max_norm": torch.tensor(1 + 0j)},
        {"max_norm": 1.0, "norm_type": torch.tensor([2.0])},
        {"max_norm": 1.0, "norm_type": torch.tensor(-1.0)},
        {"max_norm": 1.0, "norm_type": torch.tensor(True)},
    ],
)
def test_clip_grad_norm_refuses_other_tensors_with_a_typed_error(bad):
    params = _params()
    before = [p.grad.clone() for p in params]
    name = "norm_type" if "norm_type" in bad else "max_norm"
    with pytest.raises(InvalidArgumentError, match=name):
        clip_grad_norm_(params, **bad)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
