"""A rejected call leaves torch's stateful drop-ins as they were (the backend-neutral objects
are covered by the bad-input matrix, tests/bad_inputs)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations.torch import GradScaler  # noqa: E402


def _model_and_scaler():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=1024.0, growth_interval=1)
    for _ in range(2):  # a real history: the scale has grown
        opt.zero_grad()
        scaler.scale(model(torch.ones(4, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return model, opt, scaler


def _snapshot(model, scaler):
    state = scaler.state_dict()
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}, [
        p.detach().clone() for p in model.parameters()
    ]


@pytest.mark.parametrize(
    "bad_call",
    [
        lambda s, o: s.update(new_scale="big"),
        lambda s, o: s.update(new_scale=-1.0),
        lambda s, o: s.update(new_scale=math.nan),
        lambda s, o: s.set_growth_factor(0.5),
        lambda s, o: s.set_backoff_factor(2.0),
        lambda s, o: s.set_growth_interval(0),
        lambda s, o: s.clip_grad_norm_(o, max_norm=-1.0),
        lambda s, o: s.clip_grad_norm_(o, max_norm=1.0, norm_type="fro"),
        lambda s, o: s.load_state_dict({"scale": "x"}),
    ],
    ids=[
        "update-str",
        "update-negative",
        "update-nan",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "clip-max_norm",
        "clip-norm_type",
        "load_state_dict",
    ],
)
def test_gradscaler_unchanged_after_a_rejected_call(bad_call):
    model, opt, scaler = _model_and_scaler()
    opt.zero_grad()
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    before, params = _snapshot(model, scaler)
    with pytest.raises(InvalidArgumentError):
        bad_call(scaler, opt)
    after, params_after = _snapshot(model, scaler)
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, key
    assert all(torch.equal(a, b) for a, b in zip(params, params_after, strict=True))
    scaler.step(opt)  # the scaler still works: the iteration completes as usual
    scaler.update()
    assert scaler.get_scale() > 0
