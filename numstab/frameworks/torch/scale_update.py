"""``LossScaler.update`` for the torch GradScaler through torch's own fused kernel,
``torch._amp_update_scale_``, for the configurations where the two rules agree bit for bit.

The generic update is ~15 small tensor ops; on a GPU each is a kernel launch (the H200 run
measured numstab's ``step`` + ``update`` at 1.22x torch's, all of it host time). The kernel
does torch's rule: on a non-finite step scale * backoff and tracker 0; else tracker + 1,
and at ``growth_interval`` scale * growth where that is finite, and tracker 0. That is
``LossScaler``'s rule when

* ``hysteresis == 1`` (every non-finite step backs off) and ``growth_delay_after_overflow
  == 0`` (the tracker restarts at 0);
* the upper bound is float32's largest value (``grown <= high`` is then "finite");
* both factors are powers of two (the kernel multiplies in double, numstab in float32: the
  same product only when it is exact).

The lower bound (float32's smallest normal, or ``min_scale``) is one more op, a clamp, and
``hysteresis_left`` is kept as the generic rule sets it (0 or 1 here: no update makes more,
and ``LossScaler.from_state_dict`` refuses more than ``hysteresis``). The state's tensors
are copied first: ``GradScaler.state`` is replaced, never mutated.
"""

from __future__ import annotations

import math

import torch

from numstab.loss_scale import FLOAT32_MAX, LossScaler, LossScaleState


def update(scaler: LossScaler, state: LossScaleState, found: torch.Tensor) -> LossScaleState:
    """``scaler.update(state, found == 0)``: by torch's kernel where it gives the same result,
    else by the generic rule."""
    if kernel_applies(scaler):
        return fused_update(scaler, state, found)
    return scaler.update(state, found == 0, backend="torch")


def kernel_applies(scaler: LossScaler) -> bool:
    """Whether ``fused_update`` gives ``scaler.update``'s result exactly."""
    return (
        scaler.dynamic
        and scaler.hysteresis == 1
        and scaler.growth_delay_after_overflow == 0
        and scaler.scale_bounds[1] == FLOAT32_MAX
        and _power_of_two(scaler.growth_factor)
        and _power_of_two(scaler.backoff_factor)
    )


def fused_update(scaler: LossScaler, state: LossScaleState, found: torch.Tensor) -> LossScaleState:
    """``scaler.update(state, found == 0)`` for a ``scaler`` that ``kernel_applies`` to and a
    float ``found`` (> 0: a non-finite step) on the state's device; new tensors."""
    finite = found == 0
    # A tracker at or past ``growth_interval - 1`` grows on a finite step in the generic rule;
    # the kernel grows only at ``tracker + 1 == growth_interval`` (a loaded state or a
    # lowered ``set_growth_interval`` can be past it): clamped, both grow. The clamp is also
    # the copy the in-place kernel needs.
    tracker = state.growth_tracker.clamp(max=scaler.growth_interval - 1)
    if scaler.consecutive_hysteresis:  # refilled by every finite step, emptied by a bad one
        hysteresis = finite.to(torch.int32)
    else:  # refilled by a growth, emptied by a bad step (states hold 0 or 1 here)
        grows = tracker == scaler.growth_interval - 1
        hysteresis = (state.hysteresis_left | grows) & finite  # int32
    scale = state.scale.clone()
    torch._amp_update_scale_(
        scale,
        tracker,
        found.to(torch.float32),
        scaler.growth_factor,
        scaler.backoff_factor,
        scaler.growth_interval,
    )
    scale.clamp_(min=scaler.scale_bounds[0])
    return LossScaleState(scale=scale, growth_tracker=tracker, hysteresis_left=hysteresis)


def _power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return mantissa == 0.5
