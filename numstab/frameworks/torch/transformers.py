"""The training guard as a Hugging Face ``transformers.TrainerCallback``.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[NumstabCallback()])

With its defaults, a run in fp32, bf16 or fp16 survives a batch that makes the loss or the
gradients non-finite: the optimizer step of that batch is skipped (the weights, the
optimizer's state and the LR schedule do not move), the run goes on (the warning names the
step's ``global_step`` as the Trainer logs it), and the first time it happens
``locate_nonfinite`` names the first layer that went non-finite (with gradient accumulation
it replays the step's micro-batches until one names a layer). A model whose output holds no
loss (``label_smoothing_factor`` or ``compute_loss_func``: the Trainer pops ``labels``) is
guarded on its gradients alone, without the loss rules (warned once). Every log entry of
the Trainer gets ``numstab_grad_norm``, ``numstab_skipped_steps`` (and ``numstab_loss_scale``
under fp16), and ``numstab_first_nonfinite`` once a step was non-finite. Spike skipping,
snapshots and rollbacks are those of the ``TrainingGuard`` given (default: OLMo-core's spike
rule, rollback after 3 bad steps of 16, LR x 0.5). How: ``numstab.frameworks.torch.step_guard``.

The Trainer clips the gradients (``args.max_grad_norm``, 1.0 by default) before any callback
runs, so by default the guard decides on clipped gradients: when every step is clipped, a
gradient-norm spike is clipped away before the guard sees it. ``max_grad_norm=M`` moves the
clipping into the guarded step, after the guard decided on the unclipped gradients:

    args = TrainingArguments(..., max_grad_norm=0)  # the Trainer must not clip first
    trainer = Trainer(model, args, callbacks=[NumstabCallback(max_grad_norm=1.0)])

A good step's gradients are then scaled by ``min(1, M / (norm + 1e-6))`` (torch's
``clip_grad_norm_``) and ``numstab_grad_norm`` is the norm before clipping.
``args.max_grad_norm > 0`` with it raises, as do FSDP, XLA and Megatron-LM runs and DTensor
parameters, where the norm the guard takes is not the one to clip with (single process and
DDP are supported: DDP's gradients are all-reduced before ``optimizer.step``).

Resuming (``train(resume_from_checkpoint=...)``): the callback is a transformers
``ExportableState``: every checkpoint's ``trainer_state.json`` holds its skip count and the
guard's decision state (``StepGuard.state_dict``, JSON: numbers and lists), and the callback
restores them itself in ``on_train_begin`` of the resumed run, so that it decides as the
uninterrupted run would; its first snapshot is taken afresh. With
``restore_callback_states_from_checkpoint=True`` transformers replaces the callback by a new
``NumstabCallback(locate=..., max_grad_norm=...)``: the default ``TrainingGuard``, so a
checkpoint of another guard raises ``InvalidArgumentError`` there.

Not supported (``InvalidArgumentError`` at the start of training): DeepSpeed, whose engine
steps the optimizer itself.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch.step_guard import GuardedCallback
from numstab.guard.guard import TrainingGuard


class NumstabCallback(GuardedCallback, TrainerCallback, ExportableState):
    """See the module docstring. ``guard``: the :class:`TrainingGuard` settings;
    ``locate``: run ``locate_nonfinite`` on the first non-finite step; ``max_grad_norm``: clip
    the gradients to this norm after the guard decided (a positive finite float; the Trainer
    must then have ``max_grad_norm=0``), or None: the Trainer's own clipping."""

    def __init__(
        self,
        guard: TrainingGuard | None = None,
        *,
        locate: bool = True,
        max_grad_norm: float | None = None,
    ) -> None:
        GuardedCallback.__init__(self, guard, locate=locate, max_grad_norm=max_grad_norm)
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
        self._check_loop_clipping(
            getattr(args, "max_grad_norm", None),
            "args.max_grad_norm",
            "TrainingArguments(max_grad_norm=0)",
        )
        if self.step_guard.max_grad_norm is not None:
            _check_clipping(self.step_guard.max_grad_norm, optimizer)
        self.step_guard.part_scale = _part_scale(args)
        # the skip warning's step: the global_step the Trainer's log of the step shows
        self.step_guard.loop_step = lambda: state.global_step + 1
        self._resume(state)
        raw = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if not self.step_guard.attach(model, raw, lr_scheduler):
            return  # a second train() call on the same Trainer
        self.step_guard.wrap(
            optimizer,
            scaler=lambda: getattr(optimizer, "scaler", None),
            on_skip=lambda: _mark_skipped(optimizer),
        )
        self._optimizer = optimizer

    def state(self) -> dict[str, Any]:
        """transformers' ``ExportableState``: saved in each checkpoint's ``trainer_state.json``
        (``stateful_callbacks``). ``args``: what transformers' own restore passes to a new
        callback (JSON: not the guard); ``attributes``: ``resume_state``, the
        ``state_dict()`` and whether the guard was ``TrainingGuard()``."""
        sg = self.step_guard
        saved = {**self.state_dict(), "default_guard": sg.guard == TrainingGuard()}
        return {
            "args": {"locate": sg.locate, "max_grad_norm": sg.max_grad_norm},
            "attributes": {"resume_state": saved},
        }

    def _resume(self, state: Any) -> None:
        """Load the checkpoint's ``resume_state``: set on a callback that transformers made
        (``restore_callback_states_from_checkpoint``), else found in the resumed
        ``TrainerState`` (a fresh one has ``global_step`` 0)."""
        saved = self.__dict__.pop("resume_state", None)
        if saved is not None and not saved.get("default_guard", True):
            raise InvalidArgumentError(
                "Expected restore_callback_states_from_checkpoint=False with a NumstabCallback "
                "of a TrainingGuard other than the default: transformers replaced the callback "
                "by one with the default guard. The callback restores its own state when the "
                "Trainer resumes. Received: restore_callback_states_from_checkpoint=True"
            )
        if saved is None and state.global_step > 0:
            entry = (state.stateful_callbacks or {}).get(type(self).__name__)
            entry = entry[0] if isinstance(entry, list) and entry else entry
            saved = entry.get("attributes", {}).get("resume_state") if entry else None
        if saved is not None:
            self.load_state_dict({k: saved.get(k) for k in ("skipped", "guard")})

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


