"""The training guard for torch loops that call ``optimizer.step()`` themselves: the Hugging
Face ``Trainer`` and Lightning. One implementation; their callbacks only say when to call it.

``StepGuard.wrap(optimizer)`` replaces ``optimizer.step`` by a guarded step: the guard
(``TrainingGuard.for_torch``) decides from the step's loss and the ``.grad`` of the model's
parameters, and the real step runs only when the step is good. A skipped step does not reach
the weights, nor the optimizer's state (moments, step count, weight decay): zeroing the
gradients instead would still move AdamW's weights. Rollbacks and spike skips work as in a
plain torch loop (docs/semantics.md §16).

The loss comes from ``record_loss`` (Lightning's ``on_before_backward``) or, for models that
return it (``output.loss``, as Hugging Face models do when given labels), from a forward hook.
With gradient accumulation the step's loss is the mean of its micro-batches' losses, or their
sum where each is already its part of the step's loss: a forward given ``num_items_in_batch``
(transformers divides each micro-batch's summed loss by the step's item count then, and logs
the sum). A step without any loss (the ``Trainer`` pops ``labels`` for
``label_smoothing_factor`` or ``compute_loss_func``) is decided on the gradients alone
(``TorchGuard.step_without_loss``; warned once). Before, a loss of 0 went into the loss window.

fp16 with a ``torch.amp.GradScaler``: non-finite gradients are the scaler's to handle (it
skips the step and lowers the scale), so the real step still runs and the guard only records
the skip, without counting it toward a rollback; a finite step the guard skips (a spike) ends
the scaler's iteration with its scale unchanged (``scaler.update(new_scale=scale)``).

``max_grad_norm=M``: the guarded step clips, after the guard decided on the gradients as the
backward pass made them: for a good step the checked gradients are multiplied by
``min(1, M / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s formula, on the device,
no host read) with the norm the guard decided on (``TorchGuard.measure_grads``, taken once),
then the real step runs. For loops that clip before any callback runs (the ``Trainer``),
which must then not clip themselves. Gradients
still scaled by an enabled GradScaler are unscaled first (``unscale_``). Refused for DTensor
parameters (FSDP2, tensor parallel): the norm there is not the one to clip with here.

On a non-finite step, ``locate_nonfinite`` replays the step's micro-batches (``locate_step``:
every training forward since the last optimizer step, as the loop called it), until one names
a layer: that report is ``first_nonfinite_report`` (logged), and later steps are not located.
Where none does, "not reproduced" is logged and the next non-finite step is tried (3 at most).
Where locating fails (a compiled module), that is logged once and not tried again. The replay
leaves the training state alone: while it runs, the guarded step only calls its closure
(no decision, count, step or second locate), a recorded loss is dropped, the RNG states are
forked and the model's buffers (BatchNorm statistics) put back afterwards.

Resuming (``state_dict`` / ``load_state_dict``): the skipped count and the guard's decision
state (``GuardRunner.resume_state``: spike windows, rollback window, counters), as plain
Python numbers and lists; the snapshots are not saved, a resumed run's first one is taken
afresh of the resumed model and optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from numstab import _validate as v
from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch.backend import is_dtensor
from numstab.frameworks.torch.step_guard_parts import (
    MicroBatch,
    _scaled,
    check_loop_clipping,
    clip_with_norm,
    clipping_step,
    closure_step,
    locate_step,
    output_loss,
    scale_of,
    skip_message,
)
from numstab.guard.guard import TrainingGuard
from numstab.guard.runner import resume_from_plain

__all__ = ["GuardedCallback", "StepGuard", "clip_with_norm"]

log = logging.getLogger("numstab")


class StepGuard:
    """A :class:`TrainingGuard` wrapped around an optimizer that someone else steps."""

    def __init__(
        self,
        guard: TrainingGuard | None = None,
        *,
        locate: bool = True,
        max_grad_norm: float | None = None,
    ) -> None:
        if guard is not None and not isinstance(guard, TrainingGuard):
            raise InvalidArgumentError(
                f"Expected guard to be a numstab TrainingGuard or None. Received: guard of "
                f"type {type(guard).__name__}"
            )
        v.check_bool("locate", locate)
        self.guard = guard if guard is not None else TrainingGuard()
        self.locate = locate
        self.max_grad_norm = (  # a positive finite float: 0, inf, NaN, bools, strings raise
            None
            if max_grad_norm is None
            else v.check_number("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
        )
        self.torch_guard: Any = None
        self.model: torch.nn.Module | None = None
        self.skipped = 0
        self.first_nonfinite_report: Any = None
        self.messages: list[str] = []
        self._losses: list[torch.Tensor] = []
        self._held: list[torch.Tensor] = []  # the coming step's losses (hold_losses)
        self._parts = False  # the recorded losses are parts of the step's loss: summed
        self.part_scale = 1  # a part's factor (the Trainer's across ranks: its process count)
        self._batches: list[MicroBatch] = []  # the step's training forwards, for locate
        self._held_batches: list[MicroBatch] = []  # those of the held losses
        self.loop_step: Callable[[], int] | None = None  # the loop's global_step (messages)
        self._hooks: list[Any] = []
        self._resume: tuple[dict, Any, dict] | None = None  # loaded, for the next attach

    # -- wiring --------------------------------------------------------------------------------
    def attach(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        hook_loss: bool = True,
    ) -> bool:
        """Bind the guard to ``model``/``optimizer`` (the raw torch optimizer); False when it
        is bound to them already (a second ``train()`` of one Trainer). Another pair (the
        callback given to a second Trainer, or a second ``fit()``, for which Lightning makes
        a new optimizer) replaces the first: its hooks and step wrapper are removed and a new
        torch guard starts, since windows and snapshots belong to one model and optimizer.
        Before, the guard went on reading the first model's gradients: no step was skipped.
        The new run's first non-finite step is located afresh (``first_nonfinite_report``
        and a failed locate are the first run's: before, the first run's report stayed, was
        logged into every later run's entries, and the later runs were never located)."""
        if self.torch_guard is not None:
            if self.model is model and self.torch_guard.optimizer is optimizer:
                self._apply_resume()
                return False
            self.detach()
        if self.max_grad_norm is not None and any(map(is_dtensor, model.parameters())):
            raise InvalidArgumentError(
                "Expected plain tensor parameters with max_grad_norm: the guard's norm of "
                "DTensor gradients (FSDP2, tensor parallel) is not the one to clip them with "
                "here; leave max_grad_norm=None and let the loop clip. Received: a DTensor "
                "parameter"
            )
        self.model = model
        self.first_nonfinite_report, self._locate_failed, self.replay = None, False, None
        self._unreproduced, self._warned_no_loss = 0, False
        # these loops branch on every step's outcome (the Trainer's overflow flag, the
        # GradScaler): the decision is read each step, whatever host_every says
        guard = dataclasses.replace(self.guard, host_every=1)
        self.torch_guard = guard.for_torch(model, optimizer, scheduler=scheduler)
        if hook_loss:
            self._hooks.append(model.register_forward_pre_hook(self._keep_batch, with_kwargs=True))
            self._hooks.append(
                model.register_forward_hook(self._loss_from_output, with_kwargs=True)
            )
        self._apply_resume()
        return True

    # -- resuming --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``skipped`` and the guard's decision state (``GuardRunner.resume_state``): Python
        numbers, bools and lists only. ``guard`` is None before training started (unless a
        state was loaded: that one)."""
        tg = self.torch_guard
        guard = tg.runner.resume_state(tg.state) if tg is not None else None
        if guard is None and self._resume is not None:
            guard = self._resume[0]
        return {"skipped": self.skipped, "guard": guard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: checked now (``InvalidArgumentError`` for a state of
        a guard with other settings, or no such dict), applied when training starts
        (``attach``: the loops load it before). The snapshots start afresh from the model
        and optimizer as they are then; ``first_nonfinite_report`` is not restored."""
        if not isinstance(state, dict) or not {"skipped", "guard"} <= state.keys():
            raise InvalidArgumentError(
                "Expected a numstab callback's state_dict (skipped, guard). Received: "
                f"{state!r:.80}"
            )
        skipped = v.check_int("skipped", state["skipped"])
        if skipped < 0:  # a count
            raise InvalidArgumentError(f"Expected skipped >= 0. Received: skipped={skipped}")
        self.skipped = skipped
        saved = state["guard"]
        if saved is not None:
            from numstab.backends import load_backend

            self._resume = (saved, *resume_from_plain(self.guard, load_backend("numpy"), saved))

    def _apply_resume(self) -> None:
        """The loaded state, if any, into the torch guard just bound."""
        tg = self.torch_guard
        if tg is None or self._resume is None:
            return
        _, state, counters = self._resume
        tg.runner.resume(state, counters)
        tg.state = state
        self._resume = None

    def wrap(
        self,
        optimizer: Any,
        scaler: Callable[[], Any] = lambda: None,
        on_skip: Callable[[], Any] = lambda: None,
        overflowed: Callable[[], bool] = lambda: False,
    ) -> None:
        """Make ``optimizer.step`` the guarded step (``scaler()``: the GradScaler, if any;
        ``on_skip()`` runs after a skipped step; ``overflowed()``: the loop's GradScaler,
        which calls this step, found the gradients non-finite: its skip, which the guard
        does not see, as where the scaler does not call the step at all).

        A ``closure`` (Lightning's: forward and backward) is called once here, the guard
        decides on that loss and those gradients, and a good step's real ``step`` gets a
        closure returning that result first and calling ``closure`` again after
        (``closure_step``: LBFGS evaluates it several times a step; the losses of those later
        evaluations are not the guard's). Before, the real step got no closure: LBFGS raised
        ``TypeError``."""
        real_step = optimizer.step

        @functools.wraps(real_step)  # keeps torch's LR-scheduler marks on the step method
        def guarded_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            result = None
            if self._locating:  # the replay of a step that calls step() (manual optimization)
                return None if closure is None else closure()
            if closure is not None:  # Lightning: forward and backward run inside step()
                with torch.enable_grad():
                    result = closure()
            if overflowed():
                self.drop_step()
                return real_step(**kwargs)  # the fused kernel skips itself (found_inf)
            step = (
                functools.partial(real_step, **kwargs)
                if closure is None
                else closure_step(real_step, result, closure, kwargs)
            )
            if not self.step(step, scaler()):
                on_skip()
            if closure is not None:
                self.drop_step()  # what later evaluations of the closure recorded
            return result

        optimizer.step = guarded_step
        self._unwrap = lambda: setattr(optimizer, "step", real_step)

    _unwrap: Callable[[], Any] | None = None

    def detach(self) -> None:
        """Remove the hooks and the step wrapper (the guard's results stay readable)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        self._losses.clear()
        self._held = []
        self.replay = None

    @property
    def replay(self) -> functools.partial | None:
        """The replay of the step's last training forward (None before one); setting it keeps
        one more micro-batch of the step (``keep_replay``), None forgets the step's."""
        return self._batches[-1].replay if self._batches else None

    @replay.setter
    def replay(self, value: functools.partial | None) -> None:
        if value is None:
            self._batches, self._held_batches = [], []
        else:
            self.keep_replay(value)

    def keep_replay(self, replay: functools.partial) -> None:
        """A training forward of the coming step (a micro-batch), for ``locate_nonfinite``;
        none while locating."""
        if not self._locating:
            self._batches.append(MicroBatch(replay))

    def record_loss(self, loss: torch.Tensor, *, part: bool = False) -> None:
        """The (micro-batch) loss of the current step; none while locating (a replay).
        ``part``: it is already its share of the step's loss (divided by the whole step's item
        count): the step's loss is then the sum of the recorded ones, else their mean."""
        if not self._locating:
            self._losses.append(loss.detach().float().reshape(()))
            self._parts = part
            if self._batches:  # the micro-batch it is the loss of
                self._batches[-1].losses.append(self._losses[-1])

    def hold_losses(self) -> None:
        """The losses recorded so far are the coming step's (Lightning's
        ``on_before_optimizer_step``, after the backward pass). A step the loop then never
        runs (a GradScaler's skip of non-finite gradients: it does not call ``step``) leaves
        them held, and the next ``hold_losses`` drops them. Before, they stayed recorded: the
        next good step averaged the NaN loss in and was skipped as ``nonfinite_loss``."""
        self._held, self._losses = self._losses, []
        self._held_batches, self._batches = self._batches, []

    def drop_step(self) -> None:
        """Forget what was recorded for a step the guard does not see: the losses, the kept
        micro-batches and the gradient norms measured (``TorchGuard.measure_grads``)."""
        self._held, self._losses = [], []
        self.replay = None
        if self.torch_guard is not None:
            self.torch_guard.forget_measured()

    def _step_loss(self) -> torch.Tensor | None:
        """The recorded losses' sum where they are parts of the step's, else their mean (None
        without any); cleared (the held ones too)."""
        losses, self._losses, self._held = self._held + self._losses, [], []
        reduce = torch.sum if self._parts else torch.mean
        return reduce(torch.stack(losses)) if losses else None

    # -- the step -------------------------------------------------------------------------------
    def step(self, real_step: Callable[[], Any], scaler: Any = None) -> bool:
        """Decide on the step; run ``real_step`` when it is good. Returns whether it ran."""
        loss = self._step_loss()
        batches, self._held_batches, self._batches = self._held_batches + self._batches, [], []
        tg = self.torch_guard
        tg.scaler = scaler  # its overflows (the Trainer's fp16) do not count toward rollbacks
        if self.max_grad_norm is None and not tg.measured and _scaled(scaler, tg.optimizer):
            tg.measure_grads(scale_of(scaler))  # a loop whose real step unscales them
        guarded = clipping_step(tg, real_step, scaler, self.max_grad_norm)
        applied = self._decide(loss, guarded)
        if applied:
            return True
        self.skipped += 1
        _, _, last_loss, norm = tg.history.last  # without a loss, its NaN is no finding
        nonfinite = not math.isfinite(norm) or not (loss is None or math.isfinite(last_loss))
        if scaler is not None and scaler.is_enabled():
            if nonfinite:
                real_step()  # the scaler sees the inf, skips the step and backs off
            else:
                scaler.update(new_scale=scaler.get_scale())  # ends its iteration, scale kept
        self._note(skip_message(tg.events, self.loop_step))  # before locate's messages
        if nonfinite and self.locate and self.first_nonfinite_report is None:
            self._locate(batches)
        return False

    def _decide(self, loss: torch.Tensor | None, step_fn: Callable[[], Any]) -> bool:
        """``TorchGuard.step``; without a loss (None) its ``step_without_loss`` (warned once)."""
        if loss is not None:
            return self.torch_guard.step(loss, step_fn)
        if not self._warned_no_loss:
            self._warned_no_loss = True
            self._note(
                "numstab: no loss found for this step (the model's output holds none: the "
                "Trainer pops labels for label_smoothing_factor or compute_loss_func); the "
                "guard decides on the gradients alone, without its loss rules"
            )
        return self.torch_guard.step_without_loss(step_fn)

    def _note(self, message: str) -> None:
        self.messages.append(message)
        log.warning(message)

    @property
    def grad_norm(self) -> float | None:
        last = self.torch_guard.history.last if self.torch_guard is not None else None
        return None if last is None else last[3]

    # -- hooks ----------------------------------------------------------------------------------
    _locating = False
    _locate_failed = False  # tried once and failed (a compiled module): not tried again

    def _training_call(self, module: Any) -> bool:
        """A forward of the training loop: not an evaluation (no grad or eval mode: the
        Trainer's ``evaluate`` during training) and not locate's replay."""
        return torch.is_grad_enabled() and module.training and not self._locating

    def _keep_batch(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._training_call(module):
            self.keep_replay(functools.partial(module.forward, *args, **kwargs))

    def _loss_from_output(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        """``output.loss`` of a training forward: with ``num_items_in_batch`` (the Trainer's, to
        a model accepting loss kwargs) a part of the step's loss (times ``part_scale``, as the
        Trainer takes it), which the Trainer sums; else a micro-batch mean, which it averages."""
        if not self._training_call(module):
            return  # an evaluation's loss (a NaN of a dirty eval set) is no training step's
        loss = output_loss(output)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            part = kwargs.get("num_items_in_batch") is not None
            self.record_loss(loss.detach() * self.part_scale if part else loss, part=part)

    def _locate(self, batches: list[MicroBatch]) -> None:
        """``locate_step`` on the step's micro-batches; the model is called as the loop
        called it. The report is kept only where it names a layer."""
        if not batches or self._locate_failed or self._unreproduced >= _LOCATE_TRIES:
            return
        self._locating = True  # locating calls the model again: the hooks must not record
        try:
            report, replayed = locate_step(self.model, batches)
        except Exception as exc:  # locating is a diagnosis: it must never end the run
            self._locate_failed = True  # it would fail the same way on every bad step
            self._note(f"numstab: locate_nonfinite failed: {exc!r}")
            return
        finally:
            self._locating = False
        if report.found:
            self.first_nonfinite_report = report
            self._note(f"numstab: first non-finite layer: {report}")
            return
        self._unreproduced += 1
        again = "tried again at the next one" if self._unreproduced < _LOCATE_TRIES else "not again"
        self._note(
            f"numstab: locate_nonfinite: the non-finite step was not reproduced on the step's "
            f"{replayed} micro-batch(es) ({report}); {again}"
        )


_LOCATE_TRIES = 3  # non-finite steps located without a finding before locating stops


class GuardedCallback:
    """What the Trainer and Lightning callbacks share: their ``StepGuard`` and its results."""

    def __init__(
        self,
        guard: TrainingGuard | None = None,
        *,
        locate: bool = True,
        max_grad_norm: float | None = None,
    ) -> None:
        self.step_guard = StepGuard(guard, locate=locate, max_grad_norm=max_grad_norm)

    @property
    def skipped_steps(self) -> int:
        return self.step_guard.skipped

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs (``StepGuard.state_dict``): plain Python values."""
        return self.step_guard.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` (``StepGuard.load_state_dict``)."""
        self.step_guard.load_state_dict(state_dict)

    @property
    def first_nonfinite_report(self) -> Any:
        return self.step_guard.first_nonfinite_report

    def _check_loop_clipping(self, loop_norm: float | None, setting: str, off: str) -> None:
        """``check_loop_clipping`` with the callback's ``max_grad_norm``."""
        check_loop_clipping(self.step_guard.max_grad_norm, loop_norm, setting, off)
