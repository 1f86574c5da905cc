"""The optimizer's parameter groups as the torch guard sees them: only the model's parameters
(checked when the guard is built and again when a group is added), a snapshot's groups
fitted to the optimizer's groups as they are now (groups added since are kept), and a
snapshot's optimizer state restored with its own dtypes (``exact_state``)."""

from __future__ import annotations

import copy
import itertools
import operator
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


def exact_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """After ``optimizer.load_state_dict(saved)``: each state tensor with the dtype it has in
    ``saved`` (where torch's load cast it to its parameter's dtype: a float32 master copy or
    32-bit state of a bfloat16 / float16 parameter became bfloat16 / float16, silently and
    for the rest of training), on the device torch moved it to. ``saved``'s tensors are
    taken, not copied: a copy of the snapshot's, as ``load_state_dict`` was given."""
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    ids = itertools.chain.from_iterable(g["params"] for g in saved["param_groups"])
    for i, p in zip(ids, params, strict=True):
        then, now = saved["state"].get(i), optimizer.state.get(p)
        if isinstance(then, dict) and isinstance(now, dict):
            for k, x in now.items():
                if k in then:
                    y = _as_saved(then[k], x)
                    if y is not x:
                        now[k] = y


def _as_saved(then: Any, now: Any) -> Any:
    """``now`` (loaded) with its tensors of another dtype than in ``then`` (saved) replaced
    by ``then``'s, on ``now``'s device; ``now`` itself where nothing differs."""
    if isinstance(then, torch.Tensor):
        if isinstance(now, torch.Tensor) and now.dtype != then.dtype:
            return then.to(now.device)
        return now
    if isinstance(then, dict) and isinstance(now, dict) and then.keys() == now.keys():
        out = {k: _as_saved(then[k], x) for k, x in now.items()}
        return now if all(out[k] is x for k, x in now.items()) else out
    if isinstance(then, (list, tuple)) and type(now) is type(then) and len(now) == len(then):
        out = [_as_saved(a, b) for a, b in zip(then, now, strict=True)]
        return now if all(map(operator.is_, out, now)) else type(now)(out)
    return now
