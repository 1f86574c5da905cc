"""The GradScaler's configuration from torch-style arguments, and its state dicts: torch's
format (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
``_growth_tracker``) with numstab's full state under ``"numstab"``, and back; a
``torch.amp.GradScaler`` state dict loads too. Also a step's lazily read "applied"
flag."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from numstab.errors import InvalidArgumentError
from numstab.loss_scale import LossScaler


def torch_state_dict(scaler: LossScaler, data: dict[str, Any]) -> dict[str, Any]:
    """torch's fields from ``LossScaler.state_dict``'s ``data``, which rides along."""
    values = data["state"]
    return {
        "scale": float(values["scale"]),
        "growth_factor": scaler.growth_factor,
        "backoff_factor": scaler.backoff_factor,
        "growth_interval": scaler.growth_interval,
        "_growth_tracker": int(values["growth_tracker"]),
        "numstab": data,
    }


def numstab_state_dict(scaler: LossScaler, state_dict: Any) -> dict[str, Any]:
    """``LossScaler.from_state_dict``'s input from a numstab or torch GradScaler state dict;
    torch's lacks hysteresis and the other settings: they keep ``scaler``'s (hysteresis
    restarts full)."""
    if not isinstance(state_dict, Mapping) or len(state_dict) == 0:
        raise InvalidArgumentError(
            "Expected a non-empty GradScaler state dict (an empty one comes from a disabled "
            f"scaler). Received: {state_dict!r}"
        )
    if "numstab" in state_dict:
        return _with_torch_entries(state_dict["numstab"], state_dict)
    try:
        config = dataclasses.asdict(scaler)
        config.update(
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
        )
        values = {
            "scale": state_dict["scale"],
            "growth_tracker": state_dict["_growth_tracker"],
            "hysteresis_left": config["hysteresis"],
        }
    except KeyError as exc:
        raise InvalidArgumentError(f"Not a GradScaler state dict: missing {exc}") from exc
    return {"config": config, "state": values}


def _with_torch_entries(data: Any, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """numstab's full state (``data``) with torch's entries of ``state_dict`` over it: they
    are the ones ``torch.amp.GradScaler`` loads, and a user who edits them (a reset ``scale``,
    another ``growth_interval``) expects both classes to load the edit (before, numstab kept
    its nested copy silently)."""
    if not (isinstance(data, Mapping) and {"config", "state"} <= data.keys()):
        raise InvalidArgumentError(
            "Expected state_dict['numstab'] to be a numstab loss-scaler state dict ('config' "
            f"and 'state', from GradScaler.state_dict). Received: {type(data).__name__}"
            + (f" with keys {sorted(map(str, data))}" if isinstance(data, Mapping) else "")
        )
    config, values = dict(data["config"]), dict(data["state"])
    for key in ("growth_factor", "backoff_factor", "growth_interval"):
        if key in state_dict:
            config[key] = state_dict[key]
    for key, field in (("scale", "scale"), ("_growth_tracker", "growth_tracker")):
        if key in state_dict:
            values[field] = state_dict[key]
    return {"config": config, "state": values}


def loss_scaler_from(scaler: LossScaler | None, settings: dict[str, Any]) -> LossScaler:
    """The GradScaler's ``LossScaler``: ``scaler`` itself, or one built from the individual
    ``settings`` given (None values are unset: ``LossScaler``'s defaults); not both."""
    settings = {k: val for k, val in settings.items() if val is not None}
    if scaler is None:
        return LossScaler(**settings)
    if not isinstance(scaler, LossScaler):
        raise InvalidArgumentError(
            f"Expected scaler to be a numstab.LossScaler. Received: scaler={scaler!r}"
        )
    if settings:
        raise InvalidArgumentError(
            "Expected either scaler= or individual settings, not both. Received: "
            f"scaler={scaler!r} and {', '.join(sorted(settings))}"
        )
    return scaler


class Lazy:
    """A step's "applied" flag read on the host only when converted to bool."""

    __slots__ = ("found",)

    def __init__(self, found: torch.Tensor) -> None:
        self.found = found

    def __bool__(self) -> bool:
        return not bool(self.found.item())
