"""Pieces of ``step_guard`` (the guard for loops that call ``optimizer.step()`` themselves):
the step's micro-batches and their replay (``MicroBatch``, ``locate_step``), clipping with a
norm taken already, the GradScaler's stage, and the step of an optimizer that takes a closure
(``closure_step``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch.locate_state import kept_state


def clip_with_norm(
    grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, host_norm: float | None = None
) -> None:
    """``grads *= min(1, max_norm / (total + 1e-6))`` in place: ``clip_grad_norm_`` with the
    norm ``total`` taken already, computed as torch does (on ``total``'s device and dtype).
    ``host_norm``: ``total`` as the guard read it with its decision (no new read); where it is
    surely below ``max_norm`` the factor is exactly 1, whose multiply (torch makes it) would
    change no bit: no pass over the gradients then. One ``torch._foreach_mul_`` per device."""
    if host_norm is not None and (host_norm + 1e-6) * (1.0 + 2.0**-20) < max_norm:
        return
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        torch._foreach_mul_(group, factor.to(device))


def _still_scaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler`` (torch's GradScaler or numstab's) has not unscaled ``optimizer``'s
    gradients since its last update: the ``Trainer``'s own grad-norm read unscales them
    (accelerate's ``clip_grad_norm_``), a plain loop may not have."""
    states = getattr(scaler, "_per_optimizer_states", None)  # torch.amp.GradScaler
    if states is None:
        states = getattr(scaler, "_opt_states", {})  # numstab's GradScaler
    state = states.get(id(optimizer))
    stage = state.get("stage") if isinstance(state, dict) else getattr(state, "stage", None)
    return stage is None or stage.name == "READY"


def _scaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether an enabled ``scaler`` still holds ``optimizer``'s gradients scaled."""
    return scaler is not None and scaler.is_enabled() and _still_scaled(scaler, optimizer)


class _Replay(torch.nn.Module):
    """``forward(*batch)`` (the last batch's forward, or Lightning's ``training_step``, as
    the loop called it) as a module with the model's own layer names: it shares the model's
    sub-modules (``_modules``)."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self._modules = model._modules
        self._forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)


@dataclasses.dataclass
class MicroBatch:
    """One training forward since the last optimizer step, kept for ``locate_nonfinite``:
    ``replay`` (a partial: the model's forward, or Lightning's ``training_step``, with the
    batch as the loop passed it: references, no copy) and the losses recorded for it
    (detached 0-d tensors, read on the host only on a non-finite step)."""

    replay: functools.partial
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def loss_finite(self) -> bool:
        """False where a recorded loss is NaN or inf (one host read per loss)."""
        return all(bool(torch.isfinite(x).all()) for x in self.losses)


def locate_step(model: torch.nn.Module, batches: list[MicroBatch]) -> tuple[Any, int]:
    """``locate_nonfinite`` on the step's micro-batches, those whose recorded loss is
    non-finite first (each group in the loop's order), until one reports a non-finite layer.
    Returns ``(report, replayed)``: the report that found one, else the last (clean) one, and
    how many micro-batches were replayed. Each replay runs with the RNG forked and the buffers
    put back (``kept_state``); an exception (a compiled module) is the caller's."""
    from numstab.locate import locate_nonfinite

    order = sorted(batches, key=MicroBatch.loss_finite)  # stable: non-finite ones first
    report, replayed = None, 0
    for batch in order:
        replay = batch.replay  # the batch goes in as the model's arguments, so locate sees
        # them (a NaN input is the input's, not the model's own code's)
        with kept_state(model):
            report = locate_nonfinite(
                _Replay(model, replay.func), *replay.args, loss_fn=_loss_of, **replay.keywords
            )
        replayed += 1
        if report.found:
            break
    return report, replayed


def output_loss(output: Any) -> Any:
    """``output.loss`` (a Hugging Face ``ModelOutput``) or ``output["loss"]``; None without."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss


def _loss_of(output: Any) -> torch.Tensor:
    loss = output_loss(output)
    if loss is None:
        loss = output if isinstance(output, torch.Tensor) else None
    if loss is None:
        raise ValueError("the model's output holds no loss")
    return loss.float().sum()


def closure_step(
    real_step: Callable[..., Any], first: Any, closure: Callable[[], Any], kwargs: dict
) -> Callable[[], Any]:
    """``real_step(closure=c, **kwargs)``, where ``c`` returns ``first`` (what the guarded step's
    own call of ``closure`` returned: the loss and gradients the guard decided on) at its first
    call and calls ``closure`` again at later ones: an optimizer that evaluates it several times
    a step (LBFGS: ``max_iter`` evaluations at most) gets them, and none is made twice."""
    calls = 0

    def again() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return first
        with torch.enable_grad():
            return closure()

    return lambda: real_step(closure=again, **kwargs)


def scaler_overflowed(optimizer: Any) -> bool:
    """Whether the GradScaler stepping ``optimizer`` found its gradients non-finite: for an
    optimizer that unscales inside its step (fused Adam/AdamW/SGD, ``_step_supports_amp_scaling``)
    torch's and numstab's ``GradScaler.step`` set ``optimizer.found_inf`` and call its step
    whatever it holds (the kernel skips itself); unset otherwise. One host read where set."""
    found = getattr(optimizer, "found_inf", None)
    return isinstance(found, torch.Tensor) and bool(found.item())


def scale_of(scaler: Any) -> Any:
    """The scale the loss was multiplied by: a tensor where the scaler keeps one (no host
    read: torch's ``GradScaler``, numstab's), else ``get_scale()``; 1 without a scaler."""
    if scaler is None or not scaler.is_enabled():
        return 1.0
    scale = getattr(scaler, "_scale", None)  # torch.amp.GradScaler
    if scale is None:
        scale = getattr(getattr(scaler, "_state", None), "scale", None)  # numstab's
    return scale if isinstance(scale, torch.Tensor) else scaler.get_scale()


def skip_message(events: list[dict], loop_step: Callable[[], int] | None) -> str:
    """The skip warning: the step's own reasons (its last skip event: after a rollback the last
    event is the rollback's) and the guard's own 0-based step count; with ``loop_step`` (a
    callback's: the loop's ``global_step`` of the step, the value its logs show for it) that
    number first."""
    event = next((e for e in reversed(events) if e["event"] == "skip"), {})
    reasons = ", ".join(event.get("reasons", []))
    if loop_step is None:
        return f"numstab: skipped step {event.get('step')} ({reasons})"
    return (
        f"numstab: skipped global_step {loop_step()} ({reasons}; the guard's step "
        f"{event.get('step')})"
    )


def check_loop_clipping(
    max_norm: float | None, loop_norm: float | None, setting: str, off: str
) -> None:
    """Refuse a callback's ``max_norm`` where the loop clips too (``loop_norm`` > 0, set as
    ``setting``; ``off`` switches it off): clipped twice, the second time with the norm
    before the first, or the guard deciding on clipped gradients (the ``Trainer``)."""
    if max_norm is None or not (loop_norm or 0) > 0:
        return
    raise InvalidArgumentError(
        f"Expected {off} with NumstabCallback(max_grad_norm={max_norm}): the callback "
        f"clips the gradients itself after the guard decided, and the loop clips them "
        f"too, so they would be clipped twice (or the guard would decide on clipped "
        f"gradients). Keep {off} (the callback clips to {max_norm} itself), or drop the "
        f"callback's max_grad_norm to keep the loop's clipping. Received: "
        f"{setting}={loop_norm}"
    )


def clipping_step(
    torch_guard: Any, real_step: Callable[[], Any], scaler: Any, max_norm: float | None
) -> Callable[[], Any]:
    """``real_step`` preceded by clipping to ``max_norm`` (None: ``real_step`` itself), with
    the norm the guard is about to decide on: measured here once (``step_grad_norm``; kept if
    the loop measured already), on gradients unscaled first where a GradScaler still holds
    them scaled."""
    if max_norm is None:
        return real_step
    if _scaled(scaler, torch_guard.optimizer):
        scaler.unscale_(torch_guard.optimizer)
    total = torch_guard.step_grad_norm()

    def clipped_step() -> Any:
        if total is not None:
            clip_with_norm(torch_guard.grads(), max_norm, total, torch_guard.step_norm)
        return real_step()

    return clipped_step
