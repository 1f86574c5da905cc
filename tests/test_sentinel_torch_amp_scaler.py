"""``check_numerics(mode="sentinel")`` with torch's own ``torch.amp.GradScaler`` (§14.6): the
parameter gradients of a step the scaler found non-finite and skipped at a scale above 1 are
not reported, as with numstab's ``GradScaler`` (the skip and fused-optimizer cases run for both
in ``test_sentinel_loss_scaling.py``). Before, the sentinel reported the fp16 AMP
recipe's first routine overflow (torch's scale starts at 2**16), which ended the run."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import numstab as ns  # noqa: E402
from numstab.errors import NonFiniteError  # noqa: E402
from tests.test_sentinel_loss_scaling import _data, _loss, _model  # noqa: E402


def test_fp16_amp_with_torch_gradscaler_backs_off_quietly():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(m.parameters(), 1e-3)
    sc = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 64) * 30, torch.randint(0, 10, (32,))
    scales = []
    with ns.check_numerics(mode="sentinel") as cn:
        for _ in range(6):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = m(x)
            loss = ns.cross_entropy(logits, y)
            sc.scale(loss).backward()
            sc.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(opt)
            sc.update()
            scales.append(sc.get_scale())
            cn.check()
    assert scales[0] < 2.0**16, "the scale 2**16 overflows float16 gradients: a skip"
    assert scales[-1] == scales[-2], "after backing off, steps are applied"


def test_a_nan_of_every_step_is_reported_once_the_scale_reaches_1():
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=4.0)
    checked = []
    with pytest.raises(NonFiniteError) as info, ns.check_numerics(mode="sentinel") as cn:
        for _ in range(5):
            opt.zero_grad()
            sc.scale(_loss(m, x, y, math.nan)).backward()
            sc.step(opt)
            sc.update()
            cn.check()
            checked.append(sc.get_scale())
    assert checked == [2.0, 1.0]  # skipped at 4 and 2; at 1 nothing was scaled up: reported
    assert info.value.phase == "backward"


def test_a_disabled_scaler_and_a_forward_nan_are_still_reported():
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(NonFiniteError), ns.check_numerics(mode="sentinel") as cn:
        sc.scale(_loss(m, x, y, math.inf)).backward()
        sc.step(opt)
        cn.check()
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with pytest.raises(NonFiniteError) as info, ns.check_numerics(mode="sentinel") as cn:
        sc.scale(_loss(m, x * math.nan, y)).backward()
        sc.step(opt)
        cn.check()
    assert info.value.phase == "forward"


def test_torch_gradscaler_step_is_its_own_again_after_the_context():
    original = torch.amp.GradScaler.step
    with ns.check_numerics(mode="sentinel"):
        with ns.check_numerics(mode="sentinel"):
            assert torch.amp.GradScaler.step is not original
        assert torch.amp.GradScaler.step is not original  # the outer context still needs it
    assert torch.amp.GradScaler.step is original
