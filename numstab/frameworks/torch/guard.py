"""The training guard in a PyTorch loop: the guard decides whether ``optimizer.step()`` runs.

    tg = TrainingGuard(snapshot_every=100).for_torch(model, optimizer, scheduler=sched)
    for x, y in loader:
        if tg.skip_batch():            # True only for skip_after_rollback batches
            continue
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if tg.step(loss):              # checks, then optimizer.step() only if the step is good
            sched.step()

Per step: the per-parameter gradient norms come from one ``torch._foreach_norm`` per device
and dtype, and the global norm from them, on the device; then ONE host transfer reads the
loss and the global norm (as ``GradScaler.step`` reads its flag). The decision itself runs on
the host (``numstab.guard.policy`` on NumPy). The per-parameter norms stay on the device and
are copied to the history 256 steps at a time.

Distributed (``torch.distributed`` initialized, or ``process_group`` given, world size > 1):
every rank must take the same decision, else one rank skips a step that another applies and
the replicas drift apart silently. So the step's two numbers are all-reduced in one collective
before the decision: the loss becomes the mean of the ranks' losses (a rank-local spike or NaN
counts on every rank), and the global norm is the ranks' common norm (replicated gradients,
as after DDP's all-reduce: their mean) or, with ``sharded=True`` (each rank holds a disjoint
part of the parameters, FSDP-style, as plain local tensors), ``sqrt`` of the summed squares.
Every rank then runs the same policy on the same numbers. Per-layer norms stay per rank,
except FSDP2's DTensor gradients: their norms are made global first (``layer_norms``), so
their global norm is taken as replicated whatever ``sharded`` says. Snapshot files in a
shared ``snapshot_dir``: rank 0's alone (replicated), or each rank's in ``rank-<r>`` (sharded,
DTensors); ``guard_files.rank_directory``.

With ``TrainingGuard(host_every=k)``, k > 1, the steady step stays on the device
(``guard_device.py``): ``torch._foreach_norm``, then the global norm and ``policy.decide``
in one compiled call on a torch state (``guard_compiled.py``),
the skip through the optimizer's ``found_inf`` (fused optimizers) or a backup-and-undo, no
host read; the host reads the decisions every k steps and at ``flush()`` (docs/semantics.md
§16.12).

A skipped step leaves the model's buffers (BatchNorm's running statistics) as they were
after the last applied step: the forward pass changed them before the guard saw the step,
so a copy is put back (``guard_buffers.py``; on the device's flag in device mode).

Snapshots copy ``model.state_dict()`` (buffers included), ``optimizer.state_dict()`` and the
scheduler's state on the device. A rollback loads them back (in place: the optimizer keeps
its parameters; each optimizer state tensor with its dtype in the snapshot, not cast to its
parameter's: ``guard_groups.exact_state``), then multiplies every param group's ``lr`` (and
``initial_lr``, and the scheduler's ``base_lrs``) by the LR factor. Param groups added after
the snapshot (``add_param_group``) stay, with their settings as now and no optimizer state.
Snapshot files: ``guard_files.py``.

The optimizer may update the model's parameters only (checked at construction, and at the
first ``step`` after ``add_param_group``). The gradients
checked are those of the parameters the step can update (trainable, or with a ``.grad``; a
missing ``.grad`` has norm 0); a frozen parameter joins them as soon as it requires grad
(gradual unfreezing, read every step), and in device mode is backed up from then on. The
history has one column per floating parameter of the model, 0 while frozen.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from numstab import _validate as v
from numstab.backends import load_backend
from numstab.backends._base import Backend
from numstab.backends._native import has_native
from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch import guard_files, lr_scaling
from numstab.frameworks.torch.backend import is_dtensor
from numstab.frameworks.torch.distributed import reduction_group
from numstab.frameworks.torch.guard_buffers import ModelBuffers
from numstab.frameworks.torch.guard_device import DeviceSteps, LazyApplied
from numstab.frameworks.torch.guard_groups import check_own_parameters, exact_state, fitted
from numstab.guard import policy
from numstab.guard.runner import GuardRunner, RunnerResults

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard
from numstab.guard.monitor import layer_norms


class TorchGuard(RunnerResults):
    """A :class:`TrainingGuard` bound to a model, an optimizer and optionally a scheduler."""

    def __init__(
        self,
        guard: TrainingGuard,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any = None,
        sharded: bool = False,
        process_group: Any = None,
        scaler: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                f"Expected model to be a torch.nn.Module. Received: model of type "
                f"{type(model).__name__}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"Expected optimizer to be a torch.optim.Optimizer. Received: optimizer of "
                f"type {type(optimizer).__name__}"
            )
        if scheduler is not None and not hasattr(scheduler, "state_dict"):
            raise InvalidArgumentError(
                f"Expected scheduler to be a torch LR scheduler or None. Received: "
                f"scheduler of type {type(scheduler).__name__}"
            )
        if scaler is not None and not callable(getattr(scaler, "is_enabled", None)):
            raise InvalidArgumentError(
                f"Expected scaler to be a torch.amp.GradScaler (or numstab's) or None. "
                f"Received: scaler of type {type(scaler).__name__}"
            )
        self._groups_checked = check_own_parameters(model.parameters(), optimizer)
        v.check_bool("sharded", sharded)
        group_type = getattr(dist, "ProcessGroup", None)
        if process_group is not None and not (group_type and isinstance(process_group, group_type)):
            raise InvalidArgumentError(
                f"Expected process_group to be a torch.distributed ProcessGroup or None. "
                f"Received: process_group={process_group!r}"
            )
        self.guard, self.model, self.optimizer = guard, model, optimizer
        self.scheduler, self.sharded, self.process_group = scheduler, sharded, process_group
        self.scaler = scaler
        # every parameter that can ever take a gradient, trainable now or not: the history
        # has a column for each; a step checks those it can update (``grads``), so one
        # unfrozen later (gradual unfreezing) is checked from then on
        named = [
            (n, p) for n, p in model.named_parameters() if p.is_floating_point() or p.is_complex()
        ]
        self._all = [p for _, p in named]
        self._norm_device = self._all[0].device if self._all else None
        self._host = load_backend("numpy")
        self._torch = load_backend("torch")
        self.state = guard.init_state(self._host)
        # deferred: a snapshot due after step t is taken when step t + 1 starts, so that the
        # user's scheduler.step() after step t is in it
        names = [n for n, _ in named]
        self.runner = GuardRunner(guard, self, self._host, names, defer_snapshots=True)
        per_rank = sharded or any(is_dtensor(p) for p in self._all)  # each rank's own state
        group = reduction_group(process_group)
        self.runner.disk = guard_files.rank_directory(self.runner.disk, group, per_rank)
        self._buffers = ModelBuffers(model)  # put back on a skipped step
        self.runner.snapshot(0, self.state)
        self._device: DeviceSteps | None = None
        self._use_params([_updatable(p) for p in self._all])
        if guard.host_every > 1 and self._all:
            self._device = DeviceSteps(self, guard, self._norm_device)

    # -- the loop ----------------------------------------------------------------------------
    @property
    def steps_seen(self) -> int:
        return self._device.steps if self._device is not None else int(self.state.step)

    def skip_batch(self) -> bool:
        """True while the batches right after a rollback are skipped (logged)."""
        self.runner.take_pending_snapshot()
        return self.runner.consume_skip_batch(self.steps_seen)

    def step(
        self, loss: torch.Tensor | float, step_fn: Callable[[], Any] | None = None
    ) -> bool | LazyApplied:
        """Decide on this step from ``loss`` and the ``.grad`` of the parameters; call
        ``step_fn`` (default ``optimizer.step``) only when the step is good; take snapshots
        and roll back as the decision says. Returns whether the step was applied.

        A snapshot that falls due after this step is taken when the next ``step`` (or
        ``skip_batch``, or ``flush``) starts, after the user's ``scheduler.step()``.

        With ``host_every`` > 1 the step stays on the device (guard_device.py) and returns a
        :class:`LazyApplied`: ``bool()`` of it reads the flag (a host sync)."""
        return self._step(_scalar_loss(self._torch, loss, self._norm_device), step_fn)

    def step_without_loss(self, step_fn: Callable[[], Any] | None = None) -> bool | LazyApplied:
        """``step`` for a step with no loss to read (the ``Trainer`` with
        ``label_smoothing_factor``): decided on the gradients alone (``policy.decide`` with
        ``loss=None``: no loss rule, the loss window untouched; the history's loss is NaN)."""
        return self._step(None, step_fn)

    def _step(
        self, loss: torch.Tensor | None, step_fn: Callable[[], Any] | None
    ) -> bool | LazyApplied:
        if step_fn is not None and not callable(step_fn):
            raise InvalidArgumentError(
                f"Expected step_fn to be a callable or None. Received: step_fn={step_fn!r}"
            )
        if len(self.optimizer.param_groups) != self._groups_checked:  # add_param_group since
            self._groups_checked = check_own_parameters(
                self._all, self.optimizer, self._groups_checked
            )
        self._buffers.after_forward = True  # a due snapshot takes the buffers after step t
        try:
            self.runner.take_pending_snapshot()
        finally:
            self._buffers.after_forward = False
        grads = self.grads()
        measured, self._measured = self._measured, None
        self.step_norm = None
        has_loss = loss is not None
        if self._device is not None and measured is None and self._one_call(loss):
            return self._device.step_from_grads(loss, grads, step_fn)
        with torch.no_grad():
            norms, total = measured or (layer_norms(self._torch, grads) if grads else (None, None))
            if not has_loss:  # a placeholder that no rule reads
                loss = torch.zeros((), device=total.device if total is not None else None)
            if total is not None and loss.device != total.device:
                loss = loss.to(total.device)
            pair = torch.stack([loss, total.float() if total is not None else loss * 0])
            group = reduction_group(self.process_group)
            if group is not None:
                # the norm of DTensor gradients (FSDP2) is global already: a replicated one
                sharded = self.sharded and not (grads and is_dtensor(grads[0]))
                pair = _reduced(pair, group, sharded)
            if self._device is not None:
                return self._device.step(pair, norms, step_fn, has_loss=has_loss)
            loss_h, norm_h = pair.tolist()  # the one host sync of the step
            self.step_norm = norm_h if grads else None
        decision, state = policy.decide(
            self.guard,
            self._host,
            self.state,
            np.float32(loss_h) if has_loss else None,
            np.float32(norm_h) if grads else None,
            scaler_overflow=np.bool_(not np.isfinite(norm_h)) if self.loss_scaled() else None,
        )
        d = _host_dict(decision)
        if d["apply"]:
            (step_fn or self.optimizer.step)()  # if it raises, the guard's state stays as it was
            self._buffers.applied()
        else:
            self._buffers.skipped()  # what this step's forward passes did to them, undone
        self.state = state  # counted, also where after_step gives up (NonFiniteError)
        self.state = self.runner.after_step(
            d, state, self.layer_row(norms) if self.guard.track_layers else None, self._torch
        )
        return d["apply"]

    _measured: tuple[Any, Any] | None = None
    step_norm: float | None = None  # host mode: this step's global norm, read with the decision

    def loss_scaled(self) -> bool:
        """Whether an enabled dynamic loss scaler (``scaler``) handles gradient overflow:
        such a step (finite loss, non-finite gradients) is skipped, not counted toward a
        rollback (as it comes down, a fresh scaler overflows on several steps in a row)."""
        return self.scaler is not None and bool(self.scaler.is_enabled())

    def measure_grads(self, scale: Any = None) -> None:
        """Take this step's gradient norms now, on the device, for the next ``step`` to
        decide on: for loops that clip between the backward pass and ``optimizer.step()``
        (Lightning's ``on_before_optimizer_step`` comes before its clipping), so that the
        guard sees the gradients the backward pass made, not the clipped ones. ``scale``: a
        GradScaler's scale the gradients still carry (a fused optimizer unscales inside its
        step): the norms are divided by it, a tensor (no host read; exact for a power of 2)."""
        grads = self.grads()
        with torch.no_grad():
            norms, total = layer_norms(self._torch, grads) if grads else (None, None)
            if scale is not None and total is not None:
                scale = torch.as_tensor(scale, dtype=torch.float32)
                norms, total = norms / scale.to(norms.device), total / scale.to(total.device)
        self._measured = (norms, total)

    def forget_measured(self) -> None:
        """Drop the norms ``measure_grads`` took (a step the loop's scaler skipped)."""
        self._measured = None

    @property
    def measured(self) -> bool:
        """Whether ``measure_grads`` took this step's norms already."""
        return self._measured is not None

    def step_grad_norm(self) -> torch.Tensor | None:
        """This step's global gradient norm (a device tensor; None without parameters to
        check), the one the next ``step`` decides on: measured now unless ``measure_grads``
        already did this step."""
        if self._measured is None:
            self.measure_grads()
        return self._measured[1]

    def grads(self) -> list[torch.Tensor]:
        """The gradients of the parameters checked (an empty tensor, norm 0, for one without
        ``.grad``). A frozen one joins them once it requires grad (gradual unfreezing: read
        every step, one attribute per frozen parameter); one frozen later stays (norm 0)."""
        if self._frozen and any(map(_REQUIRES_GRAD, self._frozen)):
            checked = zip(self._all, self._checked, strict=True)
            self._use_params([u or p.requires_grad for p, u in checked])
        return [
            e if p.grad is None else p.grad for p, e in zip(self._params, self._empty, strict=True)
        ]

    def _use_params(self, checked: list[bool]) -> None:
        """Check (and in device mode back up) the parameters flagged in ``checked``."""
        self._checked = checked
        self._params = [p for p, u in zip(self._all, checked, strict=True) if u]
        self._frozen = [p for p, u in zip(self._all, checked, strict=True) if not u]
        self._empty = [p.new_empty(0) for p in self._params]  # norm 0 for a missing grad
        self._index = (  # where their norms go in a history row (None: everywhere)
            None
            if not self._frozen
            else torch.tensor([i for i, u in enumerate(checked) if u], device=self._norm_device)
        )
        # the device step's norms: torch._foreach_norm, then one compiled call (guard_device)
        self._one_kernel = (
            bool(self._params)
            and has_native(self._torch, "leaf_norms")
            and all(
                p.device == self._norm_device and p.dtype in _FUSED_DTYPES and not is_dtensor(p)
                for p in self._params
            )
        )
        if self._device is not None:
            self._device.skipper.use(self._params)

    def layer_row(self, norms: torch.Tensor | None) -> torch.Tensor | None:
        """A step's per-parameter norms as its history row: one per parameter of the model,
        0 for those the step could not update (frozen)."""
        if self._index is None:
            return norms
        if norms is None:
            return torch.zeros(len(self._all), device=self._norm_device)
        return norms.new_zeros(len(self._all)).index_copy_(0, self._index.to(norms.device), norms)

    def _one_call(self, loss: Any) -> bool:
        """Whether the device step takes its norms and decision in one compiled call: one
        device, float32 or narrower parameters, a one-element loss there, no collective."""
        return (
            self._one_kernel
            and isinstance(loss, torch.Tensor)
            and loss.numel() == 1
            and loss.device == self._norm_device
            and reduction_group(self.process_group) is None
        )

    def flush(self) -> None:
        """Act on the steps not read yet (``host_every`` > 1: history, log, rollback), and
        take a snapshot that fell due after the last step (e.g. at the end of training)."""
        if self._device is not None:
            self._device.read()
        self.runner.take_pending_snapshot()

    # -- results ---------------------------------------------------------------------------------
    def load_snapshot(self, step: int | None = None) -> int:
        """Restore model, optimizer and scheduler from the newest (or ``step``) snapshot file
        of ``snapshot_dir``, e.g. after a crash; returns its step. Distributed: every rank
        must call it; all restore the same step or all raise (``load_on_every_rank``)."""
        group = reduction_group(self.process_group)
        if group is None or self.runner.disk is None:
            step, self.state = self.runner.load_from_disk(step)
        else:  # every rank, from the same step (or every rank raises)
            disk, device = self.runner.disk, self._norm_device or "cpu"
            load = self.runner.load_from_disk
            step, self.state = guard_files.load_on_every_rank(disk, load, step, group, device)
        if self._device is not None:
            self._device.reset(self.state, step)
        return step

    # -- the Adapter protocol of GuardRunner -------------------------------------------------------
    def capture(self) -> dict[str, Any]:
        if self._buffers.after_forward:  # in a step: the buffers after the last one
            with self._buffers.kept():
                model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        else:  # between steps: as they are now (a resumed model), and the copy renewed
            self._buffers.read()
            model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        payload = {"model": model, "optimizer": copy.deepcopy(self.optimizer.state_dict())}
        if self.scheduler is not None:
            payload["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        return payload

    def restore(self, payload: dict[str, Any]) -> None:
        # a copy: load_state_dict may keep the given tensors, which later steps update in place
        optimizer = fitted(copy.deepcopy(payload["optimizer"]), self.optimizer)
        self._kept_groups = len(payload["optimizer"]["param_groups"])  # the rest: added since
        self.model.load_state_dict(payload["model"])
        self._buffers.read()  # a skipped step puts back the restored buffers
        self.optimizer.load_state_dict(optimizer)
        if not payload.get(guard_files.CAST):  # an older file cannot tell
            exact_state(self.optimizer, optimizer)  # torch cast the state to the params' dtypes
        self._scheduler_restored = self.scheduler is not None and "scheduler" in payload
        if self._scheduler_restored:
            self.scheduler.load_state_dict(copy.deepcopy(payload["scheduler"]))

    def scale_lr(self, ratio: float, ratio_now: float) -> None:
        """The groups' learning rates and the scheduler's stored ones times the cut: the
        restored ones times ``ratio``, the groups added after the snapshot (kept as they
        were) times ``ratio_now``; ``lr_scaling.scale_lr`` has the rules."""
        lr_scaling.scale_lr(
            self.optimizer,
            self.scheduler,
            ratio,
            ratio_now,
            self._kept_groups,
            self._scheduler_restored,
        )

    def to_host(self, payload: Any) -> Any:
        return guard_files.to_host(payload)

    def from_host(self, tree: Any) -> Any:
        """A snapshot file's payload as tensors, checked to fit this model and optimizer."""
        return guard_files.from_host(tree, self.model, self.optimizer)


def _updatable(p: torch.Tensor) -> bool:
    """Whether the optimizer can update ``p`` (torch's skip parameters without ``.grad``)."""
    return p.requires_grad or p.grad is not None


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # norms accumulated in float32


def _reduced(pair: torch.Tensor, group: Any, sharded: bool) -> torch.Tensor:
    """[mean loss, global norm] over the ranks of ``group``, in one SUM all-reduce: the
    norms' mean (replicated) or ``sqrt`` of their summed squares (sharded). A NaN or inf on
    any rank reaches every rank."""
    world = dist.get_world_size(group)
    packed = torch.stack([pair[0], pair[1] * pair[1] if sharded else pair[1]])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return torch.stack([packed[0] / world, packed[1].sqrt() if sharded else packed[1] / world])


def _scalar_loss(be: Backend, loss: Any, device: torch.device | None) -> torch.Tensor:
    """The step's loss as a 0-d float32 tensor on ``device`` (``policy.scalar_input``: the
    rule of every guard)."""
    if isinstance(loss, torch.Tensor):
        loss = loss.detach()
    loss = policy.scalar_input(be, "loss", loss)
    return loss if device is None or loss.device == device else loss.to(device)


def _host_dict(decision: policy.Decision) -> dict[str, Any]:
    d = decision._asdict()
    out = {k: (x.item() if hasattr(x, "item") else x) for k, x in d.items() if k != "layer_norms"}
    out["apply"] = bool(out["apply"])
    out["rollback"] = bool(out["rollback"])
    out["snapshot"] = bool(out["snapshot"])
    return out
