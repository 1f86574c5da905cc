"""locate_nonfinite with parameters used by more than one layer call (docs/semantics.md
§15.3, "Which layer is first", backward): tied weights (an LM head tied to its embedding) and
a layer called twice. A shared parameter's gradient is the total over every use, so a layer
whose own code made nothing non-finite showed a non-finite "own" parameter gradient when
another use of the parameter did; such a call is judged by its input gradient first, and
its parameter gradient counts only when no call is found so. Before, torch blamed the tied
head ('head', nonfinite_params ('head.weight',)) instead of the block that made the NaN, and
torch and Keras on TensorFlow and torch blamed the twice-called layer ('shared') where JAX
(each call probed on its own) names the model's own code ('')."""

from __future__ import annotations

import json
import math

import pytest

from numstab.backends import load_backend
from numstab.locate._report import LayerCall, summarise
from tests.keras_backends import KERAS_BACKENDS, run_per_keras_backend

NAN = math.nan


def _calls(shared: bool) -> list[LayerCall]:
    """'head' (shared or not) has a NaN parameter gradient and finite input gradients;
    'blk', earlier in the forward pass, made a NaN input gradient from a finite one."""
    head = LayerCall("head", "T", 3, 4, backward=-3.0, grad_outputs=1.0, grad_inputs=1.0)
    head.grad_params, head.shared = NAN, shared
    blk = LayerCall("blk", "T", 1, 2, backward=-1.0, grad_outputs=1.0, grad_inputs=NAN)
    root = LayerCall("", "M", 0, 5, backward=0.0, grad_outputs=1.0, grad_inputs=NAN)
    return [blk, head, root]


def _layer(calls: list[LayerCall]) -> str | None:
    report = summarise(
        load_backend("numpy"),
        calls,
        backward_checked=True,
        counts=lambda call, phase: (1, 0),
        framework="numpy",
    )
    return report.layer


def test_shared_rule_judges_shared_calls_by_input_gradient_first():
    assert _layer(_calls(shared=False)) == "head"  # an own parameter gradient, as before
    assert _layer(_calls(shared=True)) == "blk"
    calls = _calls(shared=True)  # nothing else explains it: the shared total counts
    calls[0].grad_inputs = calls[2].grad_inputs = 1.0
    assert _layer(calls) == "head"


torch = pytest.importorskip("torch")
nn = torch.nn


class _Bad(nn.Module):
    """Forward finite; backward: sqrt'(0) = inf, times 0: NaN w.r.t. its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.sqrt((h * 0).sum(-1, keepdim=True))


class _LM(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb, self.blk, self.norm = nn.Embedding(10, 8), _Bad(), nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.blk(self.emb(ids))))


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.shared = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.shared(self.a(x))
        return self.shared(h * 0 + torch.sqrt((h * 0).sum(-1, keepdim=True)))


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.0, 1.0, 4.0]))

    def forward(self, x):
        return x * torch.sqrt(self.w)  # d/dw at w = 0: inf; d/dx finite


def _locate(model, x):
    import numstab as ns

    return ns.locate_nonfinite(model, x, loss_fn=lambda o: o.logsumexp(-1).mean())


def test_torch_tied_head_does_not_take_the_blame():
    """Tied or not, the block that made the NaN gradient is named."""
    for tie in (False, True):
        torch.manual_seed(0)
        report = _locate(_LM(tie), torch.tensor([[1, 2, 3, 4]]))
        found = (report.layer, report.phase, report.grad_output_finite, report.nonfinite_params)
        assert found == ("blk", "backward", True, ()), tie


def _equinox_twice_report():
    """JAX probes each call on its own: the reference."""
    eqx = pytest.importorskip("equinox")
    jax = pytest.importorskip("jax")
    import numstab as ns

    class Twice(eqx.Module):
        a: eqx.nn.Linear
        shared: eqx.nn.Linear

        def __call__(self, x):
            h = self.shared(self.a(x))
            return self.shared(h * 0 + jax.numpy.sqrt((h * 0).sum()))

    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    model = Twice(eqx.nn.Linear(8, 8, key=ka), eqx.nn.Linear(8, 8, key=kb))
    return ns.locate_nonfinite(model, jax.numpy.ones(8), loss_fn=lambda o: o.sum())


def test_torch_layer_called_twice_agrees_with_equinox():
    """The model's own code (''), as Equinox; a parameter gradient that only the shared
    parameter explains is still found, at the shared layer."""
    torch.manual_seed(0)
    report = _locate(_Twice(), torch.randn(2, 8))
    assert (report.layer, report.phase, report.layer_type) == ("", "backward", "_Twice")
    reference = _equinox_twice_report()
    assert (reference.layer, reference.phase) == (report.layer, report.phase)
    report = _locate(nn.Sequential(_Scale(), nn.Identity()), torch.ones(2, 3))
    assert (report.layer, report.phase) == ("0", "backward")
    twice = nn.Module()
    twice.s = _Scale()
    twice.forward = lambda x: twice.s(twice.s(x))
    report = _locate(twice, torch.ones(2, 3))
    assert (report.layer, report.phase, report.nonfinite_params) == ("s", "backward", ("s.w",))


KERAS_SCRIPT = r"""
import json, numpy as np, keras
from keras import ops
from numstab import locate_nonfinite

class Twice(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(8, name="a")
        self.shared = keras.layers.Dense(8, name="shared")

    def call(self, x):
        h = self.shared(self.a(x))
        return self.shared(h * 0 + ops.sqrt(ops.sum(h * 0, axis=-1, keepdims=True)))

x = np.random.default_rng(0).normal(size=(2, 8)).astype("float32")
model = Twice()
model(x)
r = locate_nonfinite(model, x, loss_fn=lambda o: ops.sum(o))
print(json.dumps([r.layer, r.phase, list(r.nonfinite_params)]))
"""


def test_keras_layer_called_twice_agrees_with_jax():
    """TensorFlow and torch name the model's own code, as JAX does."""
    pytest.importorskip("keras")
    reports = run_per_keras_backend(KERAS_SCRIPT)
    for backend in KERAS_BACKENDS:
        code, out, err = reports[backend]
        assert code == 0, (backend, err[-2000:])
        layer, phase, params = json.loads(out.strip().splitlines()[-1])
        assert (backend, layer, phase) == (backend, "", "backward")
        if backend != "jax":  # on JAX, the root's params are its sub-layers' too (§15.3)
            assert params == [], backend
