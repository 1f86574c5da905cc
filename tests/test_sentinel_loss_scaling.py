"""``check_numerics(mode="sentinel")`` under loss scaling (§14.6): the parameter gradients of
a step that an enabled numstab ``GradScaler`` found non-finite and skipped (an overflow it
handled by backing off) are not reported; a real fault still is: a NaN in a forward output,
a non-finite gradient with no scaler, a disabled scaler, a scale already at its floor, or a
parameter no scaled optimizer holds."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import numstab as ns  # noqa: E402
from numstab.errors import NonFiniteError  # noqa: E402
from numstab.integrations.torch import GradScaler  # noqa: E402
from numstab.numerics import Recorder  # noqa: E402


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _loss(model, x, y, factor: float = 1.0):
    return nn.functional.cross_entropy(model(x), y) * factor


def test_fp16_amp_overflow_backoff_is_not_reported():
    """The audit's case: fp16 autocast, the default scale 2**16 overflows, the scaler skips
    and backs off; the sentinel, on all the while, stays quiet and training proceeds."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(m.parameters(), 1e-3)
    sc = GradScaler()
    x, y = torch.randn(32, 64) * 30, torch.randint(0, 10, (32,))
    applied = []
    with ns.check_numerics(mode="sentinel") as cn:
        for _ in range(6):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = m(x)
            loss = ns.cross_entropy(logits, y)
            sc.scale(loss).backward()
            applied.append(sc.step_and_update(opt, max_norm=1.0))
            cn.check()
    assert not applied[0], "the scale 2**16 overflows float16 gradients: a skip"
    assert applied[-1], "after backing off, steps are applied"
    assert sc.get_scale() < 2.0**16


#: numstab's GradScaler, and torch's own (its ``step`` settled while a sentinel is active)
SCALERS = {"numstab": GradScaler, "torch": lambda **kw: torch.amp.GradScaler("cpu", **kw)}


@pytest.mark.parametrize(
    "kind, api",
    [("numstab", "step_and_update"), *((k, a) for k in SCALERS for a in ("step", "unscale_"))],
)
def test_a_skipped_non_finite_step_is_not_reported(kind, api):
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = SCALERS[kind](init_scale=2.0**10)
    with ns.check_numerics(mode="sentinel") as cn:
        for step in range(3):
            opt.zero_grad()
            sc.scale(_loss(m, x, y, math.inf if step == 1 else 1.0)).backward()
            if api == "step_and_update":
                sc.step_and_update(opt)
            else:
                if api == "unscale_":
                    sc.unscale_(opt)
                sc.step(opt)
                sc.update()
            cn.check()
    assert sc.get_scale() == 2.0**9  # one backoff


def test_checked_once_after_several_steps():
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = GradScaler(init_scale=2.0**10)
    with ns.check_numerics(mode="sentinel"):  # read only at exit
        for step in range(4):
            opt.zero_grad()
            sc.scale(_loss(m, x, y, math.inf if step in (0, 2) else 1.0)).backward()
            sc.step_and_update(opt)


@pytest.mark.parametrize("kind", SCALERS)
def test_fused_optimizer_skip_is_not_reported(kind):
    m, (x, y) = _model(), _data()
    try:
        opt = torch.optim.Adam(m.parameters(), 0.01, fused=True)
    except RuntimeError as error:  # a torch without CPU fused Adam
        pytest.skip(str(error))
    sc = SCALERS[kind](init_scale=2.0**10)
    with ns.check_numerics(mode="sentinel") as cn:
        opt.zero_grad()
        sc.scale(_loss(m, x, y, math.inf)).backward()
        sc.step(opt)
        sc.update()
        cn.check()
    assert sc.get_scale() == 2.0**9


def test_gradient_accumulation_over_micro_batches():
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = GradScaler(init_scale=2.0**10)
    with ns.check_numerics(mode="sentinel") as cn:
        opt.zero_grad()
        for micro in range(3):
            sc.scale(_loss(m, x, y, math.inf if micro == 1 else 1.0)).backward()
        assert not sc.step_and_update(opt)
        cn.check()


def test_an_early_read_mid_step_keeps_the_gradients_on_hold(monkeypatch):
    """Every ``FLUSH_EVERY`` records the summaries are read early, here mid-backward: the
    gradients read bad then wait for the scaler's verdict instead of being reported."""
    monkeypatch.setattr(Recorder, "FLUSH_EVERY", 2)
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = GradScaler(init_scale=2.0**10)
    with ns.check_numerics(mode="sentinel") as cn:
        for step in range(3):
            opt.zero_grad()
            sc.scale(_loss(m, x, y, math.inf if step == 1 else 1.0)).backward()
            sc.step_and_update(opt)
            cn.check()
    # ... and without a scaler the same early read still reports
    with pytest.raises(NonFiniteError) as info, ns.check_numerics(mode="sentinel"):
        _loss(m, x, y, math.inf).backward()
    assert info.value.phase == "backward"


