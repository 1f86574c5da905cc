"""The guard's per-step decision, written once over backend primitives (jit-friendly).

    finite   = isfinite(loss) and isfinite(grad_norm)
    spike    = loss_spikes.score(loss) or grad_norm_spikes.score(grad_norm)
               (a step without a loss, or without a norm: that one's rules do not apply)
    apply    = finite and not spike                    # otherwise the step is skipped
    bad[t]   = not apply, kept for the last `rollback_window` steps; not a loss scaler's
               overflow (finite loss, gradients the scaler found non-finite): the scaler's
               to handle (it skips the step and backs off), routine while its scale comes down
    rollback = sum(bad) >= rollback_after              # the host restores the last snapshot
    snapshot = apply and (good steps since the last snapshot) == snapshot_every

The state (:class:`GuardState`) is a NamedTuple of arrays: a JAX pytree and a TF nest. The
host-side actions (restoring, writing snapshots, logging) live in ``numstab.guard.runner``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from numstab.backends._base import Backend
from numstab.guard.spikes import WindowState

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard

Array = Any

#: bit -> reason name; ``Decision.reasons`` is the sum of the bits that apply
REASONS = {1: "nonfinite_loss", 2: "nonfinite_grad", 4: "loss_spike", 8: "grad_norm_spike"}


def reason_names(bits: int) -> list[str]:
    """The names of the reasons set in ``bits`` (``Decision.reasons`` read on the host)."""
    return [name for bit, name in REASONS.items() if int(bits) & bit]


class GuardState(NamedTuple):
    """Everything the decision needs, as 0-d or 1-d arrays."""

    loss_window: WindowState
    grad_norm_window: WindowState
    bad_flags: Array  # int32 [rollback_window]: 1 where a recent step was skipped
    bad_position: Array  # int32: next slot of bad_flags
    good_since_snapshot: Array  # int32: applied steps since the last snapshot
    lr_factor: Array  # float32: product of the LR factors of every rollback so far
    step: Array  # int32: steps observed (applied or not)


class Decision(NamedTuple):
    """The verdict on one step (0-d arrays); the host reads it with one transfer."""

    apply: Array  # bool: take the optimizer step
    rollback: Array  # bool: restore the last good snapshot now
    snapshot: Array  # bool: this applied step completes snapshot_every good steps
    reasons: Array  # int32 bit set of REASONS (0 when applied)
    loss: Array  # float32
    grad_norm: Array  # float32 (NaN when no gradient norm was given)
    loss_z: Array  # float32 z-score of the loss (0 before warmup / without detector)
    grad_norm_z: Array  # float32
    step: Array  # int32: the index of this step
    layer_norms: Array | None = None  # float32 [layers] where the adapter computed them

    @property
    def reason_names(self) -> list[str]:
        """``reasons`` as names (reads the value: not inside jit / tf.function)."""
        return reason_names(int(self.reasons))

    def __repr__(self) -> str:
        """``Decision(step 7: skip [nonfinite_loss]; loss nan, grad_norm 3.2)``; the plain
        tuple form while the values are traced (unreadable)."""
        try:
            verdict = "apply" if bool(self.apply) else "skip " + str(self.reason_names)
            extra = ", rollback" if bool(self.rollback) else ""
            extra += ", snapshot" if bool(self.snapshot) else ""
            return (
                f"Decision(step {int(self.step)}: {verdict}{extra}; loss {float(self.loss):.4g},"
                f" grad_norm {float(self.grad_norm):.4g})"
            )
        except Exception:  # tracers (jit, tf.function) cannot be read
            fields = ", ".join(f"{k}={x!r}" for k, x in zip(self._fields, self, strict=True))
            return f"Decision({fields})"


def flatten_state(state: GuardState) -> list[Array]:
    """The state's arrays in field order, each window's three in its own."""
    return [x for leaf in state for x in (leaf if isinstance(leaf, tuple) else (leaf,))]


def unflatten_state(like: GuardState, flat: Iterable[Array]) -> GuardState:
    """``flatten_state``'s inverse: a state shaped as ``like`` holding ``flat``'s arrays."""
    it = iter(flat)
    return GuardState(
        *(
            type(leaf)(*(next(it) for _ in leaf)) if isinstance(leaf, tuple) else next(it)
            for leaf in like
        )
    )


def init_state(guard: TrainingGuard, be: Backend, like: Array | None = None) -> GuardState:
    import numpy as np

    def window(detector: Any) -> WindowState:
        # a disabled detector keeps a 2-slot window so that every state has one structure
        return (detector or _DISABLED).init(be, like)

    return GuardState(
        loss_window=window(guard.loss_spikes),
        grad_norm_window=window(guard.grad_norm_spikes),
        bad_flags=be.asarray(np.zeros(guard.rollback_window, np.int32), like=like),
        bad_position=be.asarray(np.int32(0), like=like),
        good_since_snapshot=be.asarray(np.int32(0), like=like),
        lr_factor=be.asarray(np.float32(1.0), like=like),
        step=be.asarray(np.int32(0), like=like),
    )


def scalar_input(be: Backend, name: str, x: Any, like: Array | None = None) -> Array:
    """A step's loss or norm as a 0-d float32 array of ``be``: a real number or a one-element
    floating or integer array (``scalar_array``). A bool, complex, float8, string, None or
    vector raises ``InvalidArgumentError`` naming ``name``, on every guard (a vector would
    broadcast against the state; a complex loss lost its imaginary part)."""
    from numstab._dispatch import scalar_array

    return be.cast(scalar_array(be, name, x, like), "float32")


def flag_input(be: Backend, name: str, x: Any, like: Array | None = None) -> Array:
    """A step's flag as a 0-d bool array of ``be``: a Python or NumPy bool, or a one-element
    bool array; anything else raises ``InvalidArgumentError`` naming ``name``."""
    from numstab._dispatch import same_framework, to_backend
    from numstab.errors import InvalidArgumentError

    if isinstance(x, bool) or hasattr(x, "dtype"):
        x = to_backend(be, same_framework(be, name, x), like=like, name=name)
        if be.dtype_name(x) == "bool" and all(n == 1 for n in be.shape(x)):
            return be.cast(be.reshape(x, ()), "bool")  # (a foreign array: this backend's)
    raise InvalidArgumentError(
        f"Expected {name} to be a bool or a one-element bool array. Received: {name}={x!r}"
    )


def state_shapes(guard: TrainingGuard) -> dict[str, tuple[int, ...]]:
    """The shape of every array of ``init_state(guard, ...)``, by its field path."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, detector in (
        ("loss_window", guard.loss_spikes),
        ("grad_norm_window", guard.grad_norm_spikes),
    ):
        shapes[f".{name}.values"] = (detector.window if detector else 2,)
        shapes[f".{name}.count"] = shapes[f".{name}.position"] = ()
    shapes[".bad_flags"] = (guard.rollback_window,)
    for name in GuardState._fields[3:]:
        shapes[f".{name}"] = ()
    return shapes


