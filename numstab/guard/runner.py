"""The host side of a guard: the step history, the event log, snapshots and rollbacks, over
an :class:`Adapter` that each framework's guard code provides (numstab/frameworks/*/guard.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from numstab.backends._base import Backend
from numstab.errors import InvalidArgumentError, NonFiniteError
from numstab.guard import policy
from numstab.guard.events import EventLog
from numstab.guard.monitor import NormHistory
from numstab.guard.snapshots import Snapshot, SnapshotDirectory, SnapshotRing

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard


class Adapter(Protocol):
    """What a framework gives the runner."""

    def capture(self) -> Any: ...  # a copy of the training state (model, optimizer, ...)

    def restore(self, payload: Any) -> None: ...

    # multiply the learning rate: what ``restore`` put back by ``ratio``, what it kept as it
    # was (torch's param groups added after the snapshot) by ``ratio_now``
    def scale_lr(self, ratio: float, ratio_now: float) -> None: ...

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
        self._first_taken = False  # the first snapshot (at construction) has been taken

    # -- events ----------------------------------------------------------------------------------
    def snapshot(self, steps_seen: int, state: policy.GuardState) -> None:
        """Take a snapshot into the ring, and into ``snapshot_dir`` (``_to_disk``)."""
        lr_factor = float(self.be.to_numpy(state.lr_factor))
        payload = self.adapter.capture()
        self.ring.add(Snapshot(steps_seen, payload, state, lr_factor))
        self._rolled_back_to_latest = False
        self.offending_steps = []
        written: dict[str, str] = {}  # ``path`` only when written to disk (§16.7)
        if self._to_disk():
            tree = {
                "payload": self.adapter.to_host(payload),
                "guard_state": _host_tree(self.be, state),
                "lr_factor": lr_factor,
                "step": steps_seen,
            }
            written["path"] = self.disk.save(steps_seen, tree)  # type: ignore[union-attr]
        self.log.emit("snapshot", steps_seen, lr_factor=lr_factor, **written)

    def _to_disk(self) -> bool:
        """Whether this snapshot goes to ``snapshot_dir``: every one, except the first (the
        fresh state at construction) where the folder already holds snapshot files, those
        of an earlier run that the user may resume from (``load_from_disk``): before, the
        first snapshot overwrote an earlier run's ``snapshot-000000000.npz`` with the new
        process's fresh model, and ``keep_on_disk`` pruned it at once next to newer files."""
        first, self._first_taken = not self._first_taken, True
        return self.disk is not None and not (first and self.disk.steps())

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
        numbers = _numbers(d)
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

    def after_steps(
        self,
        decisions: list[dict[str, Any]],
        layers: list[Any] | None,
        be: Any,
        state: Callable[[], policy.GuardState],
        steps_seen: int,
    ) -> policy.GuardState | None:
        """Act on the decisions of several steps read together (``host_every`` > 1), oldest
        first: history and skips of every step; the first rollback among them (the later
        steps ran on the trajectory it discards: they are recorded and logged, nothing
        more); else a snapshot, taken now (``steps_seen``) if one fell due. ``state()``
        gives the current guard state (called only for a rollback or a snapshot). Returns
        the guard state after a rollback, else None. A give-up (``NonFiniteError``, no
        rollback left) is raised once the later steps are recorded too: they ran, and a
        loop that goes on after the error goes on from them (before, they were missing)."""
        rolled = None
        due = False
        rows = [None] * len(decisions) if layers is None else layers
        for i, d in enumerate(decisions):
            act = rolled is None
            self._record(d, rows[i], be)
            if act and d["rollback"]:
                try:
                    rolled = self.rollback(int(d["step"]), state(), _numbers(d))
                except NonFiniteError:  # gave up: the later steps ran all the same
                    for j in range(i + 1, len(decisions)):
                        self._record(decisions[j], rows[j], be)
                    raise
            due = due or (act and d["snapshot"])
        if due and rolled is None:
            if self.defer_snapshots:
                self._pending = (steps_seen, state())
            else:
                self.snapshot(steps_seen, state())
        return rolled

    def _record(self, d: dict[str, Any], layers: Any, be: Any) -> None:
        """A step's history and skip (``after_step`` without its rollback or snapshot)."""
        quiet = {**d, "rollback": False, "snapshot": False}
        self.after_step(quiet, None, layers, be)  # type: ignore[arg-type]

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
        factor_now = float(self.be.to_numpy(state.lr_factor))
        self.adapter.scale_lr(new_factor / snap.lr_factor, new_factor / factor_now)
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
        ``(step, guard state)`` as saved, for resuming after a crash.

        The ring then holds the loaded snapshot alone: a rollback never goes back past it
        (before, to the resuming process's first snapshot, its fresh model). A snapshot due
        (deferred), the skips after a rollback and the offending steps are forgotten."""
        if self.disk is None:
            raise InvalidArgumentError("Expected a TrainingGuard with snapshot_dir set")
        step, tree = self.disk.load(step)
        if not (isinstance(tree, dict) and tree.keys() >= {"payload", "guard_state", "lr_factor"}):
            raise InvalidArgumentError(
                f"Expected a guard snapshot in {self.disk.path(step)} (payload, guard_state, "
                f"lr_factor). Received: a {type(tree).__name__}"
            )
        # checked before anything is restored: a file of a guard with other settings (another
        # rollback_window) broke the next step with a broadcast error
        state = checked_state(self.guard, self.be, tree["guard_state"], "the snapshot's")
        self.adapter.restore(self.adapter.from_host(tree["payload"]))
        self.ring.clear()
        self.ring.add(Snapshot(step, self.adapter.capture(), state, float(tree["lr_factor"])))
        self._rolled_back_to_latest, self._pending = False, None
        self.offending_steps, self.skip_batches_left = [], 0
        return step, state

    # -- resuming from a training loop's checkpoint (the Trainer / Lightning callbacks) -------
    def resume_state(self, state: policy.GuardState) -> dict[str, Any]:
        """What a run resumed from a checkpoint needs to decide on its next steps as this run
        would: ``state`` (the snapshot files' ``_host_tree``, as lists and Python numbers:
        JSON-able, and loadable by ``torch.load(weights_only=True)``) and the counters; not
        the snapshots (copies of the model and optimizer, which the checkpoint holds)."""
        return {
            "guard_state": _plain(_host_tree(self.be, state)),
            "rollbacks": self.rollbacks,
            "skipped": self.skipped,
            "skip_batches_left": self.skip_batches_left,
            "offending_steps": list(self.offending_steps),
            "snapshot_due": self._pending is not None,
        }

    def resume(self, state: policy.GuardState, counters: dict[str, Any]) -> None:
        """Go on from ``resume_from_plain``'s ``(state, counters)``. The snapshots are
        replaced by one of the adapter's state now (the resumed model and optimizer), taken
        silently at ``state``'s step or, where one was due, when the next step starts (and
        logged then, as the run that saved the counters would have)."""
        self.rollbacks = counters["rollbacks"]
        self.skipped = counters["skipped"]
        self.skip_batches_left = counters["skip_batches_left"]
        self.ring.clear()
        self._rolled_back_to_latest = False
        step = int(self.be.to_numpy(state.step))
        self._pending = (step, state) if counters["snapshot_due"] else None
        if self._pending is None:
            factor = float(self.be.to_numpy(state.lr_factor))
            self.ring.add(Snapshot(step, self.adapter.capture(), state, factor))
        self.offending_steps = list(counters["offending_steps"])


def resume_from_plain(
    guard: TrainingGuard, be: Backend, saved: Any
) -> tuple[policy.GuardState, dict[str, Any]]:
    """The guard state (arrays of ``be``, with ``init_state``'s dtypes) and the counters of
    a ``GuardRunner.resume_state`` dict. ``InvalidArgumentError`` for anything else, and for
    the state of a guard with other settings (``check_state``: another ``rollback_window``
    or spike ``window``), as ``load_from_disk`` raises for such a snapshot file."""
    like = _host_tree(be, policy.init_state(guard, be))
    try:
        tree = _cast(saved["guard_state"], like)
        counters: dict[str, Any] = {
            k: int(saved[k]) for k in ("rollbacks", "skipped", "skip_batches_left")
        }
        counters["offending_steps"] = [int(s) for s in saved["offending_steps"]]
        counters["snapshot_due"] = bool(saved["snapshot_due"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"Expected a numstab guard's resume state (GuardRunner.resume_state). Received: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return checked_state(guard, be, tree, "the resumed"), counters


def checked_state(guard: TrainingGuard, be: Backend, tree: Any, whose: str) -> policy.GuardState:
    """A GuardState from its ``_host_tree``, checked to be one of ``guard``'s settings."""
    state = _state_from_host(be, tree)
    policy.check_state(guard, be, state, f"{whose} guard state")
    return state


def _plain(tree: Any) -> Any:
    """``_host_tree``'s arrays as lists (0-d: Python numbers)."""
    return {k: _plain(x) for k, x in tree.items()} if isinstance(tree, dict) else tree.tolist()


def _cast(tree: Any, like: Any) -> Any:
    """``_plain``'s inverse: NumPy arrays with the dtypes of ``like`` (a ``_host_tree``);
    KeyError where the keys differ, ValueError / TypeError where a value is no number."""
    import numpy as np

    if isinstance(like, dict):
        if not isinstance(tree, dict) or tree.keys() != like.keys():
            raise KeyError(f"fields {sorted(like)}")
        return {k: _cast(tree[k], x) for k, x in like.items()}
    return np.asarray(tree, dtype=like.dtype)


def _numbers(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in ("loss", "grad_norm", "loss_z", "grad_norm_z")}


def _host_tree(be: Backend, state: Any) -> Any:
    """A GuardState as nested dicts of NumPy arrays."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return {k: _host_tree(be, x) for k, x in state._asdict().items()}
    return be.to_numpy(state)


def _state_from_host(be: Backend, tree: dict) -> policy.GuardState:
    from numstab.guard.spikes import WindowState

    def arr(x: Any) -> Any:
        return be.asarray(x)

    try:
        return policy.GuardState(
            loss_window=WindowState(**{k: arr(x) for k, x in tree["loss_window"].items()}),
            grad_norm_window=WindowState(
                **{k: arr(x) for k, x in tree["grad_norm_window"].items()}
            ),
            **{k: arr(x) for k, x in tree.items() if k not in ("loss_window", "grad_norm_window")},
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidArgumentError(
            f"Expected a snapshot with the guard's state. Received: {type(exc).__name__}: {exc}"
        ) from None


def check_payload(
    payload: Any, keys: tuple[str, ...], framework: str, *, exact: bool = False
) -> None:
    """``InvalidArgumentError`` unless a snapshot file's payload holds ``keys`` (a file of
    another framework's guard otherwise); ``exact``: those and no others (the optax guard's
    ``extra``: a file with it loaded into a guard without it dropped the state silently)."""
    names = set(payload) if isinstance(payload, dict) else None
    if names is None or not (names == set(keys) if exact else names >= set(keys)):
        got = sorted(names) if names is not None else type(payload).__name__
        article = "an" if framework[:1] in tuple("aeiou") else "a"
        raise InvalidArgumentError(
            f"Expected a snapshot of {article} {framework} guard (payload {list(keys)}"
            f"{', exactly' if exact else ''}). Received: {got}"
        )


def check_fits(what: str, saved: list[tuple[str, Any]], current: list[tuple[str, tuple]]) -> None:
    """``InvalidArgumentError`` unless the ``(name, array)`` pairs of a snapshot file are the
    ``(name, shape)`` pairs of what it is restored into, in order: a file of another model
    (or optimizer) failed in the framework's own load (torch's RuntimeError, after loading
    the parameters that did fit) or loaded other shapes silently (optax)."""
    import numpy as np

    if len(saved) != len(current):
        raise InvalidArgumentError(
            f"Expected a snapshot of this {what}: {len(current)} arrays. Received: a file "
            f"with {len(saved)}"
        )
    for (name, value), (want_name, shape) in zip(saved, current, strict=True):
        if name != want_name or tuple(np.shape(value)) != tuple(shape):
            raise InvalidArgumentError(
                f"Expected a snapshot of this {what}: {want_name!r} of shape {tuple(shape)}. "
                f"Received: {name!r} of shape {tuple(np.shape(value))}"
            )


class RunnerResults:
    """``history`` and ``events`` of a framework adapter that holds a ``runner``."""

    runner: GuardRunner | None

    @property
    def history(self) -> Any:
        """The per-step history (``NormHistory``) the runner keeps."""
        return self._started().history

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event logged so far (skips, spikes, snapshots, rollbacks), as dicts."""
        return self._started().log.events

    def _started(self) -> GuardRunner:
        """The runner; ``InvalidArgumentError`` before training started (the Keras callback
        makes it in ``on_train_begin``), where ``None.history`` raised AttributeError."""
        if self.runner is None:
            raise InvalidArgumentError(
                f"Expected a {type(self).__name__} that has started: its history and events "
                "exist once training begins (model.fit with the callback)"
            )
        return self.runner
