"""The Keras guard callback with ``TrainingGuard(host_every=k)``, k > 1, on Keras' JAX and torch
backends, and :func:`callback`, which picks the guard's callback for the running backend.

The hooks are ``guard_deferred.py``'s. The per-batch work is :func:`device_step`, a pure
function of the variables' values, the undo copy and the guard state (arrays of the
backend): the batch's loss from the loss tracker, the update norms, ``policy.decide`` on the
backend, and, per variable, ``where(apply, value, undo copy)``: the variables get the kept
values and the undo copy becomes them. On JAX it runs under ``jax.jit`` (the undo copy
donated; its outputs are buffers apart from the variables', which Keras donates to its next
train step); on torch as eager torch ops under ``no_grad`` (asynchronous on a GPU). Neither
reads the host: each step's row stays on the device until the k-step read stacks them.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from numstab.backends import load_backend
from numstab.backends._base import Backend
from numstab.frameworks.keras.guard import GuardCallback, _copy
from numstab.frameworks.keras.guard_deferred import FIELDS, DeferredGuardCallback
from numstab.guard import policy
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
) -> tuple[list[Any], policy.GuardState, Any]:
    """One batch's check on the device: ``(kept values, next guard state, row)``.

    loss  = (total - total') / (count - count'), the loss tracker now and in ``undo``
            (0 where the count did not grow, as ``tf.math.divide_no_nan``);
    norms = ||w - w'|| per trainable variable, their global norm (None without one);
    kept  = where(decision.apply, values, undo), per variable;
    row   = the Decision's fields (``FIELDS``) as float32, then the per-variable norms.
    """

    def f32(x: Any) -> Any:
        return be.cast(x, "float32")

    (t, c), (ut, uc) = ([f32(v[j]) for j in tracker_at] for v in (values, undo))
    grown = (c - uc) > 0
    loss = be.where(grown, (t - ut) / be.where(grown, c - uc, 1.0), 0.0)
    deltas = [f32(values[j]) - f32(undo[j]) for j in weight_at]
    norms, total = layer_norms(be, deltas)
    decision, state = policy.decide(guard, be, state, loss, total if deltas else None)
    kept = [be.where(decision.apply, v, u) for v, u in zip(values, undo, strict=True)]
    row = be.concat([be.stack([f32(getattr(decision, k)) for k in FIELDS]), f32(norms)])
    return kept, state, row


class ArrayGuardCallback(DeferredGuardCallback):
    """:class:`GuardCallback` whose steady batch stays on the device (Keras on JAX, torch)."""

    def _start_device(self) -> None:
        # GuardCallback.on_train_begin made the undo copy (self._shadow) of these variables
        backend = keras.backend.backend()
        self._be = load_backend(backend)
        self._set_device_state(self.state)
        self._rows: list[Any] = getattr(self, "_rows", [])
        self._jax_at = _jax_state_places(self.model, self._state_vars + self._metric_vars)
        if getattr(self, "_fn", None) is not None:  # a later fit(): compiled already
            return
        args = (self.guard, self._be)
        at = (self._tracker_at, self._weight_at)
        if backend == "jax":
            import jax

            def run(values: list, undo: list, state: policy.GuardState) -> tuple:
                kept, state, row = device_step(*args, values, undo, state, *at)
                return kept, list(kept), state, row  # two buffers each: variables, undo

            self._fn = jax.jit(run, donate_argnums=(1,))
        else:
            import torch

            def run(values: list, undo: list, state: policy.GuardState) -> tuple:
                with torch.no_grad():
                    kept, state, row = device_step(*args, values, undo, state, *at)
                return kept, kept, state, row  # the variables copy the kept values in

            self._fn = run

    def _device_check(self, i: int) -> None:
        variables = self._state_vars + self._metric_vars
        kept, self._shadow, self._gstate, row = self._fn(self._values(), self._shadow, self._gstate)
        for var, x in zip(variables, kept, strict=True):
            var.assign(x)
        self._synced()
        self._rows.append(row)

    # -- Keras on JAX: its training state, read without first writing it to the variables ----
    def _sync(self) -> None:
        if self._jax_at is None:
            super()._sync()

    def _values(self) -> list[Any]:
        """The variables' values; on JAX, from the state Keras trains on (``_jax_state``)
        where it has not been written back to the variables."""
        model = self._model  # Callback.model would write the state to the variables first
        state = getattr(model, "_jax_state", None)
        if self._jax_at is None or not state or getattr(model, "_jax_state_synced", True):
            return [v.value for v in self._state_vars + self._metric_vars]
        return [state[key][j] for key, j in self._jax_at]

    def _synced(self) -> None:
        """The variables hold the state: Keras on JAX reads them at its next step (and its
        own sync at the epoch's end does not overwrite them)."""
        if self._jax_at is not None:
            self._model._jax_state_synced = True

    def _undo(self) -> None:
        super()._sync()
        super()._undo()
        self._synced()

    def _read_rows(self, n: int) -> Any:
        rows, self._rows = self._rows[-n:], []
        return np.asarray(ops.convert_to_numpy(ops.stack(rows)), np.float32)

    def _device_state(self) -> policy.GuardState:
        return keras.tree.map_structure(ops.convert_to_numpy, self._gstate)

    def _set_device_state(self, state: policy.GuardState) -> None:
        self._gstate = keras.tree.map_structure(lambda x: self._be.asarray(np.asarray(x)), state)

    def _keep_as_undo(self) -> None:
        self._shadow = _copy(self._state_vars + self._metric_vars)

    def _keep_metrics_as_undo(self) -> None:
        self._shadow[len(self._state_vars) :] = _copy(self._metric_vars)


def _jax_state_places(model: Any, variables: list[Any]) -> list[tuple[str, int]] | None:
    """Where each variable sits in Keras' JAX training state (``model._jax_state``, whose
    lists follow these four variable lists), or None off JAX or where one is missing."""
    if keras.backend.backend() != "jax" or not hasattr(model, "jax_state_sync"):
        return None
    lists = {
        "trainable_variables": model.trainable_variables,
        "non_trainable_variables": model.non_trainable_variables,
        "optimizer_variables": model.optimizer.variables,
        "metrics_variables": model.metrics_variables,
    }
    where = {id(v): (key, j) for key, vs in lists.items() for j, v in enumerate(vs)}
    places = [where.get(id(v)) for v in variables]
    return None if None in places else places
