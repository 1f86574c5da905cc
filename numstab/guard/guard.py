"""``TrainingGuard``: the settings, and the entry points to each framework's loop.

    guard = TrainingGuard(snapshot_every=100, rollback_after=3, lr_factor=0.5,
                          log_path="guard.jsonl")
    tg = guard.for_torch(model, optimizer)       # PyTorch loop  (numstab.frameworks.torch.guard)
    og = guard.for_optax()                       # optax loop    (numstab.frameworks.jax.guard)
    cb = guard.keras_callback()                  # model.fit     (numstab.frameworks.keras.guard)

Per step: the decision of ``numstab.guard.policy`` (non-finite loss or gradient, or a spike:
skip; ``rollback_after`` bad steps within ``rollback_window``: roll back). The runner
(``numstab.guard.runner``, shared by every framework's adapter) then acts on the host: it
records the history, logs every action as a JSON line, takes a snapshot every
``snapshot_every`` good steps (memory ring, and ``snapshot_dir`` on disk), and on a rollback
restores the newest snapshot (one further back if it rolled back to it already without a new
snapshot since), multiplies the learning rate by ``lr_factor`` and skips the next
``skip_after_rollback`` batches. More than ``max_rollbacks`` rollbacks raise
``NonFiniteError``: the run does not recover, a person should look.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from numstab import _validate as v
from numstab import frameworks
from numstab.backends import canonical_name, load_backend
from numstab.backends._base import Backend
from numstab.errors import InvalidArgumentError
from numstab.guard import policy
from numstab.guard.events import EventLog
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
      max_rollbacks: raise NonFiniteError at the rollback after this many (None: never);
        the step is counted and recorded all the same, so a loop that catches the error
        and goes on numbers its next step one higher.
      snapshot_dir: also write every snapshot there as ``snapshot-<step>.npz`` (atomic);
        ``keep_on_disk`` newest files are kept. The first snapshot (at the start) stays in
        memory where the folder holds snapshot files already (an earlier run's, to resume
        from with ``load_snapshot``); a file written removes those of later steps.
      log_path, log_callback: where each action goes as a JSON object (file: one per line).
      track_layers: keep per-layer gradient norms in the history (torch, optax).
      host_every: how often the host reads the guard's decisions (int >= 1). 1 (default):
        every step, and the host decides (one read per step). k > 1: the steady step stays
        on the device (the decision and the skip, torch and optax) and the host reads the
        accumulated decisions every k steps (and at ``flush()``): the log, the history,
        snapshots and rollbacks happen then, events with the step they happened at.
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
    host_every: int = 1

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
            ("host_every", 1),
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
        v.check_bool("track_layers", self.track_layers)
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
        scaler: Any = None,
    ) -> Any:
        """A :class:`numstab.frameworks.torch.guard.TorchGuard` for a PyTorch loop; under
        ``torch.distributed`` every rank decides on the mean loss and the global norm.
        ``scaler``: the loop's ``torch.amp.GradScaler``, whose overflows (while enabled) are
        skipped without counting toward a rollback."""
        return frameworks.module("torch", "guard").TorchGuard(
            self,
            model,
            optimizer,
            scheduler=scheduler,
            sharded=sharded,
            process_group=process_group,
            scaler=scaler,
        )

    def for_optax(self) -> Any:
        """A :class:`numstab.frameworks.jax.guard.OptaxGuard` for a functional optax loop."""
        return frameworks.module("jax", "guard").OptaxGuard(self)

    def for_keras(self) -> Any:
        """A :class:`numstab.frameworks.keras.guard.GuardCallback` for ``model.fit``; with
        ``host_every`` > 1, its device-side subclass for the Keras backend
        (``numstab.frameworks.keras.guard_device`` on TensorFlow, ``guard_arrays`` on JAX
        and torch)."""
        return frameworks.module("keras", "guard_arrays").callback(self)

    keras_callback = for_keras  # the earlier name

    # -- the pure decision, on any backend -----------------------------------------------------
    def init_state(self, be: Backend | str = "numpy", like: Any = None) -> policy.GuardState:
        return policy.init_state(self, _backend(be), like)

    def decide(
        self,
        state: policy.GuardState,
        loss: Any,
        grad_norm: Any,
        be: Backend | str = "numpy",
        *,
        scaler_overflow: Any = None,
    ) -> tuple[policy.Decision, policy.GuardState]:
        """The decision on one step from its scalar ``loss`` and ``grad_norm`` (None: no
        gradient check): numbers or one-element float arrays of ``be``. ``scaler_overflow``:
        whether a dynamic loss scaler found this step's gradients non-finite (a bool or a
        0-d bool array; None: no scaler): such a step is skipped, not counted toward a
        rollback."""
        be = _backend(be)
        policy.check_state(self, be, state)
        like = state.step
        loss = policy.scalar_input(be, "loss", loss, like)
        if grad_norm is not None:
            grad_norm = policy.scalar_input(be, "grad_norm", grad_norm, like)
        if scaler_overflow is not None:
            scaler_overflow = policy.flag_input(be, "scaler_overflow", scaler_overflow, like)
        return policy.decide(self, be, state, loss, grad_norm, scaler_overflow=scaler_overflow)


def _backend(be: Backend | str) -> Backend:
    """A backend object, or its name (aliases too: ``"pytorch"``, ``"tf"``; anything else
    raises UnknownBackendError, as ``set_backend`` does)."""
    return be if isinstance(be, Backend) else load_backend(canonical_name(be))
