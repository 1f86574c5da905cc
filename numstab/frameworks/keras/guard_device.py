"""The Keras guard callback with ``TrainingGuard(host_every=k)``, k > 1 (TensorFlow backend).

The per-batch work of :class:`numstab.frameworks.keras.guard.GuardCallback` (the batch's loss
from the loss tracker, the update norms, the decision of ``numstab.guard.policy`` and the
undo of a bad step) runs as ONE compiled TensorFlow function (``tf.function``) on the
variables, with no host read: the undo copy lives in TF variables, a bad step is put back
with ``where`` and every step's decision is written to a ``[k, ...]`` variable that the host
reads every k steps (``runner.after_steps``: history, log, rollback, snapshot).

The check of step t runs when batch t + 1 begins (or when the epoch's validation begins, or
the epoch or training ends), not in ``on_train_batch_end``: a callback without its own
``on_train_batch_end`` lets Keras keep dispatching its own per-batch logging asynchronously,
as in a loop without the callback. Keras computes the epoch's logs before these hooks: when
a bad last batch made them non-finite, ``on_epoch_end`` puts the metrics after the undo in
their place (one read, in that case only), before ``History`` records them.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.keras.guard import GuardCallback
from numstab.guard import policy
from numstab.guard.spikes import WindowState

_FIELDS = [k for k in policy.Decision._fields if k != "layer_norms"]


def callback(guard: Any) -> GuardCallback:
    """The guard's callback: the device-side one with ``host_every`` > 1 on TensorFlow (on
    the JAX and torch backends of Keras the decision is read every batch)."""
    if guard.host_every > 1 and keras.backend.backend() == "tensorflow":
        return DeviceGuardCallback(guard)
    return GuardCallback(guard)


class DeviceGuardCallback(GuardCallback):
    """:class:`GuardCallback` whose steady batch stays on the device (TensorFlow)."""

    # Keras' default: its per-batch logging stays asynchronous
    on_train_batch_end = keras.callbacks.Callback.on_train_batch_end

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        everything = self._state_vars + self._metric_vars
        self._pending = getattr(self, "_pending", 0)
        self._stepped = False
        self._results: dict | None = None
        if getattr(self, "_fn", None) is not None:  # a later fit(): the same variables
            for var, shadow in zip(everything, self._shadow_vars, strict=True):
                shadow.assign(var.value)
            return
        self._shadow_vars = [tf.Variable(v.value, trainable=False) for v in everything]
        where = {id(v): i for i, v in enumerate(everything)}
        self._tracker_at = [where.get(id(t)) for t in self._tracker]
        if len(self._tracker_at) != 2 or None in self._tracker_at:
            raise InvalidArgumentError(
                "Expected a model compiled with a loss (its loss tracker gives each batch's "
                "loss) for TrainingGuard(host_every > 1); use host_every=1. Received: "
                f"host_every={self.guard.host_every}"
            )
        self._gstate = tf.nest.map_structure(
            lambda x: tf.Variable(np.asarray(x)), tuple(self.state)
        )
        width = len(_FIELDS) + len(self._weights)
        self._rows = tf.Variable(tf.zeros((self.guard.host_every, width), tf.float32))
        self._fn = tf.function(self._device_step, jit_compile=False, autograph=False)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._stepped:
            self._check()
        self._stepped = True

    def on_test_begin(self, logs: dict | None = None) -> None:
        # fit's validation: before evaluate() resets the metrics the check reads
        self._last_check()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._last_check()
        if logs and self._results is not None:
            # Keras took the epoch's logs before the last batch's check: where that batch
            # made them non-finite and was undone, log the metrics as they are after the undo
            # (History comes after this callback). Reads only in that case.
            for key, value in list(logs.items()):
                bad = isinstance(value, float) and not np.isfinite(value)
                if bad and key in self._results:
                    logs[key] = float(self._results[key])
        self._results = None

    def _last_check(self) -> None:
        """Check the epoch's last batch; keep the metrics after it (tensors: no read)."""
        if self._stepped:
            self._check()
            self._results = self.model.get_metrics_result()
        self._stepped = False

    def on_train_end(self, logs: dict | None = None) -> None:
        self._last_check()
        self._results = None
        self.flush()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        # Keras reset the metrics: the undo copy must hold the reset values
        n = len(self._state_vars)
        for var, shadow in zip(self._metric_vars, self._shadow_vars[n:], strict=True):
            shadow.assign(var.value)

    # -- the steady batch --------------------------------------------------------------------
    def _check(self) -> None:
        getattr(self.model, "jax_state_sync", lambda: None)()
        steps_seen = int(self.state.step) + self._pending
        if self.runner.consume_skip_batch(steps_seen):
            self._undo()
            return
        self._fn(tf.constant(self._pending))
        self._pending += 1
        if self._pending >= self.guard.host_every:
            self.flush()

    def _device_step(self, i: tf.Tensor) -> None:
        everything = self._state_vars + self._metric_vars
        shadow = self._shadow_vars
        (t, c), (st, sc) = (
            [tf.cast(everything[j].value, tf.float32) for j in self._tracker_at],
            [tf.cast(shadow[j], tf.float32) for j in self._tracker_at],
        )
        loss = tf.math.divide_no_nan(t - st, c - sc)
        deltas = [
            tf.norm(tf.cast(w.value, tf.float32) - tf.cast(s, tf.float32))
            for w, s in zip(self._weights, shadow, strict=False)
        ]
        layers = tf.stack(deltas) if deltas else tf.zeros((0,), tf.float32)
        norm = tf.sqrt(tf.reduce_sum(layers * layers)) if deltas else None
        state = tf.nest.map_structure(lambda v: v.read_value(), self._gstate)
        decision, new = policy.decide(
            self.guard, load_backend("tensorflow"), policy.GuardState(*state), loss, norm
        )
        tf.nest.map_structure(lambda v, x: v.assign(x), self._gstate, tuple(new))
        pairs = list(zip(everything, shadow, strict=True))

        def keep() -> tf.Tensor:  # a good step: it becomes the undo copy
            return tf.group([s.assign(v.value) for v, s in pairs])

        def undo() -> tf.Tensor:  # a bad step: put the copy back
            return tf.group([v.assign(s) for v, s in pairs])

        tf.cond(decision.apply, keep, undo)  # one copy of the state either way
        row = [tf.cast(getattr(decision, k), tf.float32) for k in _FIELDS]
        self._rows[i].assign(tf.concat([tf.stack(row), layers], 0))

    def flush(self) -> None:
        """Read the decisions kept since the last read (one transfer) and act on them."""
        n, self._pending = self._pending, 0
        if not n:
            return
        rows = self._rows[:n].numpy()
        decisions = []
        for r in rows:
            d = dict(zip(_FIELDS, r[: len(_FIELDS)].tolist(), strict=True))
            for key in ("apply", "rollback", "snapshot"):
                d[key] = bool(d[key])
            d["reasons"], d["step"] = int(d["reasons"]), int(d["step"])
            decisions.append(d)
        layers = list(rows[:, len(_FIELDS) :]) if self.guard.track_layers else None
        self.state = self._host_state()
        rolled = self.runner.after_steps(
            decisions, layers, self._host, lambda: self.state, int(self.state.step)
        )
        if rolled is not None:
            self.state = rolled
            for v, x in zip(
                tf.nest.flatten(self._gstate), tf.nest.flatten(tuple(rolled)), strict=True
            ):
                v.assign(np.asarray(x))
            everything = self._state_vars + self._metric_vars
            for var, shadow in zip(everything, self._shadow_vars, strict=True):
                shadow.assign(var.value)

    def _host_state(self) -> policy.GuardState:
        flat = [v.numpy() for v in tf.nest.flatten(self._gstate)]
        w1, w2 = WindowState(*flat[0:3]), WindowState(*flat[3:6])
        return policy.GuardState(w1, w2, *flat[6:])

    def _undo(self) -> None:
        everything = self._state_vars + self._metric_vars
        for var, shadow in zip(everything, self._shadow_vars, strict=True):
            var.assign(shadow.value())
