"""locate_nonfinite blames the call whose own code made a NaN (docs/semantics.md §15.3,
"Which layer is first"): a parent that makes it between sub-layers (or the model, "") is
reported, not the next sub-layer that receives it. Before, the first call to finish with a
non-finite output always won, so the sub-layer after the parent's code was blamed, with
"inputs: NOT finite"."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numstab as ns
from numstab.backends import load_backend
from numstab.locate._report import LayerCall, summarise

NAN = math.nan


def _summary(calls, fill=None):
    return summarise(
        load_backend("numpy"),
        calls,
        backward_checked=False,
        counts=lambda call, phase: (1, 0),
        framework="numpy",
        fill=fill,
    )


def test_summarise_walks_up_to_the_call_that_made_the_nan():
    # root(x) { blk(x) { a(x); <own code: NaN>; b(h) }; out(...) }
    root = LayerCall("", "M", start=0, end=9, inputs=1.0, outputs=NAN)
    blk = LayerCall("blk", "Blk", start=1, end=6, inputs=1.0, outputs=NAN)
    a = LayerCall("blk.a", "Linear", start=2, end=3, inputs=1.0, outputs=1.0)
    b = LayerCall("blk.b", "Linear", start=4, end=5, inputs=NAN, outputs=NAN)
    out = LayerCall("out", "Linear", start=7, end=8, inputs=NAN, outputs=NAN)
    calls = [a, b, blk, out, root]  # in the order they finished
    report = _summary(calls)
    assert (report.layer, report.layer_type, report.inputs_finite) == ("blk", "Blk", True)
    blk.inputs = NAN  # then the model's own code made it, before calling blk
    assert _summary(calls).layer == ""
    root.inputs = NAN  # the model's inputs were not finite: the first to see them stays
    report = _summary(calls)
    assert (report.layer, report.inputs_finite) == ("blk.b", False)


def test_summarise_fills_the_inputs_of_the_calls_it_reads():
    """The torch adapter computes a call's inputs only through ``fill``."""
    inputs = {"": 1.0, "a": 1.0, "out": NAN}
    root = LayerCall("", "M", start=0, end=5, outputs=NAN)
    a = LayerCall("a", "Linear", start=1, end=2, outputs=1.0)
    out = LayerCall("out", "Linear", start=3, end=4, outputs=NAN)
    filled = []

    def fill(call, phase):
        filled.append(call.name)
        call.inputs = inputs[call.name]

    assert _summary([a, out, root], fill).layer == ""
    assert filled == ["out", ""]


def test_summarise_keeps_a_layer_whose_own_inputs_are_finite():
    root = LayerCall("", "M", start=0, end=5, inputs=1.0, outputs=NAN)
    a = LayerCall("a", "Linear", start=1, end=2, inputs=1.0, outputs=NAN)
    assert _summary([a, root]).layer == "a"


def _torch_models():
    torch = pytest.importorskip("torch")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

        def forward(self, x):
            h = self.a(x)
            return self.out(h / torch.zeros_like(h) * 0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.log(self.a(x) - 100))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blk, self.out = Block(), torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.blk(x))

    return torch, M, Outer


def test_torch_parent_code_is_blamed():
    torch, M, Outer = _torch_models()
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    report = ns.locate_nonfinite(M(), x)
    assert (report.layer, report.layer_type, report.inputs_finite) == ("", "M", True)
    assert report.nan_count == 5
    report = ns.locate_nonfinite(Outer(), x, loss_fn=lambda y: y.sum())
    assert (report.layer, report.layer_type, report.phase) == ("blk", "Block", "forward")
    x[0, 0] = float("nan")  # a non-finite input: the first layer that saw it
    report = ns.locate_nonfinite(M(), x)
    assert (report.layer, report.inputs_finite) == ("a", False)


def test_jax_libraries_parent_code_is_blamed():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    eqx = pytest.importorskip("equinox")

    class E(eqx.Module):
        a: eqx.nn.Linear
        out: eqx.nn.Linear

        def __call__(self, x):
            h = self.a(x)
            return self.out(h / jnp.zeros_like(h) * 0)

    model = E(
        eqx.nn.Linear(4, 4, key=jax.random.key(0)), eqx.nn.Linear(4, 1, key=jax.random.key(1))
    )
    for loss_fn in (None, lambda y: y.sum()):
        report = ns.locate_nonfinite(model, jnp.ones(4), loss_fn=loss_fn)
        assert (report.layer, report.inputs_finite) == ("", True), report
    report = ns.locate_nonfinite(model, jnp.array([1.0, np.nan, 1.0, 1.0]))
    assert (report.layer, report.inputs_finite) == ("a", False)


def test_nnx_parent_code_is_blamed():
    jnp = pytest.importorskip("jax").numpy
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(jnp.log(self.a(x) - 100))

    class Net(nnx.Module):
        def __init__(self):
            self.blk, self.out = Block(), nnx.Linear(4, 1, rngs=nnx.Rngs(2))

        def __call__(self, x):
            return self.out(self.blk(x))

    report = ns.locate_nonfinite(Net(), jnp.ones((5, 4)))
    assert (report.layer, report.layer_type, report.inputs_finite) == ("blk", "Block", True)


def test_keras_parent_code_is_blamed():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() not in ("tensorflow", "jax", "torch"):
        pytest.skip("Keras backend without locate support")
    ops = keras.ops

    class M(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(4, name="a")
            self.out = keras.layers.Dense(1, name="out")

        def call(self, x):
            h = self.a(x)
            return self.out(h / ops.zeros_like(h) * 0)

    model, x = M(), np.ones((5, 4), "float32")
    model(x)
    report = ns.locate_nonfinite(model, x)
    assert (report.layer, report.inputs_finite) == ("", True), report


def test_token_id_inputs_count_as_finite_for_the_parent_rule():
    """A model of integer ids whose own code overflows (two embeddings summed): the parent
    is reported. Passing over calls without floating inputs blamed 'out', the next layer."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Embedding(10, 4), torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 2)

        def forward(self, ids):
            return self.out(self.a(ids) + self.b(ids))

    net = Net()
    with torch.no_grad():
        net.a.weight[:, 0] = 3e38
        net.b.weight[:, 0] = 3e38
    report = ns.locate_nonfinite(net, torch.tensor([1, 2]))
    assert report.found and report.layer == "" and report.phase == "forward", report
