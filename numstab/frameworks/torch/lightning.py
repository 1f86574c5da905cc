"""The training guard as a ``lightning.pytorch.Callback``.

    trainer = lightning.Trainer(callbacks=[NumstabCallback()], precision="bf16-mixed")

The Hugging Face callback's behaviour (``numstab.integrations.transformers``), from one
implementation (``numstab.frameworks.torch.step_guard``), except for the LR schedule (a
skipped step still steps Lightning's ``interval="step"`` schedulers, below): a step whose
loss or gradients are non-finite, or that spikes, does not reach the weights or the
optimizer's state; the run goes on; the first non-finite step is located
(``locate_nonfinite`` replays the ``training_step`` of that step's batches, every
micro-batch under ``accumulate_grad_batches``, until one names a layer); rollbacks as
``TrainingGuard`` says. The skip warning names Lightning's ``global_step`` of the step (as
logged after it). Logged with ``self.log`` every step: ``numstab/grad_norm``,
``numstab/skipped_steps``, and ``numstab/loss_scale`` under "16-mixed".

- The loss is the one Lightning hands to ``on_before_backward``, divided by the GradScaler's
  scale ("16-mixed") and, under automatic optimization, times ``accumulate_grad_batches``
  (Lightning divides it by that number): the mean micro-batch loss of the step, whatever
  the accumulation and the scale; the optimizer's ``step`` is wrapped, so automatic and
  manual optimization both work.
- The gradients are measured in ``on_before_optimizer_step``, before Lightning clips them
  (``gradient_clip_val``), and after the GradScaler unscales them under "16-mixed": the
  gradient-norm rules and ``numstab/grad_norm`` see the norm the backward pass made.
- ``max_grad_norm=M``: the guarded step clips the gradients to ``M`` after the guard decided,
  with the norm measured before (``StepGuard``). Lightning's own clipping
  (``gradient_clip_val`` > 0) runs between the two: with both, the gradients were clipped
  twice (the second time by ``M / norm`` with the unclipped norm: weights that barely moved,
  no error). Both together now raise ``InvalidArgumentError`` when training starts, and so
  does the module's own clipping (``self.clip_gradients`` with a ``gradient_clip_val`` > 0,
  in a manual ``training_step`` or an overridden ``configure_gradient_clipping``) at its
  first call, before it clips.
- "16-mixed": Lightning's GradScaler skips non-finite steps itself (and the guard never sees
  them: the scaler does not call ``step``, or, for a fused optimizer, calls it with
  ``found_inf`` set, which the guarded step reads: one host read); the guard skips the
  spikes. The losses recorded for a step the scaler skipped are dropped (``hold_losses``).
  A fused optimizer (``_step_supports_amp_scaling``) unscales inside its step, so Lightning
  does not unscale first: the norms measured are divided by the scale
  (``TorchGuard.measure_grads``), and ``max_grad_norm`` clips by the unscaled norm.
- A closure optimizer (LBFGS): the guard decides on the first evaluation of Lightning's
  closure (its loss and gradients); a good step's LBFGS gets that evaluation first and
  makes its later ones itself (``StepGuard.wrap``); a skipped step makes none.
  ``max_grad_norm`` with LBFGS raises ``InvalidArgumentError`` when training starts (only
  the first evaluation would be clipped).
- Lightning steps its LR schedulers (``interval="step"``) after every optimizer step it
  asked for, also a skipped one (as after its own GradScaler's skips), where the Hugging
  Face callback leaves the schedule alone on a skipped step.
- Manual optimization: the first non-finite step is located by replaying its
  ``training_step``, which calls ``optimizer.step()`` itself. While it runs, what would
  change the training is switched off: the optimizers' ``step`` (it only calls a closure
  given to it: no decision, no skip count, no progress tracking, so ``global_step`` does not
  move) and ``zero_grad``, ``manual_backward`` (it keeps the loss for ``locate_nonfinite``
  instead), ``clip_gradients``, ``self.log`` / ``log_dict`` and the LR schedulers' ``step``;
  the ``.grad`` fields are put back. What the step changes by other means (its own
  attributes, a logger called directly) it changes once more: ``locate=False`` avoids that.
  Before, the replay's ``step()`` went through the guarded step again, recursively: one NaN
  batch made 32 skips, 10 rollbacks and an LR / 1024.
- Resuming (``fit(ckpt_path=...)``): ``state_dict`` holds the skip count and the guard's
  decision state (``StepGuard.state_dict``), so the resumed run decides as the uninterrupted
  one; its first snapshot is taken afresh.
- One optimizer; DeepSpeed is not supported (its engine steps the optimizer): both raise
  ``InvalidArgumentError`` when training starts.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch.step_guard import GuardedCallback
from numstab.frameworks.torch.step_guard_parts import (
    _scaled,
    scale_of,
    scaler_overflowed,
)


class NumstabCallback(GuardedCallback, pl.Callback):
    """See the module docstring. ``guard``: the :class:`TrainingGuard` settings;
    ``locate``: run ``locate_nonfinite`` on the first non-finite step; ``max_grad_norm``:
    clip the gradients to this norm after the guard decided (a positive finite float; the
    Trainer must then not clip: ``gradient_clip_val`` None or 0), or None."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "deepspeed" in type(trainer.strategy).__name__.lower():
            raise InvalidArgumentError(
                "Expected a Lightning strategy other than DeepSpeed: NumstabCallback skips a "
                "bad step by not calling optimizer.step(), and DeepSpeed's engine steps the "
                f"optimizer itself. Received: strategy={type(trainer.strategy).__name__}"
            )
        if len(trainer.optimizers) != 1:
            raise InvalidArgumentError(
                f"Expected one optimizer in configure_optimizers. Received: "
                f"{len(trainer.optimizers)} optimizers"
            )
        self._check_loop_clipping(
            trainer.gradient_clip_val,
            "trainer.gradient_clip_val",
            "lightning.Trainer(gradient_clip_val=None)",
        )
        if self.step_guard.max_grad_norm is not None:
            self._refuse_module_clipping(pl_module)
        optimizer = trainer.optimizers[0]
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        if self.step_guard.max_grad_norm is not None and isinstance(optimizer, torch.optim.LBFGS):
            raise InvalidArgumentError(
                f"Expected an optimizer that evaluates its closure once with NumstabCallback("
                f"max_grad_norm={self.step_guard.max_grad_norm}): LBFGS evaluates it several "
                f"times a step, and the callback would clip the first evaluation's gradients "
                f"only. Drop max_grad_norm. Received: optimizer {type(optimizer).__name__}"
            )
        self.step_guard.loop_step = lambda: trainer.global_step + 1  # as logged after it
        if self.step_guard.attach(pl_module, optimizer, scheduler, hook_loss=False):
            precision = trainer.precision_plugin
            self.step_guard.wrap(
                optimizer,
                overflowed=lambda: (
                    getattr(precision, "scaler", None) is not None and scaler_overflowed(optimizer)
                ),
            )

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        step = pl_module.training_step
        if not pl_module.automatic_optimization:
            step = _ManualReplay(trainer, pl_module)
        self.step_guard.keep_replay(functools.partial(step, batch, batch_idx))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # the loss as Lightning hands it over: multiplied by the GradScaler's scale
        # ("16-mixed"), and divided by accumulate_grad_batches (its current value, which
        # GradientAccumulationScheduler changes) under automatic optimization; manual
        # optimization divides nothing (and allows no accumulate_grad_batches)
        loss = loss.detach() / scale_of(getattr(trainer.precision_plugin, "scaler", None))
        if pl_module.automatic_optimization:
            loss = loss * trainer.accumulate_grad_batches
        self.step_guard.record_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # before Lightning clips (gradient_clip_val): the guard decides on the gradients
        # the backward pass made, not on clipped ones whose norm is never above the threshold;
        # after the backward pass: the losses recorded are this step's (hold_losses)
        sg = self.step_guard
        if not sg._locating:
            sg.hold_losses()
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            sg.torch_guard.measure_grads(scale_of(scaler) if _scaled(scaler, optimizer) else None)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int):
        sg = self.step_guard
        pl_module.log("numstab/skipped_steps", float(sg.skipped), on_step=True)
        if sg.grad_norm is not None:
            pl_module.log("numstab/grad_norm", sg.grad_norm, on_step=True)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            pl_module.log("numstab/loss_scale", float(scaler.get_scale()), on_step=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _drop_module_clipping_check(pl_module)
        self.step_guard.torch_guard.flush()

    def on_exception(self, trainer, pl_module: pl.LightningModule, exception: BaseException):
        _drop_module_clipping_check(pl_module)

    def _refuse_module_clipping(self, pl_module: pl.LightningModule) -> None:
        """With ``max_grad_norm``: the module's own clipping (``self.clip_gradients`` with a
        ``gradient_clip_val`` > 0, in a manual ``training_step`` or an overridden
        ``configure_gradient_clipping``) raises at its first call, before it clips, as the
        Trainer's ``gradient_clip_val`` does at the start (an instance attribute, until
        training ends)."""
        own = type(pl_module).clip_gradients.__get__(pl_module)

        def clip_gradients(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self._check_loop_clipping(
                gradient_clip_val if isinstance(gradient_clip_val, (int, float)) else None,
                "LightningModule.clip_gradients(gradient_clip_val)",
                "no clipping in the LightningModule (clip_gradients with gradient_clip_val > 0)",
            )
            return own(optimizer, gradient_clip_val, gradient_clip_algorithm)

        clip_gradients.numstab_check = True  # type: ignore[attr-defined]
        pl_module.clip_gradients = clip_gradients  # type: ignore[method-assign]


class _ManualReplay:
    """``training_step`` of a manually optimized module, for ``locate_nonfinite``: run with
    the module's and optimizers' training-state changes switched off (``_switched_off``).
    Returns the step's output where it holds a loss, else the sum of the losses given to
    ``manual_backward`` (the output where there were none: locate then reports no loss)."""

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        losses: list[torch.Tensor] = []
        grads = [(p, p.grad) for p in self.module.parameters()]
        try:
            with _replaced(_switched_off(self.trainer, self.module, losses)):
                out = self.module.training_step(*args, **kwargs)
        finally:
            for p, grad in grads:
                p.grad = grad
        if isinstance(out, torch.Tensor) or (isinstance(out, dict) and "loss" in out):
            return out
        return torch.stack([x.float().sum() for x in losses]).sum() if losses else out


def _switched_off(trainer: pl.Trainer, module: pl.LightningModule, losses: list) -> list:
    """``(object, attribute, replacement)`` for what a replayed manual ``training_step``
    would change: the optimizers' ``step`` (the closure only: the LightningOptimizer's step
    counts toward ``global_step``) and ``zero_grad``, ``manual_backward`` (the loss goes to
    ``losses``), ``clip_gradients``, ``log``, ``log_dict`` and the LR schedulers' ``step``."""
    optimizers = module.optimizers()
    optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
    out: list[tuple[Any, str, Callable[..., Any]]] = []
    for opt in [*optimizers, *trainer.optimizers]:
        out += [(opt, "step", _closure_only), (opt, "zero_grad", _nothing)]
    out += [(module, "manual_backward", lambda loss, *a, **k: losses.append(loss))]
    out += [(module, name, _nothing) for name in ("clip_gradients", "log", "log_dict")]
    out += [(c.scheduler, "step", _nothing) for c in trainer.lr_scheduler_configs]
    return out


def _closure_only(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


_MISSING = object()


@contextlib.contextmanager
def _replaced(patches: list[tuple[Any, str, Any]]) -> Any:
    """Instance attributes set for the block, then put back (or deleted where the class's
    own was in use)."""
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def _drop_module_clipping_check(module: pl.LightningModule) -> None:
    if getattr(vars(module).get("clip_gradients"), "numstab_check", False):
        del module.clip_gradients