def check_state(guard: TrainingGuard, be: Backend, state: Any, name: str = "state") -> None:
    """``InvalidArgumentError`` unless ``state`` is a GuardState of ``be``'s arrays shaped as
    ``init_state(guard)`` makes them (static shapes: no host read). A state of a guard with
    other settings, or of another backend, failed deep in the decision with each framework's
    own error (a broadcast ValueError, a RuntimeError, an AttributeError)."""
    from numstab._dispatch import HOST, framework_of
    from numstab.errors import InvalidArgumentError

    if not isinstance(state, GuardState):
        raise InvalidArgumentError(
            f"Expected {name} to be a GuardState (TrainingGuard.init_state). Received: {name} "
            f"of type {type(state).__name__}"
        )
    framework = HOST if be.name == "numpy" else be.name
    for path, want in state_shapes(guard).items():
        x = state
        for field in path[1:].split("."):
            x = getattr(x, field, None)
        arrays = framework_of(x) == framework and hasattr(x, "shape")
        if not arrays or be.shape(x) != want:
            got = f"shape {be.shape(x)}" if arrays else f"type {type(x).__name__}"
            raise InvalidArgumentError(
                f"Expected {name} made by this guard's init_state on the {be.name} backend: "
                f"{name}{path} of shape {want}. Received: {got} (a state of another backend, "
                "or of a guard with other settings)"
            )


