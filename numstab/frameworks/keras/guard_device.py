"""The Keras guard callback with ``TrainingGuard(host_every=k)``, k > 1, on TensorFlow.

The hooks are ``guard_deferred.py``'s. Here the per-batch work runs as ONE compiled
TensorFlow function (``tf.function``) on the variables, with no host read: the undo copy
lives in TF variables, a bad step is put back with ``tf.cond`` (a good step copies the state
once, a bad one twice) and every step's decision is written to a ``[k, ...]`` variable that
the host reads every k steps. Its cost on the CPU is mostly the call's, not the kernels':
the function takes no argument (the row it writes is a TF variable it advances itself, reset
when the host reads the rows: a tensor argument cost ~50-80 us a call) and is called as its
concrete function (a ``tf.function`` call spends ~140 us more dispatching to it, with this
many captured variables).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from numstab.backends import load_backend
from numstab.frameworks.keras.guard_deferred import DeferredGuardCallback
from numstab.guard import policy
from numstab.guard.deferred import ROW_COLUMNS


class DeviceGuardCallback(DeferredGuardCallback):
    """:class:`GuardCallback` whose steady batch stays on the device (TensorFlow)."""

    _host_undo_copy = False  # the undo copy lives in TF variables; the loss from the tracker

    def _start_device(self) -> None:
        everything = self._state_vars + self._metric_vars
        if getattr(self, "_fn_for", None) == [id(v) for v in everything]:  # a later fit()
            self._keep_as_undo()
            return
        self._fn_for = [id(v) for v in everything]  # (a recompile: other variables)
        self._shadow_vars = [tf.Variable(v.value, trainable=False) for v in everything]
        self._layout = _Layout(self.state)
        self._packed = {  # the guard state: one vector per dtype (2 variables, not 11)
            name: tf.Variable(x) for name, x in self._layout.pack(self.state, np).items()
        }
        width = len(ROW_COLUMNS) + len(self._weights)
        self._rows = tf.Variable(tf.zeros((self.guard.host_every, width), tf.float32))
        # the row the next check writes: always equal to ``self._pending``
        self._slot = tf.Variable(tf.zeros((1,), tf.int32), trainable=False)
        # traced once here, then called as concrete functions (see above)
        self._fn = _concrete(self._device_step)
        self._take = _concrete(self._take_rows_and_state)
        self._keep = _concrete(self._copy_to_undo)  # one call, not 34 ops

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
        state = self._layout.unpack({k: v.read_value() for k, v in self._packed.items()})
        decision, new = policy.decide(self.guard, load_backend("tensorflow"), state, loss, norm)
        for name, x in self._layout.pack(new, tf).items():
            self._packed[name].assign(x)
        pairs = self._undone_pairs(shadow)

        def undo() -> tf.Tensor:  # a bad step: put the copy back
            # (a tensor: Keras' assign returns its value, which tf.group takes; the copy is a
            # MirroredVariable where load_snapshot ran inside a strategy's scope)
            return tf.group([v.assign(s.read_value()) for v, s in pairs])

        # then the state becomes the undo copy (after an undo: the copy onto itself). One
        # branch of copies, not a cond with a copy in each: half the graph's nodes, and a
        # good step still copies the state once.
        tf.cond(decision.apply, tf.no_op, undo)
        for v, s in pairs:  # ordered after the cond: both touch v's and s's resources
            s.assign(v.value)
        row = [tf.cast(getattr(decision, k), tf.float32) for k in ROW_COLUMNS]
        slot = self._slot.read_value()
        self._rows.scatter_update(
            tf.IndexedSlices(tf.concat([tf.stack(row), layers], 0)[None], slot)
        )
        self._slot.assign(slot + 1)

    def _take_rows_and_state(self) -> dict[str, tf.Tensor]:
        """The rows (flattened, before the state's float32 vector) and the state's vectors;
        the slot back to row 0 (flush() set ``_pending`` to 0). One call, one transfer per
        dtype."""
        out = {k: v.read_value() for k, v in self._packed.items()}
        rows = tf.reshape(self._rows.read_value(), [-1])
        out["float32"] = tf.concat([rows, out.get("float32", tf.zeros((0,), tf.float32))], 0)
        self._slot.assign(tf.zeros((1,), tf.int32))
        return out

    def _read(self, n: int) -> tuple[Any, policy.GuardState]:
        vectors = {k: t.numpy() for k, t in self._take().items()}
        size = self._rows.shape.num_elements()
        rows = vectors["float32"][:size].reshape(self._rows.shape)[:n]
        vectors["float32"] = vectors["float32"][size:]
        return rows, self._layout.unpack(vectors, copy=True)

    def _set_device_state(self, state: policy.GuardState) -> None:
        for name, x in self._layout.pack(state, np).items():
            self._packed[name].assign(x)

    def _device_state(self) -> policy.GuardState:
        """Read in two transfers (its float32 and its int32 vectors), not one per leaf."""
        return self._layout.unpack({k: v.numpy() for k, v in self._packed.items()}, copy=True)

    def _undo(self) -> None:
        for var, shadow in self._undone_pairs(self._shadow_vars):
            var.assign(shadow.value())

    def _undone_pairs(self, shadow: list[Any]) -> list[tuple[Any, Any]]:
        """(variable, its undo copy) of every variable an undo puts back: all but the
        learning rate (``guard._lr_places``), which a step does not change."""
        everything = self._state_vars + self._metric_vars
        pairs = enumerate(zip(everything, shadow, strict=True))
        return [pair for j, pair in pairs if j not in self._lr_at]


def _concrete(fn: Any) -> Any:
    """``fn`` (no arguments) traced into a graph function, as its concrete function."""
    return tf.function(fn, jit_compile=False, autograph=False).get_concrete_function()


class _Layout:
    """Where each leaf of a guard state (0-d and 1-d arrays) sits in one flat vector per
    dtype: per dtype its vectors in leaf order, then its scalars (packed by one stack, not
    a reshape each; a scalar is read back by one index)."""

    def __init__(self, state: policy.GuardState) -> None:
        leaves = [np.asarray(x) for x in tf.nest.flatten(tuple(state))]
        if any(x.ndim > 1 for x in leaves):
            raise ValueError("Expected a guard state of 0-d and 1-d arrays")
        self._structure = tuple(state)
        self._dtypes = sorted({x.dtype.name for x in leaves})
        self._places: list[tuple[str, int, int]] = [("", 0, 0)] * len(leaves)
        for name in self._dtypes:  # (dtype, start, size); size 0: a scalar
            at = 0
            for scalars in (False, True):
                for j, x in enumerate(leaves):
                    if x.dtype.name == name and (x.ndim == 0) == scalars:
                        self._places[j] = (name, at, 0 if scalars else x.size)
                        at += max(x.size, 1)

    def pack(self, state: policy.GuardState, xp: Any) -> dict[str, Any]:
        """``{dtype name: vector}`` of ``state``; ``xp``: ``np`` (host) or ``tf`` (graph)."""
        leaves = tf.nest.flatten(tuple(state))
        out = {}
        for name in self._dtypes:
            mine = [(p, x) for p, x in zip(self._places, leaves, strict=True) if p[0] == name]
            parts = [x for (_, _, size), x in mine if size]
            scalars = [x for (_, _, size), x in mine if not size]
            if scalars:
                parts.append(xp.stack(scalars))
            if xp is np:
                out[name] = np.concatenate([np.asarray(x, name).ravel() for x in parts])
            else:
                out[name] = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
        return out

    def unpack(self, vectors: dict[str, Any], copy: bool = False) -> policy.GuardState:
        """The guard state cut out of ``pack``'s vectors (NumPy: ``copy`` leaves apart)."""
        leaves = []
        for name, start, size in self._places:
            x = vectors[name][start : start + size] if size else vectors[name][start]
            leaves.append(x.copy() if copy else x)
        return policy.GuardState(*tf.nest.pack_sequence_as(self._structure, leaves))
