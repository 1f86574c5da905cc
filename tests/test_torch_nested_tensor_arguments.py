"""torch nested tensors (``torch.nested``, strided and jagged) as arguments (§7.5): what only
reads (``global_norm``, ``all_finite``) reads their components on the native and the generic
path; what computes or scales with them raises ``InvalidArgumentError`` naming the argument,
the leaf and the layout. Before, clip_by_global_norm, clip_by_value, adaptive_grad_clip,
LossScaler.unscale, ZClip.update and cross_entropy raised torch's NotImplementedError or
RuntimeError, and the generic global_norm / all_finite did too."""

from __future__ import annotations

import math
import warnings

import pytest

import numstab as ns

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _quiet_prototype_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")
        yield


def _nested(layout):
    return torch.nested.nested_tensor([torch.tensor([3.0, 4.0, 0.0]), torch.ones(2)], layout=layout)


LAYOUTS = [torch.strided, torch.jagged]


@pytest.mark.parametrize("impl", ["native", "generic"], indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
def test_readers_take_nested_tensors(impl, layout, p):
    tree = {"a": _nested(layout), "b": torch.tensor([-2.0])}
    want = {2.0: math.sqrt(31), 1.0: 11.0, 3.0: (27 + 64 + 2 + 8) ** (1 / 3), math.inf: 4.0}[p]
    assert float(ns.global_norm(tree, norm_type=p)) == pytest.approx(want, rel=1e-6)
    assert bool(ns.all_finite(tree))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_what_computes_raises_naming_the_argument(layout):
    nt = _nested(layout)
    ones = torch.ones(2)
    calls = {
        "tree": lambda: ns.clip_by_global_norm({"w": ones, "x": nt}, 1.0),
        "grads": lambda: ns.adaptive_grad_clip({"w": ones, "x": nt}, {"w": ones, "x": nt}),
        "grads ": lambda: ns.LossScaler().unscale(
            {"w": ones, "x": nt}, ns.LossScaler().init(backend="torch")
        ),
        " grads": lambda: ns.ZClip().update({"w": ones, "x": nt}, ns.ZClip().init(backend="torch")),
    }
    if layout == torch.strided:  # (a jagged tensor has an elementwise clamp)
        calls["tree "] = lambda: ns.clip_by_value({"w": ones, "x": nt}, -1.0, 1.0)
    for name, call in calls.items():
        with pytest.raises(ns.InvalidArgumentError) as info:
            call()
        message = str(info.value)
        assert f"nested tensor (layout={layout}) at ['x'] of {name.strip()}" in message, message


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("argument", ["logits", "weight"])
def test_cross_entropy_names_the_nested_argument(layout, argument):
    nt = _nested(layout)
    logits, weight = torch.randn(2, 3), None
    if argument == "logits":
        logits = nt
    elif layout == torch.jagged:
        pytest.skip("a jagged weight has a ragged shape: the shape check names it first")
    else:
        weight = torch.nested.nested_tensor([torch.ones(3)], layout=layout)
    with pytest.raises(
        ns.InvalidArgumentError, match=f"layout={layout}\\) at <root> of {argument}"
    ):
        ns.cross_entropy(logits, torch.tensor([0, 1]), weight=weight)
