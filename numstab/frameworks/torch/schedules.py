"""numstab's schedules as torch learning-rate schedulers."""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LambdaLR


def lambda_lr(schedule: Any, optimizer: Any, last_epoch: int = -1) -> LambdaLR:
    """A ``LambdaLR`` giving each parameter group ``initial_lr * schedule(step) / base_lr``
    (``schedule`` a ``WarmupCosineSchedule``); 0 when ``base_lr`` is 0."""
    base_lr = schedule.base_lr

    def multiplier(step: int) -> float:
        return 0.0 if base_lr == 0.0 else schedule(step) / base_lr

    return LambdaLR(optimizer, multiplier, last_epoch=last_epoch)
