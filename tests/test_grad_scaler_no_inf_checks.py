"""``GradScaler.step`` on an optimizer none of whose parameters got a gradient since
``scale()`` (``backward()`` forgotten): ``torch.amp.GradScaler`` asserts "No inf checks were
recorded for this optimizer."; numstab's drop-in raises ``InvalidArgumentError`` with that
meaning and changes nothing (before, the step counted as finite: the scale grew). An
optimizer with some parameters without gradients works as in torch (§10.1)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.torch import GradScaler  # noqa: E402


def _setup(fused: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    if fused:
        try:
            opt = torch.optim.Adam(model.parameters(), 0.01, fused=True)
        except RuntimeError as error:
            pytest.skip(str(error))
    else:
        opt = torch.optim.SGD(model.parameters(), 0.1)
    x = torch.randn(3, 4)
    return model, opt, x


def _state(sc: GradScaler) -> tuple:
    return tuple(float(v) for v in sc.state)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("api", ["step", "step_and_update"])
def test_step_without_backward_raises_and_changes_nothing(fused, api):
    model, opt, x = _setup(fused)
    sc = GradScaler(init_scale=8.0, growth_interval=1)
    sc.scale(model(x).sum())  # no backward()
    before = _state(sc)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match="No inf checks were recorded for this optim"):
        sc.step(opt) if api == "step" else sc.step_and_update(opt, max_norm=1.0)
    assert _state(sc) == before  # before, the scale grew to 16 and the tracker counted
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    # nothing was recorded: the same iteration goes on once backward() ran
    sc.scale(model(x).sum()).backward()
    assert sc.step_and_update(opt)
    assert sc.get_scale() == 16.0


def test_torch_asserts_alike():
    model, opt, x = _setup()
    sc = torch.amp.GradScaler("cpu", init_scale=8.0)
    sc.scale(model(x).sum())
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        sc.step(opt)


def test_unscale_without_gradients_then_step_or_update_raises():
    """As torch: ``unscale_`` records nothing and passes; ``step`` and ``update`` raise."""
    model, opt, x = _setup()
    sc = GradScaler(init_scale=8.0)
    sc.scale(model(x).sum())
    sc.unscale_(opt)
    with pytest.raises(InvalidArgumentError, match="No inf checks were recorded for this optim"):
        sc.step(opt)
    with pytest.raises(InvalidArgumentError, match="No inf checks were recorded prior"):
        sc.update()
    assert sc.get_scale() == 8.0


def test_clip_without_gradients_then_step_raises():
    model, opt, x = _setup()
    sc = GradScaler(init_scale=8.0)
    sc.scale(model(x).sum())
    assert float(sc.clip_grad_norm_(opt, 1.0)) == 0.0
    with pytest.raises(InvalidArgumentError, match="No inf checks"):
        sc.step(opt)


def test_some_parameters_without_gradients_step_as_in_torch():
    model, opt, x = _setup()
    ref_model, ref_opt, _ = _setup()
    for m in (model, ref_model):
        m[2].bias.requires_grad_(False)  # never gets a gradient
    ours, theirs = (
        GradScaler(init_scale=8.0, growth_interval=1),
        torch.amp.GradScaler("cpu", 8.0, growth_interval=1),
    )
    for sc, m, o in ((ours, model, opt), (theirs, ref_model, ref_opt)):
        for _ in range(2):
            o.zero_grad()
            sc.scale(m(x).sum()).backward()
            sc.step(o)
            sc.update()
    assert ours.get_scale() == theirs.get_scale() == 32.0
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
