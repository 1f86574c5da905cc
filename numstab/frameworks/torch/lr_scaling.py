"""The learning-rate cut of a torch guard's rollback (docs/semantics.md §16.6): the param
groups' learning rates times the cut, and with them every stored value a torch scheduler
computes learning rates from, so that each LR the scheduler gives from then on is the cut
times the one it would have given without it."""

from __future__ import annotations

import numbers
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

#: param-group entries that hold a learning rate (OneCycleLR keeps max_lr and min_lr there)
GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
#: scheduler attributes with one learning rate per param group: LRScheduler's base_lrs,
#: CyclicLR's max_lrs, ReduceLROnPlateau's min_lrs, the LRs get_last_lr() returns
LIST_ATTRS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
#: scheduler attributes with one learning rate for all groups: CosineAnnealingLR's and
#: CosineAnnealingWarmRestarts' eta_min, ReduceLROnPlateau's default_min_lr (None: unused)
SCALAR_ATTRS = ("eta_min", "default_min_lr")


def scale_lr(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    ratio: float,
    ratio_now: float,
    kept: int,
    restored: bool,
) -> None:
    """Multiply the learning rates of a rollback (after ``restore``; ``GuardRunner.rollback``).

    Param group ``i``: its ``GROUP_KEYS`` times ``ratio`` for ``i < kept`` (restored from the
    snapshot), else ``ratio_now`` (added since, kept as they were). The scheduler and those
    it delegates to (``_schedulers``: SequentialLR, ChainedScheduler), when ``restored`` (its
    state_dict loaded from the snapshot, so nothing is scaled twice by a second rollback to
    one snapshot): entry ``i`` of each ``LIST_ATTRS`` list by the same rule, each
    ``SCALAR_ATTRS`` number times ``ratio`` (a scalar is restored with the state and cannot
    take two ratios: a group added since, if the scheduler drives it, gets its floor cut
    by ``ratio``); not restored: all times ``ratio_now``. A user-defined scheduler: what of
    these it has; anything else stays. Then the top scheduler's ``_last_lr`` (what
    ``get_last_lr()`` returns) is the groups' learning rates after the cut."""
    per_group = lambda i: ratio if i < kept else ratio_now
    for i, group in enumerate(optimizer.param_groups):
        _scale_entries(group, GROUP_KEYS, per_group(i))
    if scheduler is None:
        return
    in_state = per_group if restored else (lambda i: ratio_now)
    for s in schedulers_in(scheduler):
        _scale_scheduler(s, in_state, ratio if restored else ratio_now)
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [_copy(g["lr"]) for g in optimizer.param_groups]


def schedulers_in(scheduler: Any) -> list[Any]:
    """``scheduler`` and, depth first, the schedulers in its ``_schedulers`` list (and in
    theirs), each once."""
    found: dict[int, Any] = {}
    todo = [scheduler]
    while todo:
        s = todo.pop()
        if id(s) in found:
            continue
        found[id(s)] = s
        children = getattr(s, "_schedulers", None)
        if isinstance(children, (list, tuple)):
            todo.extend(reversed(children))
    return list(found.values())


def _scale_scheduler(s: Any, per_group: Callable[[int], float], ratio: float) -> None:
    """``s``'s ``LIST_ATTRS`` (entry ``i`` times ``per_group(i)``) and ``SCALAR_ATTRS`` (times
    ``ratio``), each replaced by a new value (a list may be shared with a state_dict)."""
    for name in LIST_ATTRS:
        values = getattr(s, name, None)
        if isinstance(values, (list, tuple)):
            scaled = [_times(x, per_group(i)) for i, x in enumerate(values)]
            setattr(s, name, type(values)(scaled))
    for name in SCALAR_ATTRS:
        value = getattr(s, name, None)
        if _is_lr(value):
            setattr(s, name, _times(value, ratio))


def _scale_entries(group: MutableMapping[str, Any], keys: tuple[str, ...], r: float) -> None:
    """``group[key] *= r`` for each of ``keys`` it holds; a tensor in place (an optimizer
    built with a tensor ``lr``, e.g. for capturable or compiled steps, keeps its tensor)."""
    for key in keys:
        value = group.get(key)
        if isinstance(value, torch.Tensor):
            value.mul_(r)
        elif _is_lr(value):
            group[key] = value * r


def _times(x: Any, r: float) -> Any:
    """``x * r`` for a number or a tensor (a new one); anything else as it is."""
    return x * r if _is_lr(x) else x


def _is_lr(x: Any) -> bool:
    """A real number (not a bool) or a tensor."""
    return isinstance(x, torch.Tensor) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _copy(x: Any) -> Any:
    """A tensor cloned (``get_last_lr()`` never aliases a group's ``lr``); else ``x``."""
    return x.clone() if isinstance(x, torch.Tensor) else x
