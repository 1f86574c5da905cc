"""``TrainingGuard``: the settings, and the host-side runner every framework adapter shares.

    guard = TrainingGuard(snapshot_every=100, rollback_after=3, lr_factor=0.5,
                          log_path="guard.jsonl")
    tg = guard.for_torch(model, optimizer)       # PyTorch loop  (numstab.frameworks.torch.guard)
    og = guard.for_optax()                       # optax loop    (numstab.frameworks.jax.guard)
    cb = guard.keras_callback()                  # model.fit     (numstab.frameworks.keras.guard)

Per step: the decision of ``numstab.guard.policy`` (non-finite loss or gradient, or a spike:
skip; ``rollback_after`` bad steps within ``rollback_window``: roll back). The runner below
then acts on the host: it records the history, logs every action as a JSON line, takes a
snapshot every ``snapshot_every`` good steps (memory ring, and ``snapshot_dir`` on disk), and
on a rollback restores the newest snapshot (one further back if it rolled back to it already
without a new snapshot since), multiplies the learning rate by ``lr_factor`` and skips the
next ``skip_after_rollback`` batches. More than ``max_rollbacks`` rollbacks raise
``NonFiniteError``: the run does not recover, a person should look.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable
from typing import Any, Protocol

from numstab import _validate as v
from numstab._dispatch import to_backend
from numstab.backends import load_backend
from numstab.backends._base import Backend
from numstab.errors import InvalidArgumentError, NonFiniteError
from numstab.guard import policy
from numstab.guard.events import EventLog
from numstab.guard.monitor import NormHistory
from numstab.guard.snapshots import Snapshot, SnapshotDirectory, SnapshotRing
from numstab.guard.spikes import SpikeDetector

_OLMO = SpikeDetector.olmo_core()


@dataclasses.dataclass(frozen=True)
class TrainingGuard:
    """Settings of the training guard (immutable, validated; InvalidArgumentError if bad).

    Args:
      loss_spikes, grad_norm_spikes: spike detectors (``SpikeDetector``), or None to check
        only finiteness. Default: OLMo-core's rule (6 sigma over 128 steps) for both.
      snapshot_every: take a snapshot after this many applied steps (>= 1).
      keep_snapshots: snapshots kept in memory (>= 1).
      rollback_after: roll back when this many of the last ``rollback_window`` steps were
        skipped (1 <= rollback_after <= rollback_window).
      lr_factor: multiply the learning rate by this at every rollback, in (0, 1].
      skip_after_rollback: batches to skip right after a rollback (>= 0).
      max_rollbacks: raise NonFiniteError at the rollback after this many (None: never).
      snapshot_dir: also write every snapshot there as ``snapshot-<step>.npz`` (atomic);
        ``keep_on_disk`` newest files are kept.
      log_path, log_callback: where each action goes as a JSON object (file: one per line).
      track_layers: keep per-layer gradient norms in the history (torch, optax).
    """

    loss_spikes: SpikeDetector | None = _OLMO
    grad_norm_spikes: SpikeDetector | None = _OLMO
    snapshot_every: int = 100
    keep_snapshots: int = 2
    rollback_after: int = 3
    rollback_window: int = 16
    lr_factor: float = 0.5
    skip_after_rollback: int = 0
    max_rollbacks: int | None = 10
    snapshot_dir: str | os.PathLike | None = None
    keep_on_disk: int = 2
    log_path: str | os.PathLike | None = None
    log_callback: Callable[[dict[str, Any]], Any] | None = None
    track_layers: bool = True

    def __post_init__(self) -> None:
        for name in ("loss_spikes", "grad_norm_spikes"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, SpikeDetector):
                raise InvalidArgumentError(
                    f"Expected {name} to be a numstab.guard.SpikeDetector or None. Received: "
                    f"{name}={value!r}"
                )
        for name, low in (
            ("snapshot_every", 1),
            ("keep_snapshots", 1),
            ("rollback_after", 1),
            ("rollback_window", 1),
            ("skip_after_rollback", 0),
            ("keep_on_disk", 1),
        ):
            value = v.check_int(name, getattr(self, name))
            if value < low:
                raise InvalidArgumentError(f"Expected {name} >= {low}. Received: {name}={value}")
        if self.rollback_after > self.rollback_window:
            raise InvalidArgumentError(
                f"Expected rollback_after <= rollback_window. Received: rollback_after="
                f"{self.rollback_after}, rollback_window={self.rollback_window}"
            )
        v.check_number("lr_factor", self.lr_factor, low=0.0, high=1.0, low_open=True)
        if self.max_rollbacks is not None and v.check_int("max_rollbacks", self.max_rollbacks) < 0:
            raise InvalidArgumentError(
                f"Expected max_rollbacks >= 0 or None. Received: max_rollbacks={self.max_rollbacks}"
            )
        if self.snapshot_dir is not None and not isinstance(self.snapshot_dir, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"Expected snapshot_dir to be a path or None. Received: snapshot_dir="
                f"{self.snapshot_dir!r}"
            )
        if not isinstance(self.track_layers, bool):
            raise InvalidArgumentError(
                f"Expected track_layers to be a bool. Received: track_layers={self.track_layers!r}"
            )
        EventLog(self.log_path, self.log_callback)  # validates both

    # -- framework entry points (each imports its framework) -----------------------------------
    def for_torch(
        self,
        model: Any,
        optimizer: Any,
        *,
        scheduler: Any = None,
        sharded: bool = False,
        process_group: Any = None,
    ) -> Any:
        """A :class:`numstab.frameworks.torch.guard.TorchGuard` for a PyTorch loop; under
        ``torch.distributed`` every rank decides on the mean loss and the global norm."""
        from numstab.frameworks.torch.guard import TorchGuard

        return TorchGuard(
            self,
            model,
            optimizer,
            scheduler=scheduler,
            sharded=sharded,
            process_group=process_group,
        )

    def for_optax(self) -> Any:
        """A :class:`numstab.frameworks.jax.guard.OptaxGuard` for a functional optax loop."""
        from numstab.frameworks.jax.guard import OptaxGuard

        return OptaxGuard(self)

    def keras_callback(self) -> Any:
        """A :class:`numstab.frameworks.keras.guard.GuardCallback` for ``model.fit``."""
        from numstab.frameworks.keras.guard import GuardCallback

        return GuardCallback(self)

    # -- the pure decision, on any backend -----------------------------------------------------
    def init_state(self, be: Backend | str = "numpy", like: Any = None) -> policy.GuardState:
        return policy.init_state(self, _backend(be), like)

    def decide(
        self, state: policy.GuardState, loss: Any, grad_norm: Any, be: Backend | str = "numpy"
    ) -> tuple[policy.Decision, policy.GuardState]:
        """The decision on one step from its scalar ``loss`` and ``grad_norm`` (None: no
        gradient check): numbers or one-element float arrays of ``be``."""
        be = _backend(be)
        like = state.step if isinstance(state, policy.GuardState) else None
        loss = _scalar(be, "loss", loss, like)
        if grad_norm is not None:
            grad_norm = _scalar(be, "grad_norm", grad_norm, like)
        return policy.decide(self, be, state, loss, grad_norm)


def _backend(be: Backend | str) -> Backend:
    return load_backend(be) if isinstance(be, str) else be


def _scalar(be: Backend, name: str, x: Any, like: Any) -> Any:
    """``x`` as a 0-d float32 array of ``be``: a real number, or a numeric array with one
    element. Anything else raises: a vector would be broadcast against the guard's state."""
    if isinstance(x, bool) or not (isinstance(x, numbers.Real) or hasattr(x, "dtype")):
        raise InvalidArgumentError(
            f"Expected {name} to be a scalar number or a one-element array. Received: {name}={x!r}"
        )
    x = to_backend(be, x, like=like, name=name)
    dtype, shape = be.dtype_name(x), be.shape(x)
    if not (v.is_floating(dtype) or v.is_integer(dtype)):
        raise InvalidArgumentError(
            f"Expected {name} of a numeric dtype. Received: {name}.dtype={dtype}"
        )
    if any(n != 1 for n in shape):
        raise InvalidArgumentError(
            f"Expected {name} to be a scalar (one element). Received: {name}.shape={shape}"
        )
    return be.cast(be.reshape(x, ()), "float32")


