"""locate_nonfinite on torch takes the gradient with respect to the model's floating inputs,
as Keras (on every backend) and JAX do (§15.3, "the same in torch, Keras and JAX"): a fault
that is non-finite only w.r.t. the input (d sqrt(h)/dh = inf at h = 0) is found although the
caller's input does not require grad. Before, torch recorded no input edge for such an input
and reported found=False where Keras and Equinox found the layer. The caller's tensors and
the model's parameters are left as they were; integer inputs (token ids) get no gradient."""

from __future__ import annotations

import numpy as np
import pytest

from numstab.locate import locate_nonfinite

torch = pytest.importorskip("torch")
nn = torch.nn

X = np.array([[0.0, 1.0]], np.float32)  # d sqrt(h)/dh = 1 / (2 sqrt(h)): inf at 0, 0.5 at 1


class Sqrt(nn.Module):
    def forward(self, h):
        return torch.sqrt(h)


class Net(nn.Module):
    """fc(sqrt(x)): a finite forward; the only non-finite gradient is sqrt's w.r.t. x."""

    def __init__(self):
        super().__init__()
        self.s, self.fc = Sqrt(), nn.Linear(2, 1)

    def forward(self, x):
        return self.fc(self.s(x))


def _summary(report) -> tuple:
    return (
        report.found,
        report.layer,
        report.phase,
        report.nan_count,
        report.inf_count,
        report.inputs_finite,
        report.grad_output_finite,
        report.nonfinite_params,
        report.layers_checked,
    )


# s's own input gradient: [inf, 0.5] * fc.weight (finite, nonzero): one inf, no NaN
EXPECTED = (True, "s", "backward", 0, 1, True, True, (), 4)  # s, fc, "", "<loss>"


def test_input_only_gradient_fault_matches_equinox():
    jax = pytest.importorskip("jax")
    eqx = pytest.importorskip("equinox")
    import jax.numpy as jnp

    class ESqrt(eqx.Module):
        def __call__(self, h):
            return jnp.sqrt(h)

    class ENet(eqx.Module):
        s: ESqrt
        fc: eqx.nn.Linear

        def __init__(self):
            self.s, self.fc = ESqrt(), eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0))

        def __call__(self, v):
            return self.fc(self.s(v))

    reference = locate_nonfinite(ENet(), jnp.asarray(X[0]), loss_fn=lambda o: o.sum())
    assert _summary(reference) == EXPECTED  # the documented report, from JAX
    x = torch.from_numpy(X.copy())
    report = locate_nonfinite(Net(), x, loss_fn=lambda o: o.sum())
    assert _summary(report) == _summary(reference), report


def test_caller_tensor_and_model_state_untouched():
    """The input is copied for the pass: the caller's tensor still does not require grad,
    has no ``.grad`` and keeps its values even when the model edits its input in place."""

    class Halve(nn.Module):
        def forward(self, h):
            h /= 2  # in place on the model's input: legal on a non-leaf copy
            return torch.sqrt(h)

    model = nn.Sequential(Halve(), nn.Linear(2, 1))
    model[1].bias.requires_grad_(False)  # a frozen parameter stays frozen
    x = torch.from_numpy(X.copy())
    report = locate_nonfinite(model, x, loss_fn=lambda o: o.sum())
    assert (report.found, report.layer, report.phase) == (True, "0", "backward"), report
    assert (report.nan_count, report.inf_count) == (0, 1)
    assert not x.requires_grad and x.grad is None and x.grad_fn is None
    assert torch.equal(x, torch.from_numpy(X))  # the model's in-place edit hit the copy
    assert model[1].weight.requires_grad and not model[1].bias.requires_grad
    assert all(p.grad is None for p in model.parameters())


def test_keyword_and_nested_inputs_beside_token_ids():
    """Floating tensors given as a keyword argument, or in a tuple or dict, get their
    gradient; integer token ids beside them are passed as given (no gradient)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.s, self.fc = nn.Embedding(5, 2), Sqrt(), nn.Linear(2, 1)

        def forward(self, pair, *, scale, extra):
            ids, h = pair
            assert not ids.is_floating_point() and not ids.requires_grad
            return self.fc(self.emb(ids) * self.s(scale) + h + extra["bias"])

    torch.manual_seed(0)
    ids, h = torch.tensor([[1, 3]]), torch.ones(1, 2)
    bias, scale = torch.zeros(2), torch.from_numpy(X.copy())
    report = locate_nonfinite(
        Model(), (ids, h), scale=scale, extra={"bias": bias}, loss_fn=lambda o: o.sum()
    )
    assert (report.found, report.layer, report.phase) == (True, "s", "backward"), report
    # s's own gradient: [inf, 0.5] * (emb(ids) * fc.weight), both nonzero for this seed
    assert (report.nan_count, report.inf_count) == (0, 1)
    assert all(not t.requires_grad and t.grad is None for t in (ids, h, bias, scale))


def test_clean_model_stays_clean_and_ids_only_model_works():
    """No false report from the new input gradient: a clean float input and an integer
    input alone (nothing to differentiate) both give found=False."""
    clean = locate_nonfinite(Net(), torch.ones(3, 2), loss_fn=lambda o: o.sum())
    assert not clean.found and clean.backward_checked, clean
    model = nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 1))
    ids = locate_nonfinite(model, torch.tensor([[1, 4]]), loss_fn=lambda o: o.sum())
    assert not ids.found and ids.layers_checked == 4, ids
