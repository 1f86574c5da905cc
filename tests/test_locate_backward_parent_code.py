"""locate_nonfinite blames the call whose own code made a non-finite GRADIENT (docs/
semantics.md §15.3, "Which layer is first", backward): when the call earliest in the backward
pass with a non-finite own gradient received a non-finite gradient already, the enclosing
call whose own code made it is reported (the innermost that received a finite one; the model,
"", at the top), as the forward rule does with a parent's own code. Before, the sub-layer that
only received the NaN was blamed ("layer 'a' (Linear) ... incoming gradient: NOT finite"),
checkpointed blocks too ('b1.bad.lin' for 'b1.bad'), on torch, Keras and the JAX libraries."""

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
        backward_checked=True,
        counts=lambda call, phase: (1, 0),
        framework="numpy",
        fill=fill,
    )


def _call(name, start, end, grad_out, grad_in=1.0, grad_params=None):
    return LayerCall(
        name,
        "T",
        start=start,
        end=end,
        backward=-float(start),
        inputs=1.0,
        outputs=1.0,
        grad_outputs=grad_out,
        grad_inputs=grad_in,
        grad_params=grad_params,
    )


def test_summarise_walks_up_to_the_call_whose_code_made_the_gradient():
    # root(x) { blk(x) { a(x); <own code: NaN gradient>; b(h) }; out(...) }
    root = _call("", 0, 9, 1.0, grad_in=NAN)
    blk = _call("blk", 1, 6, 1.0, grad_in=NAN)
    a = _call("blk.a", 2, 3, NAN, grad_in=NAN, grad_params=NAN)
    b = _call("blk.b", 4, 5, 1.0)
    out = _call("out", 7, 8, 1.0)
    calls = [a, b, blk, out, root]  # in the order they finished
    report = _summary(calls)
    assert (report.layer, report.phase, report.grad_output_finite) == ("blk", "backward", True)
    blk.grad_outputs = NAN  # then the model's own code made it, after blk returned
    report = _summary(calls)
    assert (report.layer, report.grad_output_finite) == ("", True)
    root.grad_outputs = NAN  # nothing received a finite gradient: the model itself
    assert _summary(calls).layer == ""
    a.grad_outputs = 1.0  # a's own gradient is non-finite from a finite one: a
    assert _summary(calls).layer == "blk.a"
    a.grad_outputs = NAN  # no enclosing call recorded: the first stays
    assert _summary([a]).layer == "blk.a"


def test_summarise_fills_the_incoming_gradient_of_the_calls_it_reads():
    """The torch adapter computes a call's incoming gradient only through ``fill``."""
    grad_out = {"": 1.0, "blk": NAN, "blk.a": NAN, "out": 1.0}
    root = _call("", 0, 7, None, grad_in=NAN)
    blk = _call("blk", 1, 4, None)
    a = _call("blk.a", 2, 3, None, grad_in=NAN)
    out = _call("out", 5, 6, None)
    filled = []

    def fill(call, phase):
        filled.append((call.name, phase))
        call.grad_outputs = grad_out[call.name]

    report = _summary([a, blk, out, root], fill)
    assert (report.layer, report.grad_output_finite) == ("", True)
    assert filled == [("blk.a", "backward"), ("blk", "backward"), ("", "backward")]


def _torch():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Net(nn.Module):  # the audit's model
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            h = torch.sqrt(h - h)  # forward 0, backward inf * 0 = NaN
            return self.b(h)

    return torch, Net


