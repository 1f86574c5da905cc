"""The torch guard's steady step on the device (``TrainingGuard(host_every=k)``, k > 1).

:class:`DeviceDecider` takes the decision of ``numstab.guard.policy`` (finite loss and norm,
no spike) with both spike windows packed in one ``[2, W]`` tensor, in about 35 small torch
ops and no host read, and writes the step's row (``numstab.guard.deferred.ROW_FIELDS``) to a
``[k, 9]`` buffer that the host reads every k steps. ``tests/test_guard_torch_device.py``
checks that its decisions equal the policy's.

:class:`Skipper` then makes a bad step not happen, without knowing on the host that it is bad:

* optimizers that step with ``found_inf`` (``_step_supports_amp_scaling``: ``fused=True`` Adam,
  AdamW, SGD, Adagrad), as ``torch.amp.GradScaler`` does: the fused kernel skips the update
  and the step count when ``found_inf`` is 1. Costs nothing.
* any other optimizer (or a ``step_fn``): the parameters and every tensor of the optimizer's
  state are copied before the step (one ``_foreach_copy_``) and put back after it where the
  step is bad (``torch.where``): the step runs, then is undone on the device. Costs two
  passes over the parameters and the optimizer state per step. A state tensor on another
  device than the flag (Adam's CPU step counter beside CUDA parameters without
  ``capturable=True``) is restored with the flag copied to it (a sync); a step that adds or
  replaces non-tensor state, or creates the state (the first step), reads the flag on the
  host once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from numstab.guard.deferred import ROW_COLUMNS, HostBook, decisions_from_rows, detector_constants
from numstab.guard.spikes import WindowState

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard
    from numstab.guard.policy import GuardState


class DeviceSteps:
    """The device mode of a ``TorchGuard``: decide, skip, keep rows; read every k steps."""

    def __init__(self, owner: Any, guard: TrainingGuard, device: torch.device) -> None:
        self.owner = owner  # the TorchGuard: its runner and its guard state
        self.guard = guard
        self.decider = DeviceDecider(guard, device, guard.host_every)
        self.skipper = Skipper(owner.optimizer, owner._params)
        self.book = HostBook(guard)
        self.norms: list[Any] = []
        self.pending = 0  # rows written and not read
        self.steps = 0  # steps seen
        self.lr_factor = 1.0

    def step(self, x: torch.Tensor, norms: Any, step_fn: Callable[[], Any] | None) -> LazyApplied:
        apply = self.decider.decide(self.pending, x.float())
        read_now = self.skipper.run(apply, step_fn)
        self.norms.append(norms)
        self.pending += 1
        self.steps += 1
        if read_now or self.pending >= self.guard.host_every:
            self.read()
        return LazyApplied(apply)

    def read(self) -> None:
        """One host read of the pending rows, then the runner acts on them."""
        if not self.pending:
            return
        rows = self.decider.rows[: self.pending].cpu().numpy()
        self.decider.note_counts(rows[-1])
        ds = decisions_from_rows(self.guard, rows, self.steps - self.pending)
        for d in ds:
            self.book.mark(d)
            if d["rollback"]:
                break
        layers = self.norms if self.guard.track_layers else None
        self.pending, self.norms = 0, []
        runner = self.owner.runner
        new = runner.after_steps(ds, layers, self.owner._torch, self.state, self.steps)
        if new is not None:
            self.reset(new, self.steps)

    def state(self) -> GuardState:
        """The guard state now, as NumPy (reads the windows: at events only)."""
        return self.book.state(self.decider.windows(), self.lr_factor, self.steps)

    def reset(self, state: GuardState, steps: int) -> None:
        """After a rollback or a load: the windows and the LR factor of ``state``."""
        self.book.reset()
        self.pending, self.norms = 0, []
        self.decider.full = False
        self.decider.load(state)
        self.lr_factor = float(state.lr_factor)
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


class DeviceDecider:
    """The packed spike windows (row 0: the loss, row 1: the gradient norm) and the per-step
    rows, on ``device``; every per-detector quantity is a ``[2, 1]`` column."""

    def __init__(self, guard: TrainingGuard, device: torch.device, capacity: int) -> None:
        c = detector_constants(guard)
        self.sizes = [int(w) for w in c["window"]]
        f = {"device": device, "dtype": torch.float32}

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, **f).reshape(2, 1)

        self.win = torch.zeros(2, max(self.sizes), **f)
        self.count = column([0.0, 0.0])
        self.position = column([0.0, 0.0])
        self.window = column(c["window"])
        self.warmup_less_1 = column([w - 1.0 for w in c["warmup"]])
        self.sigma = column(c["sigma"])
        self.two_sided = column(c["two"]) > 0 if any(c["two"]) else None
        self.record = column(c["rec"]) > 0
        self.on = column(c["on"]) > 0
        # the threshold offset + scale * std: +inf for a disabled detector (never a spike)
        self.scale = column(
            [sig if on else 0.0 for sig, on in zip(c["sigma"], c["on"], strict=True)]
        )
        self.offset = column([0.0 if on else float("inf") for on in c["on"]])
        # every detector records spikes (OLMo-core's rule): a finite value always enters
        self._take_is_finite = all(c["rec"]) and all(c["on"])
        self.slots = torch.arange(max(self.sizes), **f)
        self.rows = torch.zeros(capacity, 2, len(ROW_COLUMNS), **f)
        # the enabled windows are full (the host saw it at a read): a shorter path, below
        self.full = False
        enabled = [r for r in range(2) if c["on"][r]]
        self._can_be_full = bool(enabled) and all(
            self.sizes[r] == max(self.sizes) and c["warmup"][r] <= self.sizes[r] + 1
            for r in enabled
        )
        self._enabled = enabled

    @torch.no_grad()
    def decide(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The ``apply`` (0-d bool tensor) of the step whose ``[loss, global norm]`` is the
        float32 ``x``; writes row ``i``; no host read."""
        x = x.reshape(2, 1)
        if self.full:
            return self._decide_full(i, x)
        n = self.count
        valid = self.slots < n
        mean = self.win.sum(1, keepdim=True) / n.clamp(min=1.0)  # slots past the count hold 0
        centered = torch.where(valid, self.win - mean, 0.0)
        std = ((centered * centered).sum(1, keepdim=True) / (n - 1.0).clamp(min=1.0)).sqrt()
        diff = x - mean
        if self.two_sided is not None:
            diff = torch.where(self.two_sided, diff.abs(), diff)
        finite = x.isfinite()
        ok = finite & ~((n >= self.warmup_less_1) & (diff > self.sigma * std))
        apply = ok.all()
        take = (apply | self.record) & finite & self.on
        torch.where((self.slots == self.position) & take, x, self.win, out=self.win)
        torch.cat([x, mean, std, n, ok.float()], dim=1, out=self.rows[i])
        step = take.float()
        torch.minimum(n + step, self.window, out=self.count)
        torch.remainder(self.position + step, self.window, out=self.position)
        return apply

    def _decide_full(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``decide`` once every enabled window is full: the count stays the window, every
        slot is valid and every enabled detector is past its warmup (<= window + 1)."""
        std, mean = torch.std_mean(self.win, dim=1, correction=1, keepdim=True)
        diff = x - mean
        if self.two_sided is not None:
            diff = torch.where(self.two_sided, diff.abs(), diff)
        finite = x * 0.0 == 0.0  # false for nan and +-inf
        ok = (diff <= torch.addcmul(self.offset, self.scale, std)) & finite
        apply = ok.all()
        take = finite if self._take_is_finite else (apply | self.record) & finite & self.on
        torch.where((self.slots == self.position) & take, x, self.win, out=self.win)
        torch.cat([x, mean, std, self.count, ok.float()], dim=1, out=self.rows[i])
        torch.remainder(self.position + take.float(), self.window, out=self.position)
        return apply

    def note_counts(self, last_row: np.ndarray) -> None:
        """After a read: switch to the short path once the enabled windows are full (a full
        window stays full until a rollback or a load sets the windows)."""
        self.full = self._can_be_full and all(
            last_row[r, 3] >= self.sizes[r] for r in self._enabled
        )

    # -- the windows as the policy's GuardState (host reads: events only) ------------------------
    def windows(self) -> tuple[WindowState, WindowState]:
        win, count, pos = (t.cpu().numpy() for t in (self.win, self.count, self.position))
        return tuple(  # type: ignore[return-value]
            WindowState(win[r, : self.sizes[r]].copy(), np.int32(count[r, 0]), np.int32(pos[r, 0]))
            for r in range(2)
        )

    def load(self, state: GuardState) -> None:
        """Set the windows to those of a (NumPy) ``GuardState``, e.g. after a rollback."""
        for r, w in enumerate((state.loss_window, state.grad_norm_window)):
            values = torch.as_tensor(np.asarray(w.values, np.float32))
            self.win[r].zero_()
            self.win[r, : values.numel()].copy_(values)
            self.count[r] = float(w.count)
            self.position[r] = float(w.position)


class Skipper:
    """Runs the optimizer step so that it has no effect where ``apply`` is false."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._backup: list[torch.Tensor] = []
        self._backed_up: list[torch.Tensor] = []  # the tensors the buffers were made for

    def run(self, apply: torch.Tensor, step_fn: Callable[[], Any] | None) -> bool:
        """Step; True when the guard needs ``apply`` read on the host this once."""
        if self.fused and step_fn is None:
            opt = self.optimizer
            opt.found_inf = (~apply).float()  # type: ignore[attr-defined]
            try:
                opt.step()
            finally:
                del opt.found_inf  # type: ignore[attr-defined]
            return False
        return self._undo_step(apply, step_fn or self.optimizer.step)

    @torch.no_grad()
    def _undo_step(self, apply: torch.Tensor, step_fn: Callable[[], Any]) -> bool:
        entries, others = self._state_entries()
        tensors = self.params + [t for _, _, t in entries]
        seen = self._backed_up
        if len(seen) != len(tensors) or any(a is not b for a, b in zip(seen, tensors, strict=True)):
            self._backup = [torch.empty_like(t) for t in tensors]  # new tensors: new buffers
            self._backed_up = tensors
        if tensors:
            torch._foreach_copy_(self._backup, tensors)
        step_fn()
        new_entries, new_others = self._state_entries()
        same = len(new_entries) == len(entries) and new_others == others
        same = same and all(
            a[0] is b[0] and a[1] == b[1] for a, b in zip(entries, new_entries, strict=True)
        )
        if not same:  # the step made or changed state the backup does not hold
            if not bool(apply):
                self._restore_exactly(entries, others, tensors)
            return True
        n = len(self.params)
        for p, backup in zip(self.params, self._backup[:n], strict=True):
            torch.where(_on(apply, p), p, backup, out=p)
        for (_, _, old), (st, k, now), backup in zip(
            entries, new_entries, self._backup[n:], strict=True
        ):
            flag = _on(apply, now)
            if now is old:
                torch.where(flag, now, backup, out=now)
            else:  # the optimizer replaced the tensor: put a restored one in its place
                st[k] = torch.where(flag, now, backup)
        return False

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


def _on(flag: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``flag`` on ``like``'s device (a copy, and a sync from an accelerator, if elsewhere)."""
    return flag if flag.device == like.device else flag.to(like.device)
