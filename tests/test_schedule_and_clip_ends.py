"""Two ends users compare against (an audit of scaling, clipping and schedules):

* ``warmup_cosine_schedule`` at a Python int step ``t >= total_steps`` is ``min_lr`` itself
  (§12.1). optax's order, ``base_lr * ((1 - alpha) * 0 + alpha)``, gave 2.9999999999999997e-05
  for ``min_lr=3e-5``, so a loop's ``lr == min_lr`` stop never fired.
* torch's clipping drop-ins take ``max_norm=inf`` as torch does: nothing is clipped and the
  norm comes back (``clip_grad_norm_(params, float("inf"))`` is how accelerate and the
  ``Trainer`` measure ``grad_norm``). It raised ``Expected max_norm in (0, inf)``.
"""

from __future__ import annotations

import math

import pytest

from numstab.schedules import warmup_cosine_schedule


@pytest.mark.parametrize(
    "base_lr, warmup, total, min_lr", [(3e-4, 0, 50, 3e-5), (0.1, 10, 100, 0.03), (1.0, 3, 7, 0.1)]
)
def test_schedule_is_min_lr_itself_from_total_steps_on(base_lr, warmup, total, min_lr):
    kwargs = dict(warmup_steps=warmup, total_steps=total, min_lr=min_lr)
    schedule = warmup_cosine_schedule(base_lr, **kwargs)
    assert [schedule(t) for t in (total, total + 1, 10**6)] == [min_lr] * 3
    assert schedule(total - 1) > min_lr


torch = pytest.importorskip("torch")


def _param(grad):
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad)
    return p


@pytest.mark.parametrize("max_norm", [math.inf, torch.tensor(math.inf)])
def test_torch_clip_grad_norm_with_inf_max_norm_measures_the_norm(max_norm):
    from numstab.integrations.torch import clip_grad_norm_

    p = _param([3.0, 4.0])
    want = torch.nn.utils.clip_grad_norm_([_param([3.0, 4.0])], max_norm)
    norm = clip_grad_norm_([p], max_norm)
    assert float(norm) == float(want) == 5.0
    assert p.grad.tolist() == [3.0, 4.0]


def test_grad_scaler_clip_grad_norm_with_inf_max_norm_clips_nothing():
    from numstab.integrations.torch import GradScaler

    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler(device="cpu", init_scale=4.0)
    scaler.scale(0.5 * (p * p).sum()).backward()  # the gradient [3, 4], scaled by 4
    assert float(scaler.clip_grad_norm_(opt, math.inf)) == 5.0
    assert p.grad.tolist() == [3.0, 4.0]  # unscaled, not clipped


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, -math.inf])
def test_torch_clip_grad_norm_still_refuses_what_is_no_bound(bad):
    from numstab.errors import InvalidArgumentError
    from numstab.integrations.torch import clip_grad_norm_

    with pytest.raises(InvalidArgumentError, match="max_norm"):
        clip_grad_norm_([_param([3.0, 4.0])], bad)
