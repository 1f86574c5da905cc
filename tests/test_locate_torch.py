"""locate_nonfinite on torch: the cases the hook-free backward and the record-time
reductions must get right (in-place edits, a non-finite total gradient that is not the
layer's own, state left untouched). The cross-framework faults are in
conformance_tests/test_locate.py."""

from __future__ import annotations

import math
import re

import pytest

from numstab.errors import InvalidArgumentError
from numstab.locate import locate_nonfinite

torch = pytest.importorskip("torch")
nn = torch.nn


class AbsBySqrt(nn.Module):
    """|x| as sqrt(x * x): finite forward, NaN gradient (inf * 0) wherever x == 0."""

    def forward(self, x):
        return torch.sqrt(x * x)


def _zero_unit(n_in: int = 4, n_out: int = 4) -> nn.Linear:
    """A Linear whose output column 0 is exactly 0 (so AbsBySqrt's gradient there is NaN)."""
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight[0] = 0.0
        lin.bias[0] = 0.0
    return lin


def _sum_sq(output, targets=None):
    return (output * output).sum()


def test_total_input_gradient_from_another_consumer_is_not_blamed():
    """h feeds ``bad`` (started first, NaN own gradient) and ``fine`` (started last, so
    earlier in the backward pass). The total gradient at h is NaN because of ``bad``;
    ``fine``'s own input gradient is finite, so ``bad`` is the one reported."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.bad, self.fine = _zero_unit(), AbsBySqrt(), nn.Linear(4, 4)

        def forward(self, x):
            h = self.pre(x)
            return self.bad(h) + self.fine(h)

    torch.manual_seed(0)
    report = locate_nonfinite(Net(), torch.randn(3, 4), loss_fn=_sum_sq)
    assert (report.layer, report.phase, report.layer_type) == ("bad", "backward", "AbsBySqrt")
    assert (report.nan_count, report.inf_count) == (3, 0)  # column 0 of 3 rows
    assert report.grad_output_finite is True and report.inputs_finite is True
    assert report.params_finite is None and report.nonfinite_params == ()


def test_parent_edits_child_output_in_place():
    """The child's output is reduced when it returns: the overflow made by the parent's
    in-place ``+=`` afterwards is the parent's (``""``), not the child's."""

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Linear(4, 4)

        def forward(self, x):
            out = self.child(x)
            out += torch.full_like(out, 2e38)
            out += torch.full_like(out, 2e38)  # 4e38 > float32 max: inf
            return out

    report = locate_nonfinite(Residual(), torch.ones(2, 4), loss_fn=_sum_sq)
    assert (report.layer, report.phase, report.inf_count) == ("", "forward", 8)
    assert report.inputs_absmax == 1.0


def test_inplace_relu_and_backward_culprit_after_it():
    """``nn.ReLU(inplace=True)`` edits its input in place (full backward hooks refuse it);
    its zeros then give AbsBySqrt a NaN gradient, reported with the incoming gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(_zero_unit(), nn.ReLU(inplace=True), AbsBySqrt(), nn.Linear(4, 2))
    x = torch.randn(5, 4)
    report = locate_nonfinite(model, x, loss_fn=_sum_sq)
    assert (report.layer, report.phase) == ("2", "backward")
    zeros = int((torch.relu(model[0](x)) == 0).sum())
    assert report.nan_count == zeros and zeros >= 5
    assert report.grad_output_finite is True and math.isfinite(report.grad_output_absmax)


def test_model_state_and_grads_untouched_and_parameter_names():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with torch.no_grad():
        model[1].weight[1, 2] = math.inf
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = locate_nonfinite(model, torch.ones(2, 3), loss_fn=_sum_sq)
    assert (report.layer, report.phase, report.nonfinite_params) == ("1", "forward", ("1.weight",))
    assert report.params_absmax == math.inf and report.inputs_finite is True
    for n, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, before[n])
    assert not model._forward_hooks and not model[0]._forward_pre_hooks  # hooks removed


def test_under_inference_mode():
    """Inference tensors have no version counter; the forward-only locate still works."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    with torch.inference_mode():
        report = locate_nonfinite(model, torch.full((2, 3), math.inf))
    assert (report.layer, report.phase, report.inputs_absmax) == ("0", "forward", math.inf)
    assert not report.backward_checked


def _inf_net() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with torch.no_grad():
        model[1].weight[1, 2] = math.inf
    return model


def test_compiled_module_is_located_as_the_eager_one():
    """``torch.compile`` wraps the module (``OptimizedModule``): located as the module it
    compiles, with the names of the uncompiled model (a dynamo AssertionError before)."""
    model = _inf_net()
    compiled = torch.compile(model)
    report = locate_nonfinite(compiled, torch.ones(2, 3), loss_fn=_sum_sq)
    assert (report.layer, report.phase, report.nonfinite_params) == ("1", "forward", ("1.weight",))
    assert report.layers_checked == 4  # "", "0", "1", "<loss>": no "_orig_mod" entries
    assert not model._forward_hooks and not model[0]._forward_pre_hooks


def test_torchscript_module_is_refused():
    """Hooks cannot be registered on a ScriptModule (torch's RuntimeError before)."""
    with pytest.raises(InvalidArgumentError, match=r"eager module .* model=RecursiveScriptModule"):
        locate_nonfinite(torch.jit.script(nn.Linear(3, 3)), torch.ones(2, 3))
    inner = nn.Sequential(nn.Linear(3, 3), torch.jit.trace(nn.Linear(3, 3), torch.ones(1, 3)))
    with pytest.raises(InvalidArgumentError, match=r"model\.1="):
        locate_nonfinite(inner, torch.ones(2, 3))


@pytest.mark.parametrize(
    ("loss_fn", "received"),
    [
        (lambda y: None, "None (NoneType)"),
        (lambda y: 2, "2 (int)"),
        (lambda y: y.sum().item(), "(float)"),
        (lambda y: (y > 0).sum(), "torch array of dtype int64"),
        (lambda y: y.sum() > 0, "torch array of dtype bool"),
        (lambda y: (y.sum(), y), "builtins.tuple"),
    ],
)
def test_loss_fn_return_value_must_be_a_floating_tensor(loss_fn, received):
    """§15.3's one rule for the loss: None was a silent ``found=False`` before."""
    model = _inf_net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(InvalidArgumentError, match=r"loss_fn returned .*" + re.escape(received)):
        locate_nonfinite(model, torch.ones(2, 3), loss_fn=loss_fn)
    for n, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, before[n])
    assert not model._forward_hooks and not model[1]._forward_pre_hooks


def test_constant_floating_loss_reaches_no_layer():
    report = locate_nonfinite(nn.Linear(3, 3), torch.ones(2, 3), loss_fn=lambda y: torch.ones(()))
    assert not report.found and report.backward_checked
