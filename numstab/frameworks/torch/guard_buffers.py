"""The model's buffers across a skipped torch step: as they were after the last applied step.

The forward pass updates the buffers (BatchNorm's ``running_mean``, ``running_var`` and
``num_batches_tracked``) before the guard sees the step. A skipped NaN batch wrote NaN into
the running statistics (momentum x NaN), for good: evaluation gave NaN, while the losses of
training mode (batch statistics) stayed finite and no rollback came. :class:`ModelBuffers`
keeps a copy of every buffer of the model (``model.buffers()``, any dtype) on its device,
taken when the guard is built and after each applied step, and puts it back on a skipped
step: the skipped step never happened, all of its micro-batches with gradient accumulation.

* host mode: one ``torch._foreach_copy_`` per step (a kernel per device and dtype), into the
  copy after an applied step, from it after a skipped one;
* device mode (``host_every`` > 1): ``b = copy = where(apply, b, copy)`` for every buffer,
  one compiled call (``guard_compiled.undo_plan(keep=True)``) driven by the device's flag,
  no host read (buffers on another device than the flag: one copy of the flag there);
* a model without buffers: nothing but the test of an empty list.

Memory: one copy of the buffers (a DTensor's: of its local part, which each rank restores).

A snapshot taken while a step runs (after its forward pass) holds the copy, the buffers
after the last step, as it holds the parameters then (before, the next batch's statistics,
NaN after a NaN batch, and a rollback put them back). A snapshot taken between steps (when
the guard is built, at ``skip_batch``, ``flush``, ``load_snapshot``, a resume) and a
rollback read the buffers again and renew the copy.

Which buffers: the persistent ones of ``model.buffers()`` (those ``state_dict`` holds, and
so the snapshots) when the guard is built, each known by its module and name; a
non-persistent one (``persistent=False``: a causal mask, a rotary cache) is no training
state and is not copied. A buffer the module replaces (``self.running = ...``, or ``model.to``) is
found every step (one identity test per buffer) and restored in its new tensor (of another
shape, dtype or device: kept from then on, not restored at that step). A buffer registered
later on a module that had none, or in a module added later, is taken in at the next
rollback or snapshot taken between steps (the loop's ``skip_batch``). Not seen: a buffer's
``.data`` swapped for another shape (not supported), and changes made between steps by
anything but the forward pass (a ``load_state_dict`` into the model after the guard was
built): a skipped step before the next applied step or snapshot undoes them. (A lazy
module's buffers must be materialized before the guard is built, as its parameters: the
first snapshot copies them.)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from numstab.frameworks.torch.guard_compiled import undo_plan
from numstab.frameworks.torch.guard_device import identical, undo_elsewhere
from numstab.frameworks.torch.host import is_dtensor


class ModelBuffers:
    """The copy of a model's buffers, and its use on each step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.after_forward = False  # set by the step while it takes a due snapshot
        self.held: list[torch.Tensor] | None = None  # what the slots held at the last look
        self.read()

    @torch.no_grad()
    def read(self) -> None:
        """Find the model's buffers and copy them as they are now."""
        slots, held, seen = [], [], set()
        for module in self.model.modules():
            transient = module._non_persistent_buffers_set  # masks and caches: not state
            for name, t in module._buffers.items():
                if t is None or id(t) in seen or t.layout != torch.strided or t.is_meta:
                    continue
                if name in transient:
                    continue
                seen.add(id(t))
                slots.append((module._buffers, name))
                held.append(t)
        if not identical(held, self.held):  # else: the copies stay
            self.slots, self.held = slots, held
            self.tensors = [_local(t) for t in held]
            self.copies = [torch.empty_like(t) for t in self.tensors]
            self._plan: Any = None
        if self.tensors:
            torch._foreach_copy_(self.copies, self.tensors)

    def _current(self) -> list[torch.Tensor]:
        """The tensors the slots hold now (one identity test each); replaced ones taken in."""
        now = [d.get(n) for d, n in self.slots]
        if identical(now, self.held):
            return self.tensors
        keep = [i for i, t in enumerate(now) if t is not None]
        self.slots = [self.slots[i] for i in keep]
        self.held = [now[i] for i in keep]
        tensors = [_local(now[i]) for i in keep]
        copies = []
        for i, t in zip(keep, tensors, strict=True):
            c = self.copies[i]
            same = t.shape == c.shape and t.dtype == c.dtype and t.device == c.device
            copies.append(c if same else t.detach().clone())
        self.tensors, self.copies, self._plan = tensors, copies, None
        return tensors

    @torch.no_grad()
    def applied(self) -> None:
        """Host mode, after an applied step: the copy becomes the buffers."""
        if self.slots:
            tensors = self._current()
            if tensors:
                torch._foreach_copy_(self.copies, tensors)

    @torch.no_grad()
    def skipped(self) -> None:
        """Host mode, after a skipped step: the buffers become the copy."""
        if self.slots:
            tensors = self._current()
            if tensors:
                torch._foreach_copy_(tensors, self.copies)

    @torch.no_grad()
    def settle(self, apply: torch.Tensor) -> None:
        """Device mode: ``b = copy = where(apply, b, copy)``, no host read."""
        if not self.slots:
            return
        tensors = self._current()
        if self._plan is None:
            self._plan = self._bind(apply, tensors)
        self._plan(apply)

    def _bind(self, apply: torch.Tensor, tensors: list[torch.Tensor]) -> Any:
        here = [i for i, t in enumerate(tensors) if t.device == apply.device]
        on_device = undo_plan(
            apply, [tensors[i] for i in here], [self.copies[i] for i in here], keep=True
        )
        elsewhere = [
            (t, c) for t, c in zip(tensors, self.copies, strict=True) if t.device != apply.device
        ]
        if not elsewhere:
            return on_device
        if apply.device.type != "cpu":
            _warn_once(elsewhere[0][0].device)

        def plan(flag: torch.Tensor) -> None:
            on_device(flag)
            undo_elsewhere(flag, elsewhere, keep=True)

        return plan

    def kept(self) -> _Kept:
        """A context in which the buffers hold the copy (a snapshot's), then their own again."""
        return _Kept(self)


class _Kept:
    def __init__(self, owner: ModelBuffers) -> None:
        self.owner, self.own = owner, None

    @torch.no_grad()
    def __enter__(self) -> None:
        tensors = self.owner._current()
        if tensors:
            self.own = [t.clone() for t in tensors]
            torch._foreach_copy_(tensors, self.owner.copies)

    @torch.no_grad()
    def __exit__(self, *exc: Any) -> None:
        if self.own is not None:
            torch._foreach_copy_(self.owner.tensors, self.own)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor to copy: a DTensor's local part (the same tensor: its copies are its own)."""
    return t.to_local() if is_dtensor(t) else t


_WARNED: list[bool] = []


def _warn_once(device: torch.device) -> None:
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            f"numstab TrainingGuard(host_every>1): the model keeps buffers on {device}, "
            f"another device than its parameters, so keeping them across a skipped step reads "
            f"the decision there once per step (a device sync)",
            RuntimeWarning,
            stacklevel=5,
        )