_NO_CLIPPING_HERE = ("FSDP", "XLA", "MEGATRON_LM")  # each clips through its own code


def _part_scale(args: Any) -> int:
    """What the Trainer multiplies a loss divided by ``num_items_in_batch`` by: its process
    count where that count is taken over all processes (``average_tokens_across_devices``;
    the mean over the processes is then the step's loss, as the guard's all-reduce takes it),
    else 1. Tensor parallelism (which divides it by the TP size) is not accounted for."""
    if not getattr(args, "average_tokens_across_devices", False):
        return 1
    return max(1, int(getattr(args, "world_size", 1)))


def _check_clipping(max_grad_norm: float, optimizer: Any) -> None:
    """Refuse ``max_grad_norm`` under FSDP / XLA / Megatron-LM (sharded or not yet reduced
    gradients), where the callback's clipping would be wrong (the Trainer's own clipping:
    ``GuardedCallback._check_loop_clipping``). The distributed type: the
    ``AcceleratedOptimizer``'s, else accelerate's state if made."""
    state = getattr(optimizer, "accelerator_state", None)
    if state is None:
        from accelerate.state import AcceleratorState, is_initialized

        state = AcceleratorState() if is_initialized() else None
    kind = getattr(getattr(state, "distributed_type", None), "value", None)
    if kind in _NO_CLIPPING_HERE:
        raise InvalidArgumentError(
            f"Expected single-process or DDP training with NumstabCallback(max_grad_norm="
            f"{max_grad_norm}): under {kind} the gradients are sharded or reduced by its own "
            f"code, and the callback's clipping would use the wrong norm. Use the Trainer's "
            f"max_grad_norm and NumstabCallback() without max_grad_norm. Received: "
            f"distributed type {kind}"
        )
