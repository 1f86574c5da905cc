"""The training guard as a Hugging Face ``transformers.TrainerCallback``.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[NumstabCallback()])

With its defaults, a run in fp32, bf16 or fp16 survives a batch that makes the loss or the
gradients non-finite: the optimizer step of that batch is skipped (the weights, the
optimizer's state and the LR schedule do not move), the run goes on, and the first time it
happens ``locate_nonfinite`` names the first layer that went non-finite. Every log entry of
the Trainer gets ``numstab_grad_norm``, ``numstab_skipped_steps`` (and ``numstab_loss_scale``
under fp16), and ``numstab_first_nonfinite`` once a step was non-finite. Spike skipping,
snapshots and rollbacks are those of the ``TrainingGuard`` given (default: OLMo-core's spike
rule, rollback after 3 bad steps of 16, LR x 0.5). How: ``numstab.frameworks.torch.step_guard``.

Not supported (``InvalidArgumentError`` at the start of training): DeepSpeed, whose engine
steps the optimizer itself.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch.step_guard import GuardedCallback
from numstab.guard.guard import TrainingGuard


class NumstabCallback(GuardedCallback, TrainerCallback):
    """See the module docstring. ``guard``: the :class:`TrainingGuard` settings;
    ``locate``: run ``locate_nonfinite`` on the first non-finite step."""

    def __init__(self, guard: TrainingGuard | None = None, *, locate: bool = True) -> None:
        GuardedCallback.__init__(self, guard, locate=locate)
        self._optimizer: Any = None

    def on_train_begin(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs
    ):
        if getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED") == (
            "true"
        ):
            raise InvalidArgumentError(
                "Expected a Trainer without DeepSpeed: NumstabCallback skips a bad step by "
                "not calling optimizer.step(), and DeepSpeed's engine steps the optimizer "
                "itself. Supported: single-process and DDP training in fp32, bf16 and fp16. "
                "Received: args.deepspeed set"
            )
        raw = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if not self.step_guard.attach(model, raw, lr_scheduler):
            return  # a second train() call on the same Trainer
        self.step_guard.wrap(
            optimizer,
            scaler=lambda: getattr(optimizer, "scaler", None),
            on_skip=lambda: _mark_skipped(optimizer),
        )
        self._optimizer = optimizer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        optimizer = self._optimizer
        if getattr(optimizer, "scaler", None) is None and hasattr(optimizer, "_is_overflow"):
            optimizer._is_overflow = False  # accelerate resets it only where a scaler runs

    def on_log(self, args, state, control, logs=None, **kwargs):
        extra = self._numbers()
        if logs is not None:
            logs.update(extra)
        if state.log_history:  # the Trainer's record of this log call, made before on_log
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs):
        self.step_guard.torch_guard.flush()

    def _numbers(self) -> dict[str, Any]:
        sg = self.step_guard
        out: dict[str, Any] = {"numstab_skipped_steps": sg.skipped}
        if sg.grad_norm is not None:
            out["numstab_grad_norm"] = sg.grad_norm
        scaler = getattr(self._optimizer, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            out["numstab_loss_scale"] = float(scaler.get_scale())
        if sg.first_nonfinite_report is not None:
            out["numstab_first_nonfinite"] = str(sg.first_nonfinite_report)
        return out


def _mark_skipped(optimizer: Any) -> None:
    """accelerate's flag for a skipped step: the Trainer then leaves the LR schedule alone."""
    if hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = True
