"""numstab's schedules as torch learning-rate schedulers."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from numstab import _validate as v
from numstab.errors import InvalidArgumentError


def lambda_lr(schedule: Any, optimizer: Any, last_epoch: int = -1) -> LambdaLR:
    """A ``LambdaLR`` giving each parameter group ``initial_lr * schedule(step) / base_lr``
    (``schedule`` a ``WarmupCosineSchedule``); 0 when ``base_lr`` is 0. ``last_epoch`` as
    torch takes it: -1 starts, ``k >= 0`` resumes at step ``k + 1`` from the groups'
    ``initial_lr`` (which a scheduler built with -1 wrote there)."""
    _check_arguments(optimizer, last_epoch)
    base_lr = schedule.base_lr

    def multiplier(step: int) -> float:
        return 0.0 if base_lr == 0.0 else schedule(step) / base_lr

    return LambdaLR(optimizer, multiplier, last_epoch=last_epoch)


def _check_arguments(optimizer: Any, last_epoch: Any) -> None:
    """Typed errors for what ``LambdaLR`` answered with an ``AttributeError`` (not an
    optimizer) or a ``KeyError`` (resuming without ``initial_lr``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"Expected optimizer to be a torch.optim.Optimizer. Received: optimizer of type "
            f"{type(optimizer).__name__}"
        )
    last_epoch = v.check_int("last_epoch", last_epoch)
    if last_epoch < -1:
        raise InvalidArgumentError(
            f"Expected last_epoch >= -1 (-1 starts the schedule). Received: last_epoch={last_epoch}"
        )
    missing = [i for i, g in enumerate(optimizer.param_groups) if "initial_lr" not in g]
    if last_epoch >= 0 and missing:
        raise InvalidArgumentError(
            f"Expected every param group to hold 'initial_lr' to resume at last_epoch="
            f"{last_epoch} (a scheduler built with last_epoch=-1 writes it; or load the "
            f"scheduler's state_dict instead). Received: param_groups[{missing[0]}] without it"
        )
