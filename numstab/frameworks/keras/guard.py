"""The training guard as a Keras 3 callback for ``model.fit``.

    model.fit(x, y, callbacks=[TrainingGuard(snapshot_every=100).keras_callback()])

A callback runs after Keras applied the step, so a "skip" is an undo: the callback keeps a
copy of the previous good state (every model weight, every optimizer variable, ``iterations``
included, and the metric variables) on the device, and a bad step restores it. The step then
never happened: weights, optimizer slots, schedules (which follow ``iterations``) and the
epoch's running loss are as before it. The copy costs one device copy of the weights and
optimizer variables per step. The learning-rate variables (of the optimizer and of those it
wraps, ``inner_optimizer``), which a step does not change, are not put back: a learning rate
set between steps (``LearningRateScheduler``, ``ReduceLROnPlateau``) stays (``_lr_places``).
After an undo (in this, the per-batch host mode) the batch's ``logs`` are rewritten in place
with the metrics after the undo (``_mend_logs``), so the callbacks after this one (Keras
hands them the same dict: ``TerminateOnNaN``, the progress bar) see the state that stays.

Per batch, with one host transfer:
- the batch's own loss, from the loss tracker's ``total`` and ``count`` (Keras logs the
  epoch's running mean; once a batch is NaN that mean stays NaN until the epoch ends), else
  ``logs["loss"]``;
- per-variable norms of the parameter UPDATE ``w_t - w_{t-1}`` and their global norm, in
  place of the gradient norms a callback cannot see: non-finite gradients give a non-finite
  update, and the ``grad_norm_spikes`` detector watches the update norm.

Rollbacks restore the snapshot's weights and optimizer variables, then multiply the
optimizer's learning rate by the LR factor: the learning rate of the innermost optimizer,
through wrappers (``inner_optimizer``). A ``LearningRateSchedule`` (or a callable) cannot be
rescaled, wrapped or not: the callback's ``lr_factor_applied`` becomes False. With
``steps_per_execution > 1`` the callback sees, and undoes, whole executions. On the
TensorFlow, JAX and torch backends; the per-batch copy and read are one backend call each
(``host_ops.py``). On JAX, Keras keeps the training state off the variables between steps;
a steady batch reads that state, and the callback syncs it back (``model.jax_state_sync()``)
only before it undoes, snapshots or restores.
A model not built when ``fit`` begins (a subclassed model, a ``Sequential`` without an
``Input``), which Keras on TensorFlow builds as it traces the first step: the callback builds
it from the spec of that step's data, and sets up, as the step begins (``_build_then_train``).
With ``TrainingGuard(host_every=k)``, k > 1: ``guard_deferred.py`` (TensorFlow:
``guard_device.py``; JAX, torch: ``guard_arrays.py``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
from keras import ops

from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.keras import host_ops
from numstab.guard import policy
from numstab.guard.runner import GuardRunner, RunnerResults

if TYPE_CHECKING:
    from numstab.guard.guard import TrainingGuard


class GuardCallback(RunnerResults, keras.callbacks.Callback):
    """A :class:`TrainingGuard` for ``model.fit``; see the module docstring."""

    def __init__(self, guard: TrainingGuard) -> None:
        super().__init__()
        self.guard = guard
        self.runner: GuardRunner | None = None
        self.state: policy.GuardState | None = None
        self.lr_factor_applied = True

    #: False where a subclass keeps its own undo copy and batch loss (TensorFlow device mode):
    #: then ``on_train_begin`` skips the host's copy of every variable and the tracker read
    _host_undo_copy = True

    # -- Keras hooks ---------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        model = self.model
        self._restore_train_function()  # (still ours after a fit cut short before a step)
        self._set_up_pending = _layers_unbuilt(model)
        if self._set_up_pending or _compiled_unbuilt(model):
            # Keras on TensorFlow builds the model, its compiled metrics and the optimizer as
            # it traces the first train step: the guard builds them, then sets up (again,
            # with the metrics, where the layers were built), as that step begins
            self._unbuilt_train_function = model.train_function
            model.train_function = self._build_then_train
        if not self._set_up_pending:
            self._set_up()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        # Keras reset the metrics: the undo copy must hold the reset values
        if not self._set_up_pending:
            self._keep_metrics_as_undo()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._restore_train_function()  # (still ours after a fit with no step)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # Keras on JAX trains on a copy of the state and purges the variables meanwhile: a
        # steady batch reads that copy (``_jax_now``); the variables get it (a sync) before
        # anything reads or writes them (an undo, a snapshot, a rollback)
        values = self._jax_now()
        runner = self.runner
        steps_seen = int(self.state.step)
        if runner.consume_skip_batch(steps_seen):
            self._to_variables()
            self._undo()
            self._mend_logs(logs)
            return
        n, k = len(self._weights), len(self._tracker)
        now = None
        if values is not None:
            now = (
                [values[j] for j in self._weight_at],
                [values[j] for j in self._tracker_at],
            )
        host = self._read_updates(self._shadow[:n], now) if n or k else None  # one transfer
        totals = host[:k] if host is not None else []
        loss = self._batch_loss(totals, logs)
        layers = host[k:] if host is not None else None
        norm = np.float32(np.sqrt(np.sum(np.square(layers, dtype=np.float64)))) if n else None
        decision, self.state = policy.decide(self.guard, self._host, self.state, loss, norm)
        d = {k: (x.item() if hasattr(x, "item") else x) for k, x in decision._asdict().items()}
        for key in ("apply", "rollback", "snapshot"):
            d[key] = bool(d[key])
        if d["apply"]:
            self._shadow = self._copy_state(values)
            self._prev_totals = [float(t) for t in totals]  # the tracker's values now
        else:
            self._to_variables()
            self._undo()
            self._mend_logs(logs)
        rollbacks = runner.rollbacks
        self.state = runner.after_step(
            d, self.state, layers if self.guard.track_layers else None, self._host
        )
        if runner.rollbacks != rollbacks:  # restored: the new state is the one to undo to
            self._shadow = self._copy_state()

    # -- resuming --------------------------------------------------------------------------------
    def load_snapshot(self, model: Any = None, step: int | None = None) -> int:
        """Restore ``model`` (default: the model of an earlier ``fit``; compiled and built)
        from the newest (or ``step``) snapshot file of ``snapshot_dir``, e.g. after a crash,
        before ``fit`` goes on; returns its step. Every variable comes back: the weights, the
        optimizer's (``iterations``, and so its schedule, and a learning rate a rollback
        scaled), and the guard's state and counters. Call it between fits."""
        model = _model_to_load(getattr(self, "_model", None) if model is None else model)
        if getattr(self, "_model", None) is not model:
            self.set_model(model)
        self._set_up()  # the variables, and at the first call the runner (fresh state)
        step, self.state = self.runner.load_from_disk(step)
        self._loaded()
        return step

    def _loaded(self) -> None:
        """The undo copy (and a subclass's device state) after ``load_snapshot``."""
        if self._host_undo_copy:
            self._shadow = self._copy_state()
            self._prev_totals = self._read_tracker()

    # -- helpers ---------------------------------------------------------------------------------
    def _set_up(self) -> None:
        """The variables, the undo copy and (at the first ``fit``) the runner; the model built
        (``_layers_unbuilt``), its optimizer built here where it is not."""
        model = self.model
        opt = model.optimizer
        if not opt.built:  # (under a strategy its variables are made in its scope only)
            with _strategy_scope(model):
                opt.build(model.trainable_variables)
        self._weights = list(model.trainable_variables)
        self._state_vars = list(model.weights) + list(opt.variables)
        self._metric_vars = list(model.metrics_variables)
        tracker = getattr(model, "_loss_tracker", None)
        self._tracker = list(tracker.variables) if tracker is not None else []
        self._host = load_backend("numpy")
        everything = self._state_vars + self._metric_vars
        where = {id(v): i for i, v in enumerate(everything)}  # positions in `everything`
        self._weight_at = [where[id(w)] for w in self._weights]
        self._tracker_at = [where.get(id(t)) for t in self._tracker]  # None: not a metric
        self._lr_at = _lr_places(opt, everything)
        # where Keras on JAX keeps each of them between steps (None: off JAX, or a tracker
        # outside the metrics, which only the variables hold)
        self._jax_at = (
            host_ops.jax_state_places(self._model, everything)
            if None not in self._tracker_at
            else None
        )
        if self._host_undo_copy:
            self._make_host_ops()
            self._shadow = self._copy_state()
        layout = [(getattr(v, "path", v.name), tuple(v.shape)) for v in self._state_vars]
        if self.runner is None:  # a second fit() call keeps the history and snapshots
            self.state = self.guard.init_state(self._host)
            names = [getattr(w, "path", w.name) for w in self._weights]
            self.runner = GuardRunner(self.guard, self, self._host, names)
            self.runner.snapshot(0, self.state)
        elif layout != self._variables_layout:  # recompiled: the snapshots do not fit these
            self.runner.ring.clear()
            self.runner.snapshot(int(self.state.step), self.state)
        self._variables_layout = layout
        if self._host_undo_copy:
            self._prev_totals = self._read_tracker()

    def _build_then_train(self, *args: Any) -> Any:
        """``model.train_function`` for the first step of a ``fit`` that began with the
        model or its compiled metrics not built (``_layers_unbuilt``, ``_compiled_unbuilt``):
        builds them from the spec of the step's data (``_build_from``), sets the guard up
        (its undo copy, metrics included, and first snapshot: the state before this step),
        then runs the step."""
        self._restore_train_function()
        _build_from(self._model, args[0])
        self._set_up_pending = False
        self._set_up()
        return self._model.train_function(*args)

    def _restore_train_function(self) -> None:
        """Keras' ``model.train_function`` back in place of ``_build_then_train``."""
        if self._model.train_function == self._build_then_train:
            self._model.train_function = self._unbuilt_train_function

    def _keep_metrics_as_undo(self) -> None:
        self._shadow[len(self._state_vars) :] = self._copy_metrics()
        self._prev_totals = self._read_tracker()

    def _make_host_ops(self) -> None:
        """The per-batch copy and read as one backend call each (``host_ops.py``), made
        again only for other variables (a recompile)."""
        everything = self._state_vars + self._metric_vars
        key = [id(v) for v in everything + self._tracker]
        if getattr(self, "_host_ops_for", None) == key:
            return
        self._host_ops_for = key
        self._copy_state = host_ops.copier(everything)
        self._copy_metrics = host_ops.copier(self._metric_vars)
        self._read_updates = host_ops.update_reader(self._weights, self._tracker)

    def _unsynced_jax_state(self) -> dict | None:
        """Keras on JAX during ``fit``: the training state it keeps off the variables
        (``model._jax_state``) where it has not written it back to them; else None."""
        model = self._model  # (Callback.model would write it back first)
        state = getattr(model, "_jax_state", None)
        if self._jax_at is None or not state or getattr(model, "_jax_state_synced", True):
            return None
        return state

    def _jax_now(self) -> list[Any] | None:
        """The values of every variable (``_state_vars`` then ``_metric_vars``) in Keras'
        unsynced JAX training state; else None, the variables synced (they hold them)."""
        state = self._unsynced_jax_state()
        if state is None:
            self._to_variables()
            return None
        return [state[key][j] for key, j in self._jax_at]

    def _to_variables(self) -> None:
        """Keras on JAX: write its training state back to the variables (once; Keras takes
        it from them again at its next step)."""
        getattr(self._model, "jax_state_sync", lambda: None)()

    def _read_tracker(self) -> list[float]:
        return [float(host_ops.to_numpy(t)) for t in self._tracker]

    def _batch_loss(self, totals: Any, logs: dict | None) -> np.float32:
        if len(totals) == 2 and len(self._prev_totals) == 2:
            d_count = float(totals[1]) - self._prev_totals[1]
            if d_count > 0:
                return np.float32((float(totals[0]) - self._prev_totals[0]) / d_count)
        value = (logs or {}).get("loss", np.nan)
        return np.float32(ops.convert_to_numpy(value))

    def _undo(self) -> None:
        # copies: the variables must not hold the shadow's buffers, which Keras on JAX
        # donates to the next train step; the learning rate stays (``_lr_places``)
        everything = self._state_vars + self._metric_vars
        for j, (var, value) in enumerate(zip(everything, self._shadow, strict=True)):
            if j not in self._lr_at:
                var.assign(ops.copy(value))

    def _mend_logs(self, logs: dict | None) -> None:
        """The undone batch's ``logs`` (the dict Keras hands every callback) rewritten in
        place with the metrics after the undo: the running means before the batch (0 for
        an epoch's first batch, as Keras reports a mean of nothing). One read, after an
        undo only."""
        if not logs:
            return
        for key, x in self.model.get_metrics_result().items():
            if key in logs:
                x = ops.convert_to_numpy(x)
                logs[key] = float(x) if np.ndim(x) == 0 else x

    # -- the Adapter protocol of GuardRunner -------------------------------------------------------
    def capture(self) -> list[Any]:
        self._to_variables()
        return [host_ops.to_numpy(v) for v in self._state_vars]

    def restore(self, payload: list[Any]) -> None:
        self._to_variables()  # (the metrics' values stay Keras')
        for var, value in zip(self._state_vars, payload, strict=True):
            var.assign(value)

    def scale_lr(self, ratio: float, ratio_now: float) -> None:
        opt = self.model.optimizer
        while getattr(opt, "inner_optimizer", None) is not None:  # (wrappers delegate to it)
            opt = opt.inner_optimizer
        if not isinstance(opt._learning_rate, keras.Variable):  # a schedule, a callable
            self.lr_factor_applied = False
            return
        opt.learning_rate = float(ops.convert_to_numpy(opt.learning_rate)) * ratio

    def to_host(self, payload: list[Any]) -> dict[str, Any]:
        """``{key: value}`` of the variables, keyed by ``_unique_paths``: every variable
        has a key of its own, where two share a Keras path too."""
        keys = _unique_paths(self._state_vars)
        return dict(zip(keys, payload, strict=True))

    def from_host(self, tree: dict[str, Any]) -> list[Any]:
        """The saved values of this model's variables: by path, or by position where some
        path is missing but the file holds as many values (a new process's model, or one
        built after another model, has other auto-numbered names, ``dense_2`` for ``dense``;
        Keras' ``load_weights`` also goes by position). A snapshot of other variables (saved
        before a ``compile`` with another optimizer, or of another model) raises, naming the
        first variable that does not fit (a file written before for variables sharing a path
        holds one value fewer: no value for ``path#1``), or a value that fits none."""
        names = _unique_paths(self._state_vars)
        by_position = len(tree) == len(names) and not all(name in tree for name in names)
        saved = list(tree.values()) if by_position else [tree.get(name) for name in names]
        for name, v, x in zip(names, self._state_vars, saved, strict=True):
            if x is None or np.shape(x) != tuple(v.shape):
                got = "no value" if x is None else f"shape {np.shape(x)}"
                raise InvalidArgumentError(
                    "Expected a snapshot of the variables being trained (a snapshot saved "
                    "before a compile with other variables, or of another model, does not fit "
                    f"them). Received: {got} for {name!r}, whose shape is {tuple(v.shape)}"
                )
        extra = [key for key in tree if key not in names] if not by_position else []
        if extra:  # (every variable found: the file holds others too)
            raise InvalidArgumentError(
                "Expected a snapshot of the variables being trained, one value each. "
                f"Received: {len(tree)} values for {len(names)} variables ({extra[0]!r} "
                "is not one of them)"
            )
        return saved


