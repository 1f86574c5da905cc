"""The optimizer's parameter groups as the torch guard sees them: only the model's parameters
(checked when the guard is built and again when a group is added), and a snapshot's groups
fitted to the optimizer's groups as they are now (groups added since are kept)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from numstab.errors import InvalidArgumentError


def check_own_parameters(
    known: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, first_group: int = 0
) -> int:
    """Refuse an optimizer whose groups from ``first_group`` on hold tensors not in ``known``
    (the model's parameters when the guard was built), which the guard neither checks nor
    snapshots: their non-finite gradients would be applied and no rollback could restore
    them. Returns the number of groups checked so far (the next call's ``first_group``)."""
    own = {id(p) for p in known}
    groups = optimizer.param_groups
    foreign = [p for g in groups[first_group:] for p in g["params"] if id(p) not in own]
    if foreign:
        where = "the optimizer" if first_group == 0 else "a group added by add_param_group"
        raise InvalidArgumentError(
            f"Expected {where} over the model's own parameters: the guard checks and "
            "snapshots those only, so the others' non-finite gradients would be applied and no "
            "rollback could restore them. Register them on the model (an nn.Parameter of one "
            "of its modules) before the guard is built. Received: "
            f"{len(foreign)} optimizer parameter(s) not in model.parameters()"
            f"{'' if first_group == 0 else ' when the guard was built'}, shapes "
            f"{[tuple(p.shape) for p in foreign[:4]]}"
        )
    return len(groups)


def fitted(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state ``saved`` (a snapshot's) for ``optimizer`` as it is now. Groups
    added since (``add_param_group``: Lightning's ``BackboneFinetuning``) are kept with their
    settings as now and no state, as their parameters had none when the snapshot was taken
    (torch's ``load_state_dict`` raised ``ValueError``). Any other change of the groups:
    ``InvalidArgumentError``."""
    then = [len(g["params"]) for g in saved["param_groups"]]
    now = [len(g["params"]) for g in optimizer.param_groups]
    if then == now:
        return saved
    if len(then) < len(now) and now[: len(then)] == then:
        added = optimizer.state_dict()["param_groups"][len(then) :]  # ids follow the old ones
        return {**saved, "param_groups": saved["param_groups"] + copy.deepcopy(added)}
    raise InvalidArgumentError(
        f"Expected the optimizer's parameter groups of the snapshot to roll back to (sizes "
        f"{then}), or those and groups added after them (add_param_group). Received: an "
        f"optimizer whose parameter groups changed to sizes {now}"
    )
