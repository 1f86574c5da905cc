"""locate_nonfinite on a torch model using ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=True)`` (docs/semantics.md §15.3, errors): a forward fault is still reported
(the forward pass is recorded before the backward); a backward pass, which such a checkpoint
cannot give to ``torch.autograd.grad``, raises ``InvalidArgumentError`` naming
``use_reentrant=True`` and the fix. Before, torch's raw ``RuntimeError: When
use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() ...`` came through,
for a forward fault too."""

from __future__ import annotations

import pytest

import numstab as ns
from numstab.errors import InvalidArgumentError

torch = pytest.importorskip("torch")
nn = torch.nn
checkpoint = pytest.importorskip("torch.utils.checkpoint").checkpoint


class Net(nn.Module):
    def __init__(self, reentrant: bool = True, nan_after: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.reentrant, self.nan_after = reentrant, nan_after

    def forward(self, x):
        h = checkpoint(self.a, x, use_reentrant=self.reentrant)
        if self.nan_after:
            h = h / torch.zeros_like(h) * 0  # the model's own code: forward NaN
        return self.b(h)


def _loss(o):
    return o.sum()


def test_backward_pass_is_refused_with_a_typed_error():
    torch.manual_seed(0)
    net = Net()
    with pytest.raises(InvalidArgumentError, match="use_reentrant=True") as info:
        ns.locate_nonfinite(net, torch.randn(3, 4), loss_fn=_loss)
    assert "use_reentrant=False" in str(info.value)
    assert "Received: model=Net" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert all(p.grad is None for p in net.parameters())  # .grad untouched
    net.reentrant = False  # the fix the message names
    assert not ns.locate_nonfinite(net, torch.randn(3, 4), loss_fn=_loss).found


def test_user_grads_are_kept_when_refused():
    torch.manual_seed(0)
    net = Net()
    net(torch.randn(3, 4).requires_grad_()).sum().backward()  # reentrant needs it
    before = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(InvalidArgumentError):
        ns.locate_nonfinite(net, torch.randn(3, 4), loss_fn=_loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), before, strict=True))


def test_forward_fault_made_by_the_model_is_still_reported():
    torch.manual_seed(0)
    report = ns.locate_nonfinite(Net(nan_after=True), torch.randn(3, 4), loss_fn=_loss)
    assert (report.layer, report.phase, report.nan_count) == ("", "forward", 6), report
    assert report.backward_checked is True


def test_forward_fault_inside_the_checkpointed_layer_is_still_reported():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.a.weight[0, 0] = float("inf")
    report = ns.locate_nonfinite(net, torch.randn(3, 4), loss_fn=_loss)
    assert (report.layer, report.phase, report.nonfinite_params) == ("a", "forward", ("a.weight",))
