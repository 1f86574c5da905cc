"""The torch guard's steady step on the device (``TrainingGuard(host_every=k)``, k > 1).

:class:`DeviceSteps` runs ``numstab.guard.policy.decide`` on the device every step, compiled
(``guard_compiled.DevicePolicy``), with no host read; each step's decision is written to a
``[k, 8]`` ring that the host reads every k steps (``numstab.guard.deferred``).

:class:`Skipper` then makes a bad step not happen, without knowing on the host that it is bad:

* optimizers that step with ``found_inf`` (``_step_supports_amp_scaling``: ``fused=True`` Adam,
  AdamW, SGD, Adagrad), as ``torch.amp.GradScaler`` does: the fused kernel skips the update
  and the step count when ``found_inf`` is 1. Costs torch's ``_foreach_sub_`` of the step
  counts (part of any ``found_inf`` step).
* any other optimizer (or a ``step_fn``): the parameters the step can change (trainable now,
  or holding a gradient: the TorchGuard reads which every step, so a layer unfrozen later is
  in it) and every tensor of the optimizer's state are copied before the step (one
  ``_foreach_copy_``) and put back after it where the step is bad (``torch.where``, compiled
  into one call, bound once to the tensors while the optimizer updates the same ones in
  place: ``guard_compiled.undo_plan``): the step runs, then is undone on the device. Costs
  two passes over the parameters and the optimizer state per step. State tensors on another
  device than the flag (Adam's CPU step counters beside CUDA parameters without
  ``capturable=True``) are restored with one copy of the flag per device and step: one sync
  per step, with a warning, once, naming the cure; a step that adds or replaces non-tensor
  state, or creates the state (the first step), reads the flag on the host once.

The model's buffers (BatchNorm's statistics), changed by the forward pass before the step,
are then kept or put back on the same flag (``guard_buffers.ModelBuffers.settle``).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from numstab.frameworks.torch.guard_compiled import DevicePolicy, undo_plan
from numstab.guard.deferred import decisions_from_rows

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard
    from numstab.guard.policy import GuardState


class DeviceSteps:
    """The device mode of a ``TorchGuard``: decide, skip, keep rows; read every k steps."""

    def __init__(self, owner: Any, guard: TrainingGuard, device: torch.device) -> None:
        self.owner = owner  # the TorchGuard: its runner and its guard state
        self.guard = guard
        self.decider = DevicePolicy(guard, device, guard.host_every, owner.loss_scaled())
        self.skipper = Skipper(owner.optimizer, owner._params)
        self.norms: list[Any] = []
        self.pending = 0  # rows written and not read
        self.steps = 0  # steps seen

    def step(
        self,
        x: torch.Tensor,
        norms: Any,
        step_fn: Callable[[], Any] | None,
        has_loss: bool = True,
    ) -> LazyApplied:
        """The step from its float32 ``[loss, global norm]`` and per-leaf norms; without a
        loss (``has_loss=False``) ``x[0]`` is not read."""
        apply, found_inf = self.decider.decide(x.float(), has_loss)
        return self._finish(apply, found_inf, norms, step_fn)

    def step_from_grads(
        self, loss: torch.Tensor, grads: list[torch.Tensor], step_fn: Callable[[], Any] | None
    ) -> LazyApplied:
        """The step from the loss (one element) and the gradients (one device, float32 or
        narrower): ``torch._foreach_norm`` (as ``layer_norms``), then one compiled call for
        the global norm and the decision."""
        with torch.no_grad():
            leaf = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            apply, found_inf, norms = self.decider.decide_norms(loss.detach(), leaf)
        return self._finish(apply, found_inf, norms, step_fn)

    def _finish(
        self, apply: torch.Tensor, found_inf: torch.Tensor, norms: Any, step_fn: Any
    ) -> LazyApplied:
        try:
            read_now = self.skipper.run(apply, found_inf, step_fn)
            self.owner._buffers.settle(apply)  # the model's buffers kept or put back
        finally:  # a step_fn that raised: the device state has counted the step, so do we
            self.norms.append(self.owner.layer_row(norms) if self.guard.track_layers else None)
            self.pending += 1
            self.steps += 1
        if read_now or self.pending >= self.guard.host_every:
            self.read()
        return LazyApplied(apply)

    def read(self) -> None:
        """One host read of the pending rows, then the runner acts on them."""
        if not self.pending:
            return
        first = self.steps - self.pending
        ds = decisions_from_rows(self.decider.read_rows(first, self.pending), first)
        layers = self.norms if self.guard.track_layers else None
        self.pending, self.norms = 0, []
        runner = self.owner.runner
        new = runner.after_steps(ds, layers, self.owner._torch, self.state, self.steps)
        if new is not None:
            self.reset(new, self.steps)

    def state(self) -> GuardState:
        """The guard state now, as NumPy (reads the windows: at events only)."""
        return self.decider.state()

    def reset(self, state: GuardState, steps: int) -> None:
        """After a rollback or a load: the device state becomes ``state`` at step ``steps``."""
        self.pending, self.norms = 0, []
        self.decider.load(state, steps)
        self.steps = steps


class LazyApplied:
    """Whether a device-mode step was applied; ``bool()`` reads it (one host sync)."""

    __slots__ = ("flag",)

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag = flag

    def __bool__(self) -> bool:
        return bool(self.flag.item())

    def __repr__(self) -> str:
        return f"LazyApplied({self.flag!r})"


class Skipper:
    """Runs the optimizer step so that it has no effect where ``apply`` is false."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params  # those the step can change (the TorchGuard's ``use``s them)
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._backup: list[torch.Tensor] = []
        self._backed_up: list[torch.Tensor] = []  # the tensors the buffers were made for
        self._plan: Callable[[torch.Tensor], None] | None = None  # the undo of _backed_up
        # after the last step the plan undid: the state's layout and its entries then
        self._layout_then: list[Any] = []
        self._entries_then: tuple[list, list] = ([], [])

    def run(
        self, apply: torch.Tensor, found_inf: torch.Tensor, step_fn: Callable[[], Any] | None
    ) -> bool:
        """Step (``found_inf``: float ``1 - apply``); True when the guard needs ``apply``
        read on the host this once."""
        if self.fused and step_fn is None:
            opt = self.optimizer
            opt.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                opt.step()
            finally:
                del opt.found_inf  # type: ignore[attr-defined]
            return False
        return self._undo_step(apply, step_fn or self.optimizer.step)

    @torch.no_grad()
    def _undo_step(self, apply: torch.Tensor, step_fn: Callable[[], Any]) -> bool:
        layout = self._layout()
        if self._plan is not None and identical(layout, self._layout_then):
            # the state holds what it held after the last step: its entries, backed up by
            # the buffers the plan is bound to (one identity check, not a walk of the state)
            (entries, others), tensors = self._entries_then, self._backed_up
        else:
            entries, others = self._state_entries()
            tensors = self.params + [t for _, _, t in entries]
            if not identical(self._backed_up, tensors):
                self._backup = [torch.empty_like(t) for t in tensors]  # new tensors: new buffers
                self._backed_up, self._plan = tensors, None
        if tensors:
            torch._foreach_copy_(self._backup, tensors)
        step_fn()
        after = self._layout()
        if self._plan is not None and identical(after, layout):
            self._plan(apply)  # the usual step (Adam's): every state tensor updated in place
            self._layout_then, self._entries_then = after, (entries, others)
            return False
        new_entries, new_others = self._state_entries()
        same = len(new_entries) == len(entries) and new_others == others
        same = same and all(
            a[0] is b[0] and a[1] == b[1] for a, b in zip(entries, new_entries, strict=True)
        )
        if not same:  # the step made or changed state the backup does not hold
            if not bool(apply):
                self._restore_exactly(entries, others, tensors)
            return True
        new_tensors = [t for _, _, t in new_entries]
        if self._plan is not None and identical(tensors[len(self.params) :], new_tensors):
            self._plan(apply)  # the same tensors, updated in place (other values changed)
            self._layout_then, self._entries_then = after, (new_entries, new_others)
            return False
        self._plan = self._undo_replaced(apply, tensors, new_entries)
        self._layout_then, self._entries_then = after, (new_entries, new_others)
        return False

    def use(self, params: list[torch.Tensor]) -> None:
        """Back up ``params`` from the next step on (a layer unfrozen, or frozen): new
        buffers, a new undo."""
        self.params, self._plan, self._layout_then = params, None, []

    def _layout(self) -> list[Any]:
        """Each parameter's state dict (or None), then its keys and values, in order: where
        every one is the same object as before, so are the state's entries."""
        state, out = self.optimizer.state, []
        for p in self.params:
            st = state.get(p)
            out.append(st)
            if st:
                out += st.keys()
                out += st.values()
        return out

    def _undo_replaced(
        self, apply: torch.Tensor, tensors: list[torch.Tensor], new_entries: list
    ) -> Callable[[torch.Tensor], None] | None:
        """The undo where the step may have replaced state tensors: each replaced one
        restored in its place; the undo of the others (none replaced) for the next steps,
        else None."""
        here, backups, simple = [], [], True  # on the flag's device, in place: one call
        elsewhere = []  # (tensor, backup) on other devices: Adam's CPU step counts
        for i, (t, backup) in enumerate(zip(tensors, self._backup, strict=True)):
            entry = new_entries[i - len(self.params)] if i >= len(self.params) else None
            if entry is not None and entry[2] is not t:
                # the optimizer replaced the tensor: put a restored one in its place
                entry[0][entry[1]] = torch.where(_on(apply, entry[2]), entry[2], backup)
                simple = False
            elif t.device == apply.device:
                here.append(t)
                backups.append(backup)
            else:
                elsewhere.append((t, backup))
        if elsewhere and apply.device.type != "cpu":
            _warn_sync_once(elsewhere[0][0].device)
        on_device = undo_plan(apply, here, backups)

        def plan(flag: torch.Tensor) -> None:
            on_device(flag)
            undo_elsewhere(flag, elsewhere)

        plan = plan if elsewhere else on_device

        plan(apply)
        return plan if simple else None

    def _state_entries(self) -> tuple[list[tuple[dict, Any, torch.Tensor]], list[Any]]:
        entries, others = [], []
        for p in self.params:
            st = self.optimizer.state.get(p)
            if not st:
                others.append((id(p), None))
                continue
            for k, x in st.items():
                if isinstance(x, torch.Tensor):
                    entries.append((st, k, x))
                else:
                    others.append((id(p), k, x))
        return entries, others

    def _restore_exactly(self, entries: list, others: list, tensors: list) -> None:
        """A bad step that changed the state's layout: the parameters and the old tensors
        back, and the state as it was (entries it created are removed)."""
        for t, b in zip(tensors, self._backup, strict=True):
            t.copy_(b)
        old = {}
        for st, k, x in entries:
            old.setdefault(id(st), (st, {}))[1][k] = x
        for p in self.params:
            st = self.optimizer.state.get(p)
            if st is None:
                continue
            kept = old.get(id(st))
            plain = {o[1]: o[2] for o in others if o[0] == id(p) and o[1] is not None}
            if kept is None and not plain:
                del self.optimizer.state[p]
                continue
            st.clear()
            st.update(plain)
            if kept is not None:
                st.update(kept[1])


