"""torch.compile(fullgraph=True) called again with another Python float hyperparameter:
Dynamo then passes the float as a SymFloat ("automatic dynamic"), which the argument checks
must take (comparisons, not math.isfinite / isnan: those ended the graph). Each call must
equal the eager one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numstab as ns  # noqa: E402
from numstab.integrations.torch import clip_grad_norm_  # noqa: E402

G = [torch.linspace(-3.0, 2.0, 10), torch.linspace(0.5, 4.0, 5)]
X = torch.linspace(-2.0, 2.0, 20).reshape(4, 5)
Y = torch.tensor([0, 1, 2, 3])


CASES = {
    "clip_by_global_norm max_norm": (
        lambda a: torch.cat(ns.clip_by_global_norm(G, a)[0]),
        (1.0, 0.5, 0.25),
    ),
    "global_norm norm_type": (lambda a: ns.global_norm(G, a), (2.0, 3.0, 4.0)),
    "cross_entropy label_smoothing": (
        lambda a: ns.cross_entropy(X, Y, label_smoothing=a),
        (0.1, 0.2, 0.3),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_second_float_value_compiles_and_equals_eager(name):
    fn, values = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    for value in values:
        got, want = compiled(value), fn(value)
        # the same float32 ops in another order at most: a few ulps of the values' scale
        tol = 8 * torch.finfo(torch.float32).eps * float(want.abs().max())
        assert torch.allclose(got, want, rtol=0, atol=tol), (name, value, got, want)


def _params() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in G]
    for p, g in zip(params, G, strict=True):
        p.grad = g.clone()
    return params


def test_the_clip_grad_norm_drop_in_takes_a_second_max_norm():
    torch._dynamo.reset()
    compiled = torch.compile(lambda ps, a: clip_grad_norm_(ps, a), fullgraph=True)
    for max_norm in (1.0, 0.5, 0.25):
        mine, eager = _params(), _params()
        compiled(mine, max_norm)
        clip_grad_norm_(eager, max_norm)
        for p, q in zip(mine, eager, strict=True):
            tol = 8 * torch.finfo(torch.float32).eps * float(q.grad.abs().max())
            assert torch.allclose(p.grad, q.grad, rtol=0, atol=tol), (max_norm, p.grad, q.grad)