def test_torch_model_code_making_a_nan_gradient_is_blamed():
    torch, Net = _torch()
    torch.manual_seed(0)
    report = ns.locate_nonfinite(Net(), torch.randn(3, 4), loss_fn=lambda o: o.pow(2).sum())
    assert (report.layer, report.layer_type, report.phase) == ("", "Net", "backward"), report
    assert report.grad_output_finite is True and report.inputs_finite is True
    assert (report.nan_count, report.inf_count) == (12, 0)  # d loss / d x, 3 x 4
    assert report.params_finite is None and report.nonfinite_params == ()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_torch_block_code_is_blamed_also_under_checkpoint(checkpointed):
    torch, _ = _torch()
    nn = torch.nn
    from torch.utils.checkpoint import checkpoint

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return torch.sqrt(h - h) + x

    class Block(nn.Module):
        def __init__(self, bad):
            super().__init__()
            self.bad, self.post = (Bad() if bad else nn.Identity()), nn.Linear(4, 4)

        def forward(self, x):
            return self.post(self.bad(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.b0, self.b1, self.head = Block(False), Block(True), nn.Linear(4, 2)

        def forward(self, x):
            for block in (self.b0, self.b1):
                x = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
            return self.head(x)

    torch.manual_seed(0)
    net = Net()
    report = ns.locate_nonfinite(net, torch.randn(3, 4), loss_fn=lambda o: o.pow(2).sum())
    assert (report.layer, report.layer_type, report.phase) == ("b1.bad", "Bad", "backward")
    assert report.grad_output_finite is True and report.nan_count == 12
    assert all(p.grad is None for p in net.parameters())


def test_torch_parent_with_own_parameters_lists_their_gradients():
    """The parent's own parameter gradients are read for the report (the backward walk
    stopped at the child, whose parameter gradients were NaN first)."""
    torch, _ = _torch()
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.shift = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

        def forward(self, x):
            h = self.a(x)
            return torch.sqrt(h - h + 0 * self.shift)  # d / d shift = inf * 0 = NaN

    torch.manual_seed(0)
    report = ns.locate_nonfinite(Net(), torch.randn(3, 4), loss_fn=lambda o: o.sum())
    assert (report.layer, report.phase, report.grad_output_finite) == ("", "backward", True)
    assert report.nonfinite_params == ("shift",), report
    assert report.params_finite is True and report.nan_count == 12 + 4


def _loss(o):
    return (o * 3.0).sum()


def test_equinox_model_code_making_a_nan_gradient_is_blamed():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __call__(self, x):
            h = self.a(x)
            return self.b(jnp.sqrt(h - h))

    net = Net(
        eqx.nn.Linear(4, 4, key=jax.random.key(0)), eqx.nn.Linear(4, 2, key=jax.random.key(1))
    )
    report = ns.locate_nonfinite(net, jnp.ones(4), loss_fn=_loss)
    assert (report.layer, report.phase, report.grad_output_finite) == ("", "backward", True)
    assert report.nan_count == 4, report


def test_nnx_model_code_making_a_nan_gradient_is_blamed():
    jnp = pytest.importorskip("jax").numpy
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(4, 2, rngs=nnx.Rngs(1))

        def __call__(self, x):
            h = self.a(x)
            return self.b(jnp.sqrt(h - h))

    report = ns.locate_nonfinite(Net(), jnp.ones((3, 4)), loss_fn=_loss)
    assert (report.layer, report.phase, report.grad_output_finite) == ("", "backward", True)
    assert report.nan_count == 12, report


def test_linen_model_code_making_a_nan_gradient_is_blamed():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4, name="a")(x)
            return nn.Dense(2, name="b")(jnp.sqrt(h - h))

    x = jnp.ones((3, 4))
    bound = Net().bind(Net().init(jax.random.key(0), x))
    report = ns.locate_nonfinite(bound, x, loss_fn=_loss)
    assert (report.layer, report.phase, report.grad_output_finite) == ("", "backward", True)
    assert report.nan_count == 12, report


def test_keras_model_code_making_a_nan_gradient_is_blamed():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() not in ("tensorflow", "jax", "torch"):
        pytest.skip("Keras backend without locate support")
    ops = keras.ops

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(4, name="a")
            self.b = keras.layers.Dense(2, name="b")

        def call(self, x):
            h = self.a(x)
            return self.b(ops.sqrt(h - h))

    net, x = Net(), np.ones((3, 4), "float32")
    net(x)
    report = ns.locate_nonfinite(net, x, loss_fn=lambda o: ops.sum(o * 3.0))
    assert (report.layer, report.phase, report.grad_output_finite) == ("", "backward", True)
    assert report.nan_count >= 12, report  # JAX: the sub-layers' parameters too (§15.3)