def identical(a: list[Any], b: list[Any] | None) -> bool:
    """``a[i] is b[i]`` for all i, and as many (False for ``b`` None)."""
    return b is not None and len(a) == len(b) and all(map(operator.is_, a, b))


def undo_elsewhere(
    flag: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], keep: bool = False
) -> None:
    """``t = where(flag, t, backup)`` for tensors on other devices than ``flag``'s, with one
    copy of ``flag`` per device (from an accelerator: one sync per step, not one per tensor);
    ``keep``: the backup takes the result too (``undo_plan``'s ``keep``)."""
    copies: dict[torch.device, torch.Tensor] = {}
    for t, backup in pairs:
        flag_there = copies.get(t.device)
        if flag_there is None:
            flag_there = copies[t.device] = _on(flag, t)
        torch.where(flag_there, t, backup, out=t)
        if keep:
            backup.copy_(t)


_WARNED_SYNC: list[bool] = []


def _warn_sync_once(device: torch.device) -> None:
    if not _WARNED_SYNC:
        _WARNED_SYNC.append(True)
        warnings.warn(
            f"numstab TrainingGuard(host_every>1): the optimizer keeps state on {device} (Adam's "
            f"step counts without capturable=True), so undoing a step there reads the decision "
            f"once per step (a device sync); capturable=True or fused=True keeps the step on "
            f"the device",
            RuntimeWarning,
            stacklevel=4,
        )


def _on(flag: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``flag`` on ``like``'s device (a copy, and a sync from an accelerator, if elsewhere)."""
    return flag if flag.device == like.device else flag.to(like.device)
