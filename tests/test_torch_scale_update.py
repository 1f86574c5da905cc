"""The torch GradScaler's update through ``torch._amp_update_scale_`` equals
``LossScaler.update`` step for step where it applies, and is not used where it does not."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.frameworks.torch import scale_update  # noqa: E402
from numstab.loss_scale import LossScaler  # noqa: E402

APPLIES = {
    "torch": LossScaler.preset("torch"),
    "keras": LossScaler.preset("keras"),
    "floored": LossScaler(init_scale=4.0, growth_interval=3, min_scale=1.0),
    "consecutive": LossScaler(init_scale=8.0, growth_interval=3, consecutive_hysteresis=True),
    "factor 4": LossScaler(
        init_scale=2.0**10, growth_interval=2, growth_factor=4.0, backoff_factor=0.25
    ),
    "near the top": LossScaler(init_scale=2.0**126, growth_interval=1),
    "near the floor": LossScaler(init_scale=2.0**-120, growth_interval=5),
}
NOT_APPLIES = {
    "hysteresis 2": LossScaler(hysteresis=2),
    "delay": LossScaler(growth_delay_after_overflow=1),
    "max_scale": LossScaler(max_scale=2.0**20),
    "factor 3": LossScaler(growth_factor=3.0),
    "static": LossScaler(dynamic=False),
    "deepspeed": LossScaler.preset("deepspeed"),
}


@pytest.mark.parametrize("name", APPLIES)
def test_kernel_update_equals_the_generic_rule(name):
    """200 steps of a scripted mix of finite and non-finite steps (runs of overflows long
    enough to reach the floor, runs of good steps long enough to grow), every field equal."""
    scaler = APPLIES[name]
    assert scale_update.kernel_applies(scaler)
    rng = np.random.default_rng(0)
    bad = rng.random(200) < 0.3
    bad[50:190] = [i % 40 < 25 for i in range(140)]  # long runs of both kinds
    ours = theirs = scaler.init(backend="torch")
    for step, overflow in enumerate(bad):
        found = torch.tensor(2.0 if overflow else 0.0)  # summed flags of two optimizers
        before = ours
        ours = scale_update.fused_update(scaler, ours, found)
        theirs = scaler.update(theirs, torch.tensor(not overflow), backend="torch")
        for field, a, b in zip(ours._fields, ours, theirs, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, step, field, a, b)
        assert ours.scale is not before.scale  # the old state is not mutated


@pytest.mark.parametrize("name", NOT_APPLIES)
def test_other_configurations_keep_the_generic_rule(name):
    assert not scale_update.kernel_applies(NOT_APPLIES[name])


def test_a_state_with_more_hysteresis_than_configured_is_refused():
    scaler = LossScaler.preset("torch")
    data = scaler.state_dict(scaler.init(backend="torch"), backend="torch")
    data["state"]["hysteresis_left"] = 2
    with pytest.raises(InvalidArgumentError, match="hysteresis_left"):
        LossScaler.from_state_dict(data, backend="torch")


@pytest.mark.parametrize("name", APPLIES)
def test_kernel_update_equals_the_generic_rule_from_any_state(name):
    """Trackers no update of this scaler makes (negative, or at and past the interval, as a
    loaded state or a lowered ``set_growth_interval`` leaves them): still every field equal.
    torch's kernel grows only at ``tracker + 1 == interval``; the generic rule at ``>=``."""
    scaler = APPLIES[name]
    interval = scaler.growth_interval
    init = scaler.init(backend="torch")
    for tracker in (-3, -1, 0, interval - 2, interval - 1, interval, interval + 5):
        for left in (0, 1):
            state = init._replace(
                growth_tracker=torch.tensor(tracker, dtype=torch.int32),
                hysteresis_left=torch.tensor(left, dtype=torch.int32),
            )
            for found in (0.0, 1.0):
                ours = scale_update.fused_update(scaler, state, torch.tensor(found))
                theirs = scaler.update(state, torch.tensor(found == 0), backend="torch")
                for field, a, b in zip(ours._fields, ours, theirs, strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b), (tracker, left, found, field)
                assert ours.growth_tracker is not state.growth_tracker


def test_grad_scaler_grows_after_a_lowered_growth_interval():
    """As ``LossScaler.update``: the first finite step at or past the new interval grows
    (torch's GradScaler, whose kernel tests ``==``, would never grow again)."""
    from numstab.integrations.torch import GradScaler

    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler(scaler=LossScaler(init_scale=8.0, growth_interval=4))
    scales = []
    for step in range(6):
        scaler.scale(param.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == 2:  # tracker 3
            scaler.set_growth_interval(2)
        scales.append(scaler.get_scale())
    assert scales == [8.0, 8.0, 8.0, 16.0, 16.0, 32.0]