def _raises_backward(run) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        run()
    assert info.value.phase == "backward"
    return info.value


def test_no_scaler_or_a_disabled_one_still_reports():
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)

    def without():
        with ns.check_numerics(mode="sentinel") as cn:
            _loss(m, x, y, math.inf).backward()
            cn.check()

    def disabled():
        sc = GradScaler(enabled=False)
        with ns.check_numerics(mode="sentinel") as cn:
            opt.zero_grad()
            sc.scale(_loss(m, x, y, math.inf)).backward()
            sc.step_and_update(opt)  # applies the NaN gradients
            cn.check()

    _raises_backward(without)
    _raises_backward(disabled)


def test_a_scale_at_its_floor_is_reported():
    """The scaler cannot back off further: the overflow is no longer routine."""
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = GradScaler(init_scale=1.0, min_scale=1.0)

    def run():
        with ns.check_numerics(mode="sentinel") as cn:
            opt.zero_grad()
            sc.scale(_loss(m, x, y, math.inf)).backward()
            assert not sc.step_and_update(opt)
            cn.check()

    _raises_backward(run)


def test_a_forward_nan_is_reported_with_the_scaler():
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    sc = GradScaler(init_scale=2.0**10)
    x = x.clone()
    x[0, 0] = math.nan
    with pytest.raises(NonFiniteError) as info, ns.check_numerics(mode="sentinel") as cn:
        sc.scale(_loss(m, x, y)).backward()
        sc.step_and_update(opt)
        cn.check()
    assert info.value.phase == "forward"


def test_a_parameter_no_scaled_optimizer_holds_is_reported():
    """Only the gradients the scaler checked are settled: a frozen-by-optimizer layer's
    non-finite gradient is a fault even on a step the scaler skipped."""
    m, (x, y) = _model(), _data()
    opt = torch.optim.SGD(m[2].parameters(), 0.1)  # the first layer is not optimised
    sc = GradScaler(init_scale=2.0**10)

    def run():
        with ns.check_numerics(mode="sentinel") as cn:
            sc.scale(_loss(m, x, y, math.inf)).backward()
            assert not sc.step_and_update(opt)
            cn.check()

    error = _raises_backward(run)
    assert all(p.startswith("0.") for p in error.paths), error.paths


def test_check_before_the_scaler_step_reports():
    """The verdict comes with the scaler's check (``unscale_`` / ``step``): a ``check()``
    between ``backward()`` and it reads the gradients as they are."""
    m, (x, y) = _model(), _data()
    sc = GradScaler(init_scale=2.0**10)
    with pytest.raises(NonFiniteError), ns.check_numerics(mode="sentinel") as cn:
        sc.scale(_loss(m, x, y, math.inf)).backward()
        cn.check()


def test_op_mode_still_raises_at_the_overflow():
    """``mode="op"`` is a debugging mode: it raises at the op that overflows."""
    m, (x, y) = _model(), _data()
    sc = GradScaler(init_scale=2.0**10)
    with pytest.raises(NonFiniteError), ns.check_numerics():
        sc.scale(_loss(m, x, y, math.inf)).backward()


def test_a_nan_of_every_step_is_reported_once_the_scale_is_down_to_1():
    """A NaN gradient that is no overflow (``sqrt`` at 0, every step) makes the scaler skip and
    halve each step; once the scale is down to 1 it scales nothing, and the NaN is reported:
    16 skips from the default 2**16 (it took 142, down to the floor 2**-126)."""

    class Sqrt(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.w = nn.Linear(4, 4), nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return self.lin(x) * torch.sqrt(self.w).sum()  # finite forward, NaN gradient

    m, x = Sqrt(), torch.randn(2, 4)
    opt, sc = torch.optim.SGD(m.parameters(), 0.1), GradScaler()
    reported = None
    with ns.check_numerics(mode="sentinel") as cn:
        for step in range(40):
            opt.zero_grad()
            sc.scale(m(x).square().mean() + m.w.sum()).backward()
            assert not sc.step_and_update(opt)
            try:
                cn.check()
            except ns.NonFiniteError:
                reported = step
                break
    assert reported == 16 and sc.get_scale() == 0.5, (reported, sc.get_scale())
