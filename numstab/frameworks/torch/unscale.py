"""The GradScaler's gradient checks: validate every gradient, then torch's fused
check-and-unscale once per device and dtype; and the check of a user-given scale."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from numstab import _validate as v
from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch.clipping import grads_by_device_dtype
from numstab.loss_scale import FLOAT32_MAX, FLOAT32_TINY

UNSCALE_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16})
UNSCALE_DTYPES_FP16 = UNSCALE_DTYPES | {torch.float16}


def check_and_unscale(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    home: torch.device,
    allow_fp16: bool,
    dense: dict[tuple, list[torch.Tensor]] | None = None,
) -> torch.Tensor | None:
    """Validate every gradient, then run torch's fused check-and-unscale once per device
    and dtype; one flag on ``home`` (the scale's device), 0.0 or exactly 1.0 (fused
    optimizers test ``found_inf == 1``), or None when no parameter has a gradient (torch
    records no check then: its ``step`` asserts, ``GradScaler.step`` raises). ``dense``:
    the optimizer's gradients already grouped by (device, dtype) and found dense
    (``clipping.dense_grads``), not grouped again."""
    allowed = UNSCALE_DTYPES_FP16 if allow_fp16 else UNSCALE_DTYPES
    groups, sparse = _grouped(optimizer, allowed) if dense is None else (dense, ())
    if dense is not None and not all(dtype in allowed for _, dtype in dense):
        _raise_bad_grad(optimizer, allowed)
    with torch.no_grad():
        for param in sparse:
            # check the coalesced values: duplicates summed may overflow float16
            if param.grad.dtype == torch.float16:
                param.grad = param.grad.coalesce()
            values = param.grad._values()
            groups.setdefault((values.device, values.dtype), []).append(values)
        found_on: dict[torch.device, torch.Tensor] = {}
        inv_on: dict[torch.device, torch.Tensor] = {}
        for (device, _), grads in groups.items():
            if device not in found_on:
                found_on[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv_on[device] = inv_scale.to(device, non_blocking=True)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_on[device], inv_on[device]
            )
        found_total = None
        for found in found_on.values():
            found = found.to(home, non_blocking=True)
            found_total = found if found_total is None else torch.maximum(found_total, found)
    return found_total  # None: no gradient at all, nothing was checked


def settle_sentinels(
    optimizer: torch.optim.Optimizer, found: torch.Tensor | None, scale: torch.Tensor, floor: float
) -> None:
    """Tell active ``check_numerics(mode="sentinel")`` contexts (§14.6) whether this
    optimizer's gradients were found non-finite and its step skipped as a routine overflow:
    handled = ``found != 0 and scale > max(floor, 1)``, as NaN (else 0.0) on ``found``'s
    device, no sync. A scale at 1 or below (or at the floor) does not scale the gradients
    up: what is still non-finite there is no overflow of the scaling, and is reported (a NaN
    of every step, after the ~16 skips that take torch's default 2**16 down to 1; it took
    the 142 down to 2**-126). A no-op when the sentinel module was never imported, no
    context is active, or nothing was checked (``found`` None)."""
    numerics = sys.modules.get("numstab.frameworks.torch.numerics")
    if numerics is None or found is None:
        return
    bound = max(floor, 1.0)

    def handled() -> torch.Tensor:
        return torch.where((found != 0) & (scale.to(found.device) > bound), math.nan, 0.0)

    numerics.settle((p for group in optimizer.param_groups for p in group["params"]), handled)


def no_inf_checks_error(optimizer: torch.optim.Optimizer) -> InvalidArgumentError:
    """``step`` on an optimizer none of whose parameters has a gradient (``backward`` was
    not called since ``scale``): torch's ``GradScaler.step`` asserts "No inf checks were
    recorded for this optimizer."; counting it as a finite step would grow the scale."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return InvalidArgumentError(
        "No inf checks were recorded for this optimizer: expected at least one of "
        "optimizer's parameters to have a gradient (call backward() on the scaled loss "
        f"before step()). Received: optimizer={type(optimizer).__name__} with "
        f"{len(params)} parameters, none with a .grad"
    )


def _grouped(optimizer: torch.optim.Optimizer, allowed: frozenset) -> tuple[dict, list]:
    """(dense gradients by (device, dtype), parameters with a sparse gradient); raises on a
    gradient of a dtype not ``allowed`` before anything changes."""
    sparse: list[torch.Tensor] = []
    params = (p for group in optimizer.param_groups for p in group["params"])
    groups = grads_by_device_dtype(params, sparse)
    dtypes = {dtype for _, dtype in groups} | {p.grad.dtype for p in sparse}
    if not dtypes <= allowed:
        _raise_bad_grad(optimizer, allowed)
    return groups, sparse


def _raise_bad_grad(optimizer: torch.optim.Optimizer, allowed: frozenset) -> None:
    for gi, group in enumerate(optimizer.param_groups):
        for pi, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None or grad.dtype in allowed:
                continue
            where = f"param_groups[{gi}]['params'][{pi}].grad"
            if grad.dtype == torch.float16:
                raise InvalidArgumentError(
                    "Expected float32, float64 or bfloat16 gradients to unscale (keep the "
                    "parameters in float32 and let autocast compute in float16). "
                    f"Received: {where} with dtype=torch.float16"
                )
            raise InvalidArgumentError(
                "Expected floating-point gradients (float32, float64, bfloat16"
                f"{', float16' if torch.float16 in allowed else ''}). Received: {where} with "
                f"dtype={grad.dtype}"
            )


def check_new_scale(new_scale: Any, device: torch.device) -> torch.Tensor:
    """``update(new_scale)``'s argument as a 0-d float32 tensor on ``device``."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise InvalidArgumentError(
                "Expected new_scale to be a positive float or a 1-element floating tensor "
                f"without grad. Received: {new_scale!r}"
            )
        return new_scale.detach().reshape(()).to(device, torch.float32, copy=True)
    # a normal float32, as a scale must be (past float32 torch.full raised its own error;
    # a value under 2**-126 would backoff into subnormals and 0)
    value = v.check_number("new_scale", new_scale, low=FLOAT32_TINY, high=FLOAT32_MAX)
    return torch.full((), value, dtype=torch.float32, device=device)
