"""Pieces of ``step_guard`` (the guard for loops that call ``optimizer.step()`` themselves):
the replay's kept state and module, clipping with a norm taken already, the GradScaler's stage,
and the step of an optimizer that takes a closure (``closure_step``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


@contextlib.contextmanager
def _kept_state(model: torch.nn.Module) -> Any:
    """What a replayed forward changes, put back: the RNG states (CPU, and the CUDA devices
    of the model's parameters: dropout) and the buffers (BatchNorm's running statistics)."""
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


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


def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
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
