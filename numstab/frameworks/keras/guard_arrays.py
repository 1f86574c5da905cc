"""The Keras guard callback with ``TrainingGuard(host_every=k)``, k > 1, on Keras' JAX and torch
backends, and :func:`callback`, which picks the guard's callback for the running backend.

The hooks are ``guard_deferred.py``'s. The per-batch work is :func:`device_step`, a pure
function of the variables' values, the undo copy and the guard state (arrays of the
backend): the batch's loss from the loss tracker, the update norms, ``policy.decide`` on the
backend, and, per variable, ``where(apply, value, undo copy)``: the kept values, which the
undo copy becomes. On JAX it runs under ``jax.jit`` (the undo copy donated; its outputs are
buffers apart from the kept values, which Keras donates to its next train step), reads
Keras' training state where Keras keeps it between steps, and hands the kept values to
Keras' next train step (``model.train_function`` wrapped for the length of a ``fit``), so a
steady batch assigns no variable; the variables get them before the runner reads or writes
them (every k steps) and where Keras holds its state in them (the epoch's end). On torch it
is one call compiled by inductor (:func:`_torch_check`; asynchronous on a GPU) that writes
the kept values into the variables' tensors. Neither reads the host: each step's row stays
on the device until the k-step read stacks them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from numstab.backends import load_backend
from numstab.backends._base import Backend
from numstab.errors import NumstabError
from numstab.frameworks.keras.guard import GuardCallback
from numstab.frameworks.keras.guard_deferred import DeferredGuardCallback
from numstab.guard import policy
from numstab.guard.deferred import ROW_COLUMNS
from numstab.guard.monitor import layer_norms


def callback(guard: Any) -> GuardCallback:
    """The guard's callback: with ``host_every`` > 1 the device-side one of the running Keras
    backend (TensorFlow: ``guard_device.py``; JAX, torch: :class:`ArrayGuardCallback`)."""
    backend = keras.backend.backend()
    if guard.host_every > 1 and backend == "tensorflow":
        from numstab.frameworks.keras.guard_device import DeviceGuardCallback

        return DeviceGuardCallback(guard)
    if guard.host_every > 1 and backend in ("jax", "torch"):
        return ArrayGuardCallback(guard)
    return GuardCallback(guard)


def device_step(
    guard: Any,
    be: Backend,
    values: list[Any],
    undo: list[Any],
    state: policy.GuardState,
    tracker_at: list[int],
    weight_at: list[int],
    fresh_at: tuple[int, ...] = (),
) -> tuple[list[Any], policy.GuardState, Any]:
    """One batch's check on the device: ``(kept values, next guard state, row)``.

    loss  = (total - total') / (count - count'), the loss tracker now and in ``undo``
            (0 where the count did not grow, as ``tf.math.divide_no_nan``);
    norms = ||w - w'|| per trainable variable (the composite, which a compiler fuses),
            their global norm (None without one);
    kept  = where(decision.apply, values, undo), per variable; ``values`` at ``fresh_at``
            (the learning rate: a step does not change it, a callback may have set it
            since the undo copy was taken), as ``where(apply, values, values)``;
    row   = the Decision's fields in ``ROW_COLUMNS`` (no step: the host counts steps) as
            float32, then the per-variable norms.
    """

    def f32(x: Any) -> Any:
        return be.cast(x, "float32")

    (t, c), (ut, uc) = ([f32(v[j]) for j in tracker_at] for v in (values, undo))
    grown = (c - uc) > 0
    loss = be.where(grown, (t - ut) / be.where(grown, c - uc, 1.0), 0.0)
    deltas = [f32(values[j]) - f32(undo[j]) for j in weight_at]
    norms, total = layer_norms(be, deltas, compiled=True)
    decision, state = policy.decide(guard, be, state, loss, total if deltas else None)
    undo = [values[j] if j in fresh_at else u for j, u in enumerate(undo)]
    kept = [be.where(decision.apply, v, u) for v, u in zip(values, undo, strict=True)]
    row = be.concat([be.stack([f32(getattr(decision, k)) for k in ROW_COLUMNS]), f32(norms)])
    return kept, state, row


class ArrayGuardCallback(DeferredGuardCallback):
    """:class:`GuardCallback` whose steady batch stays on the device (Keras on JAX, torch).

    On JAX the guard state is packed in two arrays (``numstab.frameworks.jax.guard_state``)
    where it lives on an accelerator, as the optax guard's: ``pack_state`` None; True or
    False forces it."""

    pack_state: bool | None = None

    def _start_device(self) -> None:
        # GuardCallback._set_up made the undo copy (self._shadow) of these variables
        backend = keras.backend.backend()
        self._be = load_backend(backend)
        if getattr(self, "_gstate", None) is None:  # (a later fit: in step with the host's)
            self._set_device_state(self.state)
        self._rows: list[Any] = getattr(self, "_rows", [])
        self._values = _value_reader(self._state_vars + self._metric_vars)
        self._hand_on()
        at = (self._tracker_at, self._weight_at, tuple(sorted(self._lr_at)))
        if getattr(self, "_fn_for", None) == at:  # a later fit() of the same variables
            return
        self._fn_for, args = at, (self.guard, self._be)
        if backend == "jax":
            import jax

            from numstab.frameworks.jax.guard_state import like, unpacked

            def run(values: list, undo: list, gstate: Any) -> tuple:
                kept, state, row = device_step(*args, values, undo, unpacked(gstate), *at)
                # two buffers each of the kept values: the variables', the undo copy's
                return kept, list(kept), like(gstate, state), row

            self._fn = jax.jit(run, donate_argnums=(1,))
        else:
            self._fn = _torch_check(self.guard, self._be, at)

    def _device_check(self, i: int) -> None:
        state = self._training_state()  # None: Keras holds its state in the variables
        if state is not None and self._fused is not None and i + 1 < self.guard.host_every:
            self._armed = True  # Keras' next train step checks first (no read follows)
            return
        values = self._values() if state is None else [state[k][j] for k, j in self._jax_at]
        kept, self._shadow, self._gstate, row = self._fn(values, self._shadow, self._gstate)
        self._rows.append(row)
        if kept is None:  # torch: the check wrote the kept values into the variables
            return
        if state is not None:  # Keras' next train step is handed the kept values
            self._kept_for_next_step = (values, kept)
            return
        self._assign(kept)

    def _assign(self, kept: list[Any]) -> None:
        for var, x in zip(self._state_vars + self._metric_vars, kept, strict=True):
            var.assign(x)
        self._synced()

    def flush(self) -> None:
        # the runner reads the variables (a snapshot) and writes them (a rollback, the
        # learning rate): they get the kept values first
        kept, self._kept_for_next_step = self._kept_for_next_step, None
        if kept is not None:
            self._assign(kept[1])
        super().flush()

    # -- Keras on JAX: its training state, read and handed on without the variables ----------
    def _to_variables(self) -> None:
        if self._jax_at is None:  # (on JAX the check reads and hands on Keras' state)
            super()._to_variables()

    def _training_state(self) -> dict | None:
        """On JAX while the kept values are handed on, the state Keras trains on where it
        has not been written back to the variables; else None (the variables hold it)."""
        return self._unsynced_jax_state() if self._handing_on else None

    def _hand_on(self) -> None:
        """From now until the end of ``fit``, ``model.train_function`` is wrapped: Keras' next
        train step takes the kept values of the last check in place of the values the check
        read (Keras' fit loop passes each step's state on to the next without the variables;
        assigning every variable and making Keras read them all back is Python work per
        variable and batch on the host). Where Keras runs one jitted step per call, the
        check itself runs inside that step (:meth:`_fused_step`), except where a read
        follows it."""
        model = self._model
        if getattr(self, "_armed", False):  # a fit cut short before its step: no row came
            self._pending -= 1
        self._kept_for_next_step, self._armed = None, False
        self._handing_on = self._jax_at is not None and model.train_function is not None
        self._fused = self._fused_step() if self._handing_on else None
        if self._handing_on and model.train_function != self._train_with_kept_values:
            self._train_function = model.train_function  # (else still ours: a fit cut short)
            model.train_function = self._train_with_kept_values

    def _fused_step(self) -> Any:
        """``(state, data, undo, guard state) -> (logs, state, undo, guard state, row)``: the
        check of the last step, then Keras' ``train_step`` on the kept values, in one
        ``jax.jit`` (the state and the undo copy donated): one dispatch, and the select
        fuses into the optimizer's update. None where Keras would not jit one step per
        call (``steps_per_execution``, ``run_eagerly``, a distribution, NNX)."""
        model = self._model
        if (
            model.steps_per_execution != 1
            or model.run_eagerly
            or not model.jit_compile
            or keras.distribution.distribution() is not None
            or getattr(keras.config, "is_nnx_enabled", lambda: False)()  # (absent in older Keras 3)
        ):
            return None
        guard, be, places = self.guard, self._be, self._jax_at
        at = (self._tracker_at, self._weight_at, tuple(sorted(self._lr_at)))
        train_step = model.train_step
        key = (model, train_step, *map(tuple, (places, *at)))  # a recompile moves them
        cached = getattr(self, "_fused_for", (None, None))
        if cached[0] == key:
            return cached[1]
        import jax

        from numstab.frameworks.jax.guard_state import like, unpacked

        def step(state: Any, data: Any, undo: list, gstate: Any) -> tuple:
            values = [state[_SLOT[key]][j] for key, j in places]
            kept, new, row = device_step(guard, be, values, undo, unpacked(gstate), *at)
            logs, state = train_step(_placed(state, places, kept), data)
            return logs, state, kept, like(gstate, new), row

        fused = jax.jit(step, donate_argnums=(0, 2))
        self._fused_for = (key, fused)
        return fused

    def _train_with_kept_values(self, state: Any, data: Any) -> Any:
        """``model.train_function`` while the guard is on: the kept values in ``state`` where
        it still holds the very arrays the check read (where something wrote the variables
        since, a rollback or the user, Keras read them back and they win, as when the
        check assigned the variables itself)."""
        if self._armed:  # the check and the step in one call (Keras' iterator_step's way)
            self._armed = False
            out = self._fused(state, next(data), self._shadow, self._gstate)
            logs, state, self._shadow, self._gstate, row = out
            self._rows.append(row)
            return logs, state
        kept, self._kept_for_next_step = self._kept_for_next_step, None
        if kept is not None:
            state = _placed(state, self._jax_at, kept[1], read=kept[0])
        return self._train_function(state, data)

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)
        self._handing_on, self._kept_for_next_step = False, None
        if self._model.train_function == self._train_with_kept_values:
            self._model.train_function = self._train_function

    def _synced(self) -> None:
        """The variables hold the state: Keras on JAX reads them at its next step (and its
        own sync at the epoch's end does not overwrite them)."""
        if self._jax_at is not None:
            self._model._jax_state_synced = True

    def _undo(self) -> None:
        super()._to_variables()
        super()._undo()
        self._synced()

    def _read_rows(self, n: int) -> Any:
        rows, self._rows = self._rows[-n:], []
        if keras.backend.backend() == "jax":  # one dispatch for the n rows
            from numstab.frameworks.jax.guard import stack_trees

            return np.asarray(stack_trees(rows), np.float32)
        return np.asarray(ops.convert_to_numpy(ops.stack(rows)), np.float32)

    def _device_state(self) -> policy.GuardState:
        gstate = self._gstate
        if keras.backend.backend() == "jax":
            from numstab.frameworks.jax.guard_state import unpacked

            gstate = unpacked(gstate)
        return keras.tree.map_structure(ops.convert_to_numpy, gstate)

    def _set_device_state(self, state: policy.GuardState) -> None:
        # copies: torch's check updates these tensors in place, and torch.as_tensor would
        # share the host state's memory (the runner's, its snapshots')
        gstate = keras.tree.map_structure(lambda x: self._be.asarray(np.array(x)), state)
        if keras.backend.backend() == "jax":
            from numstab.frameworks.jax.guard_state import choose_packing, packed

            if choose_packing("pack_state", self.pack_state, gstate):
                gstate = packed(gstate)
        self._gstate = gstate

    def _keep_as_undo(self) -> None:
        self._shadow = self._copy_state()

    def _keep_metrics_as_undo(self) -> None:
        self._shadow[len(self._state_vars) :] = self._copy_metrics()


def _value_reader(variables: list[Any]) -> Callable[[], list[Any]]:
    """A function that reads the variables' values, once a batch. On torch, each variable's
    tensor (``_value``, which Keras' assign writes into with ``copy_``) where it is what
    ``.value`` hands out here (no autocast scope, no meta device): ``.value`` makes those
    checks for every variable, ~1 us each, a third of the check's host time."""
    if keras.backend.backend() == "torch" and all(
        getattr(v, "_value", None) is not None and v.value is v._value for v in variables
    ):
        return lambda: [v._value for v in variables]  # (0.6 us: read each batch)
    return lambda: [v.value for v in variables]


def _torch_check(guard: Any, be: Backend, at: tuple) -> Any:
    """The check on Keras' torch backend: one call, compiled by inductor per set of shapes
    (``guard_compiled.compiled_or_eager``: eager where torch cannot compile), that writes
    the kept values into the variables' tensors and the undo copy (Keras' own assign is a
    ``copy_`` into them) and the next guard state into its tensors; returns
    ``(None, undo, state, row)``, the arguments updated in place."""
    import torch

    from numstab.frameworks.torch.guard_compiled import compiled_or_eager, write_back

    fns: dict[tuple, Any] = {}  # by the arguments' shapes, dtypes and devices
    last: list[Any] = [(), None]  # the last call's arguments and function

    def run(values: list, undo: list, state: policy.GuardState) -> tuple:
        n, flat = len(values), policy.flatten_state(state)

        def check(*args: torch.Tensor) -> torch.Tensor:
            values, undo = list(args[:n]), list(args[n : 2 * n])
            new_state = policy.unflatten_state(state, args[2 * n :])
            kept, new_state, row = device_step(guard, be, values, undo, new_state, *at)
            write_back(values, kept)
            write_back(undo, kept)
            write_back(list(args[2 * n :]), policy.flatten_state(new_state))
            return row

        args = [*values, *undo, *flat]
        # the same tensors as the last call (steady batches: Keras and the check update
        # them in place) need no new look-up, which costs ~30 us for ~80 tensors
        fn = last[1]
        if len(args) != len(last[0]) or not all(map(operator.is_, args, last[0])):
            shapes = (n, *((t.shape, t.dtype, t.device) for t in args))
            if shapes not in fns:
                constants = (guard.loss_spikes, guard.grad_norm_spikes, guard.rollback_window)
                key = ("keras_check", *constants, guard.rollback_after, guard.snapshot_every)
                fns[shapes] = compiled_or_eager((*key, tuple(map(tuple, at))), check, args)
            fn = fns[shapes]
            last[:] = args, fn
        with torch.no_grad():
            row = fn(*args)
        return None, undo, state, row

    return run


_STATE_KEYS = (
    "trainable_variables",
    "non_trainable_variables",
    "optimizer_variables",
    "metrics_variables",
)


def _placed(
    state: Any, places: list[tuple[str, int]], kept: list[Any], read: list[Any] | None = None
) -> tuple:
    """Keras' JAX training state (its four lists, in ``_STATE_KEYS`` order) with ``kept[i]``
    at ``places[i]``; given ``read``, only where the state still holds ``read[i]``, the
    array the check read."""
    if not (isinstance(state, tuple | list) and len(state) == len(_STATE_KEYS)):
        raise NumstabError(
            "TrainingGuard(host_every > 1) on Keras' JAX backend expected Keras' training "
            f"state as {len(_STATE_KEYS)} lists ({', '.join(_STATE_KEYS)}), the way Keras "
            f"3.15 passes it to its train step; received a {type(state).__name__}. Use "
            "host_every=1 with this Keras."
        )
    lists = [list(x) for x in state]
    for i, (key, j) in enumerate(places):
        values = lists[_SLOT[key]]
        if read is None or values[j] is read[i]:
            values[j] = kept[i]
    return tuple(lists)


_SLOT = {key: i for i, key in enumerate(_STATE_KEYS)}
