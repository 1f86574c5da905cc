"""torch's own ``torch.amp.GradScaler`` under ``check_numerics(mode="sentinel")`` (§14.6).

The sentinel records every parameter gradient; under fp16 loss scaling the first steps
overflow as a matter of routine (torch's scale starts at 2**16 and backs off), and the scaler
skips them. numstab's ``GradScaler`` tells the sentinel which steps it skipped
(``unscale.settle_sentinels``); torch's cannot. So while a sentinel context is active,
``torch.amp.GradScaler.step`` (and so ``torch.cuda.amp.GradScaler``'s and any subclass's that
calls it) is wrapped: after it, the optimizer's gradient records are settled with the flag
torch's scaler computed, ``found_inf and scale > 1``, left on the device (no sync). The wrapper
is removed when the last sentinel context exits.

It reads two of torch's private fields, ``_per_optimizer_states[id(optimizer)]
["found_inf_per_device"]`` (set by ``unscale_`` and by the fused optimizers' check, since
torch 1.6) and ``_scale``; where either is missing the step settles nothing, and the
gradients are reported as before.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from numstab.frameworks.torch.unscale import settle_sentinels

_LOCK = threading.Lock()
_WRAPPED: list[tuple[Any, Any]] = []  # (torch's own step, numstab's wrapper) while wrapped


def install() -> None:
    """Wrap ``torch.amp.GradScaler.step`` (once; a no-op while wrapped)."""
    with _LOCK:
        if _WRAPPED:
            return
        original = torch.amp.GradScaler.step
        while getattr(original, "_numstab_settles", False):  # one left by another patch
            original = original.__wrapped__

        @functools.wraps(original)
        def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, optimizer, *args, **kwargs)
            if _WRAPPED:  # a wrapper left in place by another patch does nothing more
                settle_native(self, optimizer)
            return result

        step._numstab_settles = True  # type: ignore[attr-defined]
        _WRAPPED.append((original, step))
        torch.amp.GradScaler.step = step


def uninstall() -> None:
    """Put torch's ``GradScaler.step`` back, unless something else (a ``mock.patch`` begun
    inside the context) replaced numstab's wrapper since: then that stays, to restore what
    it saved (numstab's wrapper, which settles nothing once no sentinel is active)."""
    with _LOCK:
        if not _WRAPPED:
            return
        original, step = _WRAPPED.pop()
        if torch.amp.GradScaler.step is step:
            torch.amp.GradScaler.step = original


def settle_native(scaler: Any, optimizer: Any) -> None:
    """Settle ``optimizer``'s gradient records with ``scaler``'s verdict on its last step:
    the per-device found-inf flags summed on the scale's device; a scale at 1 or below scales
    nothing up, so a non-finite gradient there is reported (torch's scaler has no floor)."""
    scale = getattr(scaler, "_scale", None)
    states = getattr(scaler, "_per_optimizer_states", None)
    if not scaler.is_enabled() or not isinstance(scale, torch.Tensor) or states is None:
        return
    per_device = (states.get(id(optimizer)) or {}).get("found_inf_per_device")
    if not per_device:
        return
    found = sum(t.to(scale.device, non_blocking=True) for t in per_device.values())
    settle_sentinels(optimizer, found, scale, 0.0)
