"""A step without a loss (``policy.decide(loss=None)``, ``TorchGuard.step_without_loss``) is
decided on the gradients alone: no loss rule is scored, the loss window is not pushed, and the
history's loss is NaN, in host and device mode (``host_every`` > 1). Before, the ``Trainer``
callback switched the guard's loss rule off around a host-mode step and passed 0.0 (which
became the history's loss), and a device-mode loop had no way to step without a loss."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numstab.backends import load_backend
from numstab.guard import TrainingGuard, policy

_GUARD = TrainingGuard(snapshot_every=1000, rollback_after=16)


def _decide_numpy(guard, state, loss, norm):
    be = load_backend("numpy")
    loss = None if loss is None else np.float32(loss)
    return policy.decide(guard, be, state, loss, np.float32(norm))


def test_policy_without_a_loss_scores_and_pushes_no_loss():
    state = _GUARD.init_state("numpy")
    for i in range(80):
        d, state = _decide_numpy(_GUARD, state, None, 1.0 + 0.01 * (i % 3))
        assert bool(d.apply) and math.isnan(float(d.loss)) and float(d.loss_z) == 0.0
    assert int(state.loss_window.count) == 0
    assert int(state.grad_norm_window.count) == 80
    # the gradient rules still apply: a norm spike and a non-finite norm are skipped
    d, state = _decide_numpy(_GUARD, state, None, 1e6)
    assert d.reason_names == ["grad_norm_spike"]
    d, state = _decide_numpy(_GUARD, state, None, float("nan"))
    assert d.reason_names == ["nonfinite_grad"]
    assert int(state.loss_window.count) == 0


def test_policy_without_a_loss_keeps_a_loss_window_as_it_was():
    state = _GUARD.init_state("numpy")
    for i in range(10):
        _, state = _decide_numpy(_GUARD, state, 2.0 + 0.1 * (i % 2), 1.0)
    before = [np.asarray(x).copy() for x in state.loss_window]
    for _ in range(5):
        _, state = _decide_numpy(_GUARD, state, None, 1.0)
    for old, new in zip(before, state.loss_window, strict=True):
        np.testing.assert_array_equal(old, np.asarray(new))


torch = pytest.importorskip("torch")


def _run_torch(host_every: int, nan_at: int = 7, steps: int = 12):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = TrainingGuard(snapshot_every=1000, rollback_after=16, host_every=host_every)
    tg = guard.for_torch(model, opt)
    applied = []
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        if i == nan_at:
            model.weight.grad[0, 0] = float("nan")
        applied.append(bool(tg.step_without_loss()))
    tg.flush()
    return tg, applied


@pytest.mark.parametrize("host_every", [1, 4])
def test_torch_step_without_loss_decides_on_the_gradients_alone(host_every):
    tg, applied = _run_torch(host_every)
    assert applied == [i != 7 for i in range(12)]
    state = tg._device.state() if tg._device is not None else tg.state
    assert int(state.loss_window.count) == 0  # device mode pushed 0.0 twelve times before
    assert int(state.grad_norm_window.count) == 11
    losses = [row[2] for row in tg.history._rows]
    assert all(math.isnan(x) for x in losses)
    skips = [e for e in tg.events if e["event"] == "skip"]
    assert [(e["step"], e["reasons"]) for e in skips] == [(7, ["nonfinite_grad"])]


def test_torch_step_without_loss_host_and_device_modes_agree():
    host, _ = _run_torch(1)
    device, _ = _run_torch(4)
    for a, b in zip(host.history._rows, device.history._rows, strict=True):
        assert a[:2] == b[:2]
        np.testing.assert_allclose(a[3], b[3], rtol=1e-6)


def test_torch_step_still_refuses_a_none_loss():
    from numstab.errors import InvalidArgumentError

    model = torch.nn.Linear(2, 1)
    tg = TrainingGuard().for_torch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(InvalidArgumentError, match="loss"):
        tg.step(None)