class Adapter(Protocol):
    """What a framework gives the runner."""

    def capture(self) -> Any: ...  # a copy of the training state (model, optimizer, ...)

    def restore(self, payload: Any) -> None: ...

    def scale_lr(self, ratio: float) -> None: ...  # multiply the current learning rate

    def to_host(self, payload: Any) -> Any: ...  # NumPy tree for the disk

    def from_host(self, tree: Any) -> Any: ...


class GuardRunner:
    """The host side of a guard: history, log, snapshots and rollbacks."""

    def __init__(
        self,
        guard: TrainingGuard,
        adapter: Adapter,
        be: Backend,
        names: list[str],
        *,
        defer_snapshots: bool = False,
    ) -> None:
        """``defer_snapshots``: a due snapshot is taken by :meth:`take_pending_snapshot` (the
        adapter calls it when the next step starts), so that what the user does after a step
        (``scheduler.step()``) is in it."""
        self.guard = guard
        self.adapter = adapter
        self.be = be  # the backend of the GuardState
        self.log = EventLog(guard.log_path, guard.log_callback)
        self.history = NormHistory(names)
        self.ring = SnapshotRing(guard.keep_snapshots)
        self.disk = (
            None
            if guard.snapshot_dir is None
            else SnapshotDirectory(guard.snapshot_dir, guard.keep_on_disk)
        )
        self.rollbacks = 0
        self.skipped = 0
        self.skip_batches_left = 0
        self.offending_steps: list[int] = []  # skipped steps since the last snapshot
        self._rolled_back_to_latest = False
        self.defer_snapshots = defer_snapshots
        self._pending: tuple[int, policy.GuardState] | None = None

    # -- events ----------------------------------------------------------------------------------
    def snapshot(self, steps_seen: int, state: policy.GuardState) -> None:
        lr_factor = float(self.be.to_numpy(state.lr_factor))
        payload = self.adapter.capture()
        self.ring.add(Snapshot(steps_seen, payload, state, lr_factor))
        self._rolled_back_to_latest = False
        self.offending_steps = []
        path = None
        if self.disk is not None:
            tree = {
                "payload": self.adapter.to_host(payload),
                "guard_state": _host_tree(self.be, state),
                "lr_factor": lr_factor,
                "step": steps_seen,
            }
            path = self.disk.save(steps_seen, tree)
        self.log.emit("snapshot", steps_seen, lr_factor=lr_factor, path=path)

    def consume_skip_batch(self, steps_seen: int) -> bool:
        """True (and logged) while batches after a rollback are being skipped."""
        if self.skip_batches_left <= 0:
            return False
        self.skip_batches_left -= 1
        self.log.emit("skip_batch", steps_seen, remaining=self.skip_batches_left)
        return True

    def after_step(
        self, d: dict[str, Any], state: policy.GuardState, layers: Any = None, be: Any = None
    ) -> policy.GuardState:
        """Act on a decision read on the host (a dict of Python values); returns the guard
        state, changed when the step triggered a rollback. Call it after the step was
        applied (or skipped)."""
        step = int(d["step"])
        self.history.record(step, d["apply"], d["loss"], d["grad_norm"], layers, be)
        numbers = {
            "loss": d["loss"],
            "grad_norm": d["grad_norm"],
            "loss_z": d["loss_z"],
            "grad_norm_z": d["grad_norm_z"],
        }
        if not d["apply"]:
            self.skipped += 1
            self.offending_steps.append(step)
            self.log.emit("skip", step, reasons=policy.reason_names(d["reasons"]), **numbers)
        if d["rollback"]:
            return self.rollback(step, state, numbers)
        if d["snapshot"]:
            if self.defer_snapshots:
                self._pending = (step + 1, state)
            else:
                self.snapshot(step + 1, state)
        return state

    def take_pending_snapshot(self) -> None:
        """Take the snapshot that a deferred ``after_step`` found due, if any."""
        if self._pending is not None:
            steps_seen, state = self._pending
            self._pending = None
            self.snapshot(steps_seen, state)

    def rollback(self, step: int, state: policy.GuardState, numbers: dict) -> policy.GuardState:
        if self.guard.max_rollbacks is not None and self.rollbacks >= self.guard.max_rollbacks:
            self.log.emit("give_up", step, rollbacks=self.rollbacks, **numbers)
            raise NonFiniteError(
                f"numstab TrainingGuard: {self.rollbacks} rollbacks did not stabilise the run "
                f"(max_rollbacks={self.guard.max_rollbacks}); last bad step {step}, loss "
                f"{numbers['loss']}, grad norm {numbers['grad_norm']}. See the guard's log."
            )
        if self._rolled_back_to_latest:
            self.ring.drop_latest()  # the newest snapshot did not help: go one further back
        snap = self.ring.latest()
        if snap is None:
            raise NonFiniteError("numstab TrainingGuard: no snapshot to roll back to")
        self.adapter.restore(snap.payload)
        new_state = policy.rolled_back(self.guard, self.be, state, snap.guard_state)
        new_factor = float(self.be.to_numpy(new_state.lr_factor))
        self.adapter.scale_lr(new_factor / snap.lr_factor)
        self.rollbacks += 1
        self._rolled_back_to_latest = True
        self.skip_batches_left = self.guard.skip_after_rollback
        self.log.emit(
            "rollback",
            step,
            to_step=snap.step,
            lr_factor=new_factor,
            offending_steps=list(self.offending_steps),
            rollbacks=self.rollbacks,
            **numbers,
        )
        self.offending_steps = []
        return new_state

    def load_from_disk(self, step: int | None = None) -> tuple[int, policy.GuardState]:
        """Restore the adapter from the newest (or ``step``) snapshot file; returns
        ``(step, guard state)`` as saved, for resuming after a crash."""
        if self.disk is None:
            raise InvalidArgumentError("Expected a TrainingGuard with snapshot_dir set")
        step, tree = self.disk.load(step)
        self.adapter.restore(self.adapter.from_host(tree["payload"]))
        state = _state_from_host(self.be, tree["guard_state"])
        self.ring.add(Snapshot(step, self.adapter.capture(), state, float(tree["lr_factor"])))
        return step, state


def _host_tree(be: Backend, state: Any) -> Any:
    """A GuardState as nested dicts of NumPy arrays."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return {k: _host_tree(be, x) for k, x in state._asdict().items()}
    return be.to_numpy(state)


def _state_from_host(be: Backend, tree: dict) -> policy.GuardState:
    from numstab.guard.spikes import WindowState

    def arr(x: Any) -> Any:
        return be.asarray(x)

    return policy.GuardState(
        loss_window=WindowState(**{k: arr(x) for k, x in tree["loss_window"].items()}),
        grad_norm_window=WindowState(**{k: arr(x) for k, x in tree["grad_norm_window"].items()}),
        **{k: arr(x) for k, x in tree.items() if k not in ("loss_window", "grad_norm_window")},
    )
