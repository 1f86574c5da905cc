"""The hooks of the Keras guard callback with ``TrainingGuard(host_every=k)``, k > 1, shared by
the TensorFlow version (``guard_device.py``) and the JAX / torch one (``guard_arrays.py``).

Each backend runs the per-batch work (the batch's loss from the loss tracker, the update
norms, the decision of ``numstab.guard.policy`` and the undo of a bad step) on the device
with no host read, and keeps each step's decision as a float32 row; every k steps the host
reads the rows (one transfer) and acts on them (``runner.after_steps``: history, log,
rollback, snapshot).

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

from numstab.errors import InvalidArgumentError
from numstab.frameworks.keras.guard import GuardCallback
from numstab.guard import policy
from numstab.guard.deferred import ROW_COLUMNS, decisions_from_rows


class DeferredGuardCallback(GuardCallback):
    """:class:`GuardCallback` whose steady batch stays on the device; a backend gives
    ``_start_device``, ``_device_check``, ``_read_rows`` and ``_device_state`` (or both at
    once: ``_read``), ``_set_device_state``, ``_keep_as_undo`` and ``_keep_metrics_as_undo``."""

    # Keras' default: its per-batch logging stays asynchronous
    on_train_batch_end = keras.callbacks.Callback.on_train_batch_end

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._pending = getattr(self, "_pending", 0)
        self._stepped = False
        self._results: dict | None = None
        super().on_train_begin(logs)

    def _set_up(self) -> None:
        super()._set_up()
        if len(self._tracker_at) != 2 or None in self._tracker_at:
            raise InvalidArgumentError(
                "Expected a model compiled with a loss (its loss tracker gives each batch's "
                "loss) for TrainingGuard(host_every > 1); use host_every=1. Received: "
                f"host_every={self.guard.host_every}"
            )
        self._start_device()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._stepped:
            self._check()
        self._stepped = True

    def on_test_begin(self, logs: dict | None = None) -> None:
        # fit's validation: before evaluate() resets the metrics the check reads
        self._last_check()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        checked = self._stepped
        self._last_check(keep_results=False)
        bad = [k for k, x in (logs or {}).items() if isinstance(x, float) and not np.isfinite(x)]
        if bad and (self._results is not None or checked):
            # Keras took the epoch's logs before the last batch's check: where that batch
            # made them non-finite and was undone, log the metrics as they are after the undo
            # (History comes after this callback): kept when the validation began, else
            # now. Reads only in that case.
            results = self._results
            if results is None:
                results = self.model.get_metrics_result()
            for key in bad:
                if key in results:
                    logs[key] = float(keras.ops.convert_to_numpy(results[key]))
        self._results = None

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)
        self._last_check(keep_results=False)
        self._results = None
        self.flush()

    def _last_check(self, keep_results: bool = True) -> None:
        """Check the epoch's last batch; with ``keep_results`` keep the metrics after it
        (tensors: no read), which the validation is about to reset."""
        if self._stepped:
            self._check()
            if keep_results:
                self._results = self.model.get_metrics_result()
        self._stepped = False

    def _check(self) -> None:
        self._to_variables()
        steps_seen = int(self.state.step) + self._pending
        if self.runner.consume_skip_batch(steps_seen):
            self._undo()
            return
        self._device_check(self._pending)
        self._pending += 1
        if self._pending >= self.guard.host_every:
            self.flush()

    def flush(self) -> None:
        """Read the decisions kept since the last read (one transfer) and act on them."""
        n, self._pending = self._pending, 0
        if not n:
            return
        rows, state = self._read(n)
        # the steps are the host's count: a float32 row holds integers exactly to 2**24 only
        decisions = decisions_from_rows(rows[:, : len(ROW_COLUMNS)], int(state.step) - n)
        layers = list(rows[:, len(ROW_COLUMNS) :]) if self.guard.track_layers else None
        self.state = state
        rolled = self.runner.after_steps(
            decisions, layers, self._host, lambda: self.state, int(self.state.step)
        )
        if rolled is not None:
            self.state = rolled
            self._set_device_state(rolled)
            self._keep_as_undo()

    def _loaded(self) -> None:
        super()._loaded()
        self._pending = 0  # (between fits: the last fit flushed)
        self._set_device_state(self.state)
        self._keep_as_undo()

    # -- per backend -----------------------------------------------------------------------------
    def _start_device(self) -> None:
        """Build the device state (or, on a later ``fit``, renew its undo copy)."""
        raise NotImplementedError

    def _device_check(self, i: int) -> None:
        """Decide step ``i`` of the pending ones on the device, undo it there when bad."""
        raise NotImplementedError

    def _read(self, n: int) -> tuple[Any, policy.GuardState]:
        """``(_read_rows(n), _device_state())``; a backend may read both at once."""
        return self._read_rows(n), self._device_state()

    def _read_rows(self, n: int) -> Any:
        """The ``n`` pending rows as NumPy float32 ``[n, len(ROW_COLUMNS) + layers]``."""
        raise NotImplementedError

    def _device_state(self) -> policy.GuardState:
        """The device's guard state, read as NumPy."""
        raise NotImplementedError

    def _set_device_state(self, state: policy.GuardState) -> None:
        raise NotImplementedError

    def _keep_as_undo(self) -> None:
        """The current variables become the undo copy."""
        raise NotImplementedError

    def _keep_metrics_as_undo(self) -> None:
        raise NotImplementedError