def _unique_paths(variables: list[Any]) -> list[str]:
    """The variables' Keras paths (``name`` where there is none), made unique: the k-th
    repeat (k >= 1) of a path (a layer's two ``add_weight(name="w")``) is ``path#k``, the
    first k giving a key no other variable has. A model without repeats keeps its paths, so
    the files written before load as they did; before, a repeat took its first's key in the
    file, which kept the last value of the two and restored it to both."""
    paths = [getattr(v, "path", v.name) for v in variables]
    taken, used, keys = set(paths), set(), []
    for path in paths:
        key, k = path, 0
        while key in used or (k and key in taken):  # (a repeat, or another variable's path)
            k += 1
            key = f"{path}#{k}"
        used.add(key)
        keys.append(key)
    return keys


def _strategy_scope(model: Any) -> Any:
    """The scope of the model's ``tf.distribute`` strategy (Keras on TensorFlow; the
    default strategy's where there is none); elsewhere a no-op context."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _lr_places(optimizer: Any, variables: list[Any]) -> frozenset[int]:
    """The positions in ``variables`` of the learning-rate variables of ``optimizer`` and of
    the optimizers it wraps (``inner_optimizer``: Keras' ``LossScaleOptimizer``, numstab's
    ``ZClipOptimizer``, ``AGCOptimizer``, ...). A step does not change them; other callbacks
    set them between steps. The undo leaves them as they are (a snapshot's restore does not)."""
    ids = set()
    while optimizer is not None:
        lr = getattr(optimizer, "_learning_rate", None)
        if isinstance(lr, keras.Variable):
            ids.add(id(lr))
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return frozenset(j for j, v in enumerate(variables) if id(v) in ids)


def _model_to_load(model: Any) -> Any:
    """``model`` checked for ``load_snapshot``: a compiled model whose layers are built (its
    variables exist to take the snapshot's values)."""
    if not isinstance(model, keras.Model):
        raise InvalidArgumentError(
            "Expected model to be a keras.Model (or a callback that fit has used). "
            f"Received: model={type(model).__name__}"
        )
    if getattr(model, "optimizer", None) is None:
        raise InvalidArgumentError(
            "Expected a compiled model (model.compile) for load_snapshot: the snapshot holds "
            "the optimizer's variables"
        )
    if not all(layer.built for layer in model._flatten_layers()):
        raise InvalidArgumentError(
            "Expected a built model for load_snapshot (a keras.Input, model.build(shape) or "
            "one call): its variables must exist to take the snapshot's values"
        )
    return model


def _layers_unbuilt(model: Any) -> bool:
    """Whether a layer of the model is not built at ``on_train_begin`` (a subclassed model, a
    ``Sequential`` without an ``Input``): Keras on TensorFlow (without a distribution
    strategy) builds it, its compiled metrics and the optimizer as it traces the first train
    step; on JAX and torch, and on TensorFlow with a strategy, ``fit`` builds them before the
    callbacks begin."""
    if keras.backend.backend() != "tensorflow":
        return False
    return not all(layer.built for layer in model._flatten_layers())


def _compiled_unbuilt(model: Any) -> bool:
    """Whether the compiled metrics or loss are not built at ``on_train_begin`` (a model
    built with an ``Input``, compiled with ``metrics=``, on TensorFlow): the undo copy made
    then misses the metrics' variables (a skipped NaN batch still reached them: the epoch's
    ``mae`` was NaN), so the guard sets up again once they are built."""
    if keras.backend.backend() != "tensorflow":
        return False
    compiled = (getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None))
    return any(part is not None and not part.built for part in compiled)


def _build_from(model: Any, iterator: Any) -> None:
    """Build the model, its compiled metrics and loss and its optimizer from the spec of the
    TensorFlow ``iterator``'s batches, as Keras' ``fit`` does on TensorFlow with a
    distribution strategy (symbolic tensors: no batch is taken from the iterator)."""
    import tensorflow as tf

    def symbolic(spec: Any) -> Any:
        if not (hasattr(spec, "shape") and hasattr(spec, "dtype")):
            return None  # (an absent input, as Keras' None for an empty Optional)
        return keras.KerasTensor(spec.shape, keras.backend.standardize_dtype(spec.dtype))

    data = tf.nest.map_structure(symbolic, iterator.element_spec)
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data)