def decide(
    guard: TrainingGuard,
    be: Backend,
    state: GuardState,
    loss: Array | None,
    grad_norm: Array | None,
    *,
    scaler_overflow: Array | None = None,
) -> tuple[Decision, GuardState]:
    """One step's :class:`Decision` and the next state; ``grad_norm=None``: loss only;
    ``loss=None``: gradients only (a loop whose step has no loss to read: no loss rule is
    scored and the loss window is not pushed; ``Decision.loss`` is NaN). ``scaler_overflow``:
    a dynamic loss scaler found this step's gradients non-finite and handles it (a bool
    array; None: no scaler); with a finite loss the step is skipped but not counted as bad."""
    zero = be.asarray(0.0, dtype="float32", like=state.lr_factor)
    has_loss = loss is not None
    loss = be.cast(loss, "float32") if has_loss else zero
    norm = be.cast(grad_norm, "float32") if grad_norm is not None else zero
    finite_loss = be.isfinite(loss)
    finite_norm = be.isfinite(norm)
    no = zero > 1.0  # a 0-d False of the backend
    loss_z, loss_spike = (zero, no)
    norm_z, norm_spike = (zero, no)
    if guard.loss_spikes is not None and has_loss:
        loss_z, loss_spike = guard.loss_spikes.score(be, state.loss_window, loss)
    if guard.grad_norm_spikes is not None and grad_norm is not None:
        norm_z, norm_spike = guard.grad_norm_spikes.score(be, state.grad_norm_window, norm)
    apply = finite_loss & finite_norm & ~loss_spike & ~norm_spike
    reasons = (
        be.cast(~finite_loss, "int32")
        + 2 * be.cast(~finite_norm, "int32")
        + 4 * be.cast(loss_spike, "int32")
        + 8 * be.cast(norm_spike, "int32")
    )

    bad = ~apply
    if scaler_overflow is not None:
        bad = bad & ~(finite_loss & scaler_overflow)
    slot = be.arange(guard.rollback_window, like=state.bad_flags) == state.bad_position
    bad_flags = be.where(slot, be.cast(bad, "int32"), state.bad_flags)
    rollback = be.sum(bad_flags) >= guard.rollback_after
    good = state.good_since_snapshot + be.cast(apply, "int32")
    snapshot = apply & (good >= guard.snapshot_every)

    new_state = GuardState(
        loss_window=_push(
            be, guard.loss_spikes if has_loss else None, state.loss_window, loss, apply
        ),
        grad_norm_window=_push(
            be,
            guard.grad_norm_spikes if grad_norm is not None else None,
            state.grad_norm_window,
            norm,
            apply,
        ),
        bad_flags=be.cast(bad_flags, "int32"),
        bad_position=be.cast((state.bad_position + 1) % guard.rollback_window, "int32"),
        good_since_snapshot=be.cast(be.where(snapshot, 0, good), "int32"),
        lr_factor=state.lr_factor,
        step=be.cast(state.step + 1, "int32"),
    )
    decision = Decision(
        apply=apply,
        rollback=rollback,
        snapshot=snapshot,
        reasons=be.cast(reasons, "int32"),
        loss=loss if has_loss else zero + float("nan"),
        grad_norm=norm if grad_norm is not None else zero + float("nan"),
        loss_z=be.cast(loss_z, "float32"),
        grad_norm_z=be.cast(norm_z, "float32"),
        step=state.step,
    )
    return decision, new_state


def _push(be: Backend, detector: Any, window: WindowState, x: Array, apply: Array) -> WindowState:
    if detector is None:
        return window
    accept = apply | (be.isfinite(x) & detector.record_spikes)
    return detector.push(be, window, x, accept)


def rolled_back(
    guard: TrainingGuard, be: Backend, current: GuardState, snapshot: GuardState
) -> GuardState:
    """The state after a rollback to a snapshot taken with state ``snapshot``.

    The spike windows return to the snapshot's (the values seen since, spikes included, are
    forgotten); the bad-step window and the good-step count restart; the LR factor is the
    current one times ``guard.lr_factor``; ``step`` keeps counting.
    """
    return current._replace(
        loss_window=snapshot.loss_window,
        grad_norm_window=snapshot.grad_norm_window,
        bad_flags=current.bad_flags * 0,
        good_since_snapshot=current.good_since_snapshot * 0,
        lr_factor=be.cast(current.lr_factor * guard.lr_factor, "float32"),
    )


class _Disabled:
    def init(self, be: Backend, like: Array | None) -> WindowState:
        import numpy as np

        return WindowState(
            be.asarray(np.zeros(2, np.float32), like=like),
            be.asarray(np.int32(0), like=like),
            be.asarray(np.int32(0), like=like),
        )


_DISABLED = _Disabled()
