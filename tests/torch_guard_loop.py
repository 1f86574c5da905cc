"""The small torch regression run that the device-guard tests train a guard on: a NaN batch
at ``nan_steps`` (one input set to NaN), a loss spike at ``spike_steps`` (targets x 1000)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def regression_data(torch: Any) -> tuple[Any, Any]:
    """256 samples of 8 features and a noisy linear target."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g)


def train_guarded(
    torch: Any,
    tg: Any,
    model: Any,
    opt: Any,
    steps: int,
    nan_steps: tuple = (),
    spike_steps: tuple = (),
    loss_as: Callable[[Any], Any] | None = None,
) -> None:
    """``steps`` batches of 32 through ``tg`` (skipped batches after a rollback too), then
    ``tg.flush()``; ``loss_as`` turns the loss into what ``tg.step`` is given."""
    X, Y = regression_data(torch)
    for step in range(steps):
        i = (step % 8) * 32
        x, y = X[i : i + 32].clone(), Y[i : i + 32]
        if step in nan_steps:
            x[0, 0] = math.nan
        if step in spike_steps:
            y = y * 1e3
        if tg.skip_batch():
            continue
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        tg.step(loss if loss_as is None else loss_as(loss))
    tg.flush()
