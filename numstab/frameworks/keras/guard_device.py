"""The Keras guard callback with ``TrainingGuard(host_every=k)``, k > 1, on TensorFlow.

The hooks are ``guard_deferred.py``'s. Here the per-batch work runs as ONE compiled
TensorFlow function (``tf.function``) on the variables, with no host read: the undo copy
lives in TF variables, a bad step is put back with ``tf.cond`` (a good step copies the state
once, a bad one twice) and every step's decision is written to a ``[k, ...]`` variable that
the host reads every k steps. The function takes no argument: the row it writes is a TF
variable it advances itself (reset when the host reads the rows), since a tf.function call
with a tensor argument costs ~85 us more on the CPU than one without (Python-side argument
handling), a third of the guard's own cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from numstab.backends import load_backend
from numstab.frameworks.keras.guard_deferred import FIELDS, DeferredGuardCallback
from numstab.guard import policy
from numstab.guard.spikes import WindowState


class DeviceGuardCallback(DeferredGuardCallback):
    """:class:`GuardCallback` whose steady batch stays on the device (TensorFlow)."""

    _host_undo_copy = False  # the undo copy lives in TF variables; the loss from the tracker

    def _start_device(self) -> None:
        everything = self._state_vars + self._metric_vars
        if getattr(self, "_fn", None) is not None:  # a later fit(): the same variables
            self._keep_as_undo()
            return
        self._shadow_vars = [tf.Variable(v.value, trainable=False) for v in everything]
        self._gstate = tf.nest.map_structure(
            lambda x: tf.Variable(np.asarray(x)), tuple(self.state)
        )
        width = len(FIELDS) + len(self._weights)
        self._rows = tf.Variable(tf.zeros((self.guard.host_every, width), tf.float32))
        # the row the next check writes: always equal to ``self._pending``
        self._slot = tf.Variable(tf.zeros((1,), tf.int32), trainable=False)
        self._fn = tf.function(self._device_step, jit_compile=False, autograph=False)
        self._keep = tf.function(self._copy_to_undo, autograph=False)  # one call, not 34 ops

    def _keep_metrics_as_undo(self) -> None:
        n = len(self._state_vars)
        for var, shadow in zip(self._metric_vars, self._shadow_vars[n:], strict=True):
            shadow.assign(var.value)

    def _keep_as_undo(self) -> None:
        self._keep()

    def _copy_to_undo(self) -> None:
        everything = self._state_vars + self._metric_vars
        for var, shadow in zip(everything, self._shadow_vars, strict=True):
            shadow.assign(var.value)

    def _device_check(self, i: int) -> None:
        self._fn()  # writes row i: the slot variable holds i (no argument, see above)

    def _device_step(self) -> None:
        """The next pending step (row ``self._slot``): decide, undo a bad step, keep the state
        as the undo copy, write the step's row and advance the slot."""
        everything = self._state_vars + self._metric_vars
        shadow = self._shadow_vars
        (t, c), (st, sc) = (
            [tf.cast(everything[j].value, tf.float32) for j in self._tracker_at],
            [tf.cast(shadow[j], tf.float32) for j in self._tracker_at],
        )
        loss = tf.math.divide_no_nan(t - st, c - sc)
        deltas = [
            tf.norm(tf.cast(everything[j].value, tf.float32) - tf.cast(shadow[j], tf.float32))
            for j in self._weight_at
        ]
        layers = tf.stack(deltas) if deltas else tf.zeros((0,), tf.float32)
        norm = tf.sqrt(tf.reduce_sum(layers * layers)) if deltas else None
        state = tf.nest.map_structure(lambda v: v.read_value(), self._gstate)
        decision, new = policy.decide(
            self.guard, load_backend("tensorflow"), policy.GuardState(*state), loss, norm
        )
        tf.nest.map_structure(lambda v, x: v.assign(x), self._gstate, tuple(new))
        pairs = list(zip(everything, shadow, strict=True))

        def undo() -> tf.Tensor:  # a bad step: put the copy back
            return tf.group([v.assign(s) for v, s in pairs])

        # then the state becomes the undo copy (after an undo: the copy onto itself). One
        # branch of copies, not a cond with a copy in each: half the graph's nodes, and a
        # good step still copies the state once.
        tf.cond(decision.apply, tf.no_op, undo)
        for v, s in pairs:  # ordered after the cond: both touch v's and s's resources
            s.assign(v.value)
        row = [tf.cast(getattr(decision, k), tf.float32) for k in FIELDS]
        slot = self._slot.read_value()
        self._rows.scatter_update(
            tf.IndexedSlices(tf.concat([tf.stack(row), layers], 0)[None], slot)
        )
        self._slot.assign(slot + 1)

    def _read_rows(self, n: int) -> Any:
        rows = self._rows[:n].numpy()
        self._slot.assign(tf.zeros((1,), tf.int32))  # flush() set _pending to 0
        return rows

    def _set_device_state(self, state: policy.GuardState) -> None:
        for v, x in zip(tf.nest.flatten(self._gstate), tf.nest.flatten(tuple(state)), strict=True):
            v.assign(np.asarray(x))

    def _device_state(self) -> policy.GuardState:
        """Read in two transfers (its float32 and its int32 leaves, each concatenated by
        one compiled call), not one per leaf."""
        variables = tf.nest.flatten(self._gstate)
        if getattr(self, "_gather", None) is None:
            self._gather = tf.function(lambda: _by_dtype(variables), autograph=False)
        packed = {dtype: t.numpy() for dtype, t in self._gather().items()}
        at = dict.fromkeys(packed, 0)
        flat = []
        for v in variables:  # cut the vectors back into the leaves, in order
            n, key = int(np.prod(v.shape)), v.dtype.name
            flat.append(packed[key][at[key] : at[key] + n].reshape(v.shape).copy())
            at[key] += n
        w1, w2 = WindowState(*flat[0:3]), WindowState(*flat[3:6])
        return policy.GuardState(w1, w2, *flat[6:])

    def _undo(self) -> None:
        everything = self._state_vars + self._metric_vars
        for var, shadow in zip(everything, self._shadow_vars, strict=True):
            var.assign(shadow.value())


def _by_dtype(variables: list[tf.Variable]) -> dict[str, tf.Tensor]:
    """The variables' values flattened and concatenated per dtype (name -> vector)."""
    groups: dict[str, list[tf.Tensor]] = {}
    for v in variables:
        groups.setdefault(v.dtype.name, []).append(tf.reshape(v.read_value(), [-1]))
    return {name: tf.concat(parts, 0) for name, parts in groups.items()}
