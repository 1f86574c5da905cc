"""numstab's dynamic loss scaling and global-norm clipping as a Keras 3 optimizer (TF backend).

    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-3), LossScaler.preset("keras"),
                             max_norm=1.0)
    model.compile(optimizer=opt, loss=...)      # model.fit scales the loss itself
    # or, in a custom loop:
    with tf.GradientTape() as tape:
        scaled = opt.scale_loss(loss_fn(model(x), y))
    opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

Every ``apply`` / ``apply_gradients`` takes SCALED gradients and does, in this order:

1. unscale with ``LossScaler.unscale`` (float32 math, each gradient keeps its dtype);
2. finiteness: one flag over every gradient, taken on the unscaled values, and agreed on by
   every replica under ``tf.distribute`` (see below);
3. clip with ``numstab.clip_by_global_norm(max_norm, norm_type)`` when ``max_norm`` is given,
   so the norm is that of the unscaled gradient. A non-finite norm (for example a float32
   overflow of the sum of squares of finite gradients) also marks the step non-finite;
4. the inner optimizer's ``apply`` runs only when the step is finite. On a skipped step it
   is not called at all: the model variables, the inner slots (momenta...) and the inner
   ``iterations`` stay as they were, so learning-rate schedules freeze (Keras 3's own
   ``LossScaleOptimizer`` and ``optax.apply_if_finite`` do the same; tf-keras advances them);
5. ``LossScaler.update`` computes the next (scale, growth tracker, hysteresis) state, which is
   assigned to three ``tf.Variable``s: float32 ``dynamic_scale``, int32 ``growth_tracker`` and
   int32 ``hysteresis_left``. They are tracked by ``tf.train.Checkpoint`` and Keras saving.

The step is graph code (``tf.cond``, no host sync): it runs in ``model.fit`` with
``jit_compile`` False or True, and in a ``tf.function``.

Under ``tf.distribute`` (``MirroredStrategy``...), Keras hands ``apply`` each replica's LOCAL
gradients and the inner optimizer sums them. Without ``max_norm`` each replica's flag is
summed across replicas with the replica context's ``all_reduce``, so one replica's overflow
skips the step on every replica and the scale backs off once. With ``max_norm`` the
gradients are all-reduced (summed, still scaled, as tf-keras does) first, and the flag and
the norm are taken on that sum, the gradient actually applied, so every replica sees the same
norm; the clipped sum is handed to the inner optimizer on replica 0 and zeros on the others,
which its own summation turns back into the clipped sum exactly. That costs one extra
gradient all-reduce per step.

Edge cases: ``None`` gradients stay None. Gradients of variables with
``overwrite_with_gradient`` (Keras' float8 layers) pass through untouched, as in Keras.
For ``tf.IndexedSlices`` only the values are unscaled, checked and clipped (as
``tf.clip_by_global_norm`` does): with repeated indices the norm is not the densified one's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NoReturn

import keras
import tensorflow as tf
from keras.src.utils import tracking  # what Keras' own LossScaleOptimizer.build uses

import numstab
from numstab import _validate as v
from numstab.errors import InvalidArgumentError, NumstabError
from numstab.frameworks.keras import wrapping
from numstab.frameworks.keras.wrapping import inner_from_config, paired
from numstab.loss_scale import LossScaler, LossScaleState

__all__ = ["LossScaleOptimizer"]

_STATE_DTYPES = {"scale": "float32", "growth_tracker": "int32", "hysteresis_left": "int32"}


@keras.saving.register_keras_serializable(package="numstab")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wrap a Keras 3 optimizer with numstab's dynamic loss scaling and optional clipping.

    Args:
        inner_optimizer: any ``keras.optimizers.Optimizer`` except a LossScaleOptimizer.
        scaler: the ``numstab.LossScaler`` config; default ``LossScaler.preset("keras")``
            (2**15, x2 every 2000 finite steps, x0.5 on overflow, no floor).
        max_norm: clip the unscaled gradients to this global norm; None: no clipping.
        norm_type: the norm's order p (> 0, ``math.inf`` allowed).
        name: the optimizer's name.

    A subclass of ``keras.optimizers.LossScaleOptimizer``, so ``model.compile`` does not wrap
    it a second time under the ``mixed_float16`` policy. The inner optimizer's
    ``loss_scale_factor`` is reset to None (it would scale twice). ``learning_rate`` and
    ``iterations`` are the inner optimizer's. TensorFlow backend only.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        scaler: LossScaler | None = None,
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        wrapping.check_kwargs(LossScaleOptimizer, kwargs)
        if keras.backend.backend() != "tensorflow":
            raise NumstabError(
                "numstab.integrations.keras.LossScaleOptimizer needs the TensorFlow backend "
                f"of Keras. Received: KERAS_BACKEND={keras.backend.backend()!r}"
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer) or isinstance(
            inner_optimizer, keras.optimizers.LossScaleOptimizer
        ):
            raise InvalidArgumentError(
                "Expected inner_optimizer to be a keras.optimizers.Optimizer that is not a "
                f"LossScaleOptimizer. Received: inner_optimizer={inner_optimizer!r}"
            )
        if scaler is None:
            scaler = LossScaler.preset("keras")
        elif not isinstance(scaler, LossScaler):
            raise InvalidArgumentError(
                f"Expected scaler to be a numstab.LossScaler or None. Received: scaler={scaler!r}"
            )
        if max_norm is not None:
            max_norm = v.check_number("max_norm", max_norm, low=0.0, low_open=True)
        if norm_type != math.inf:
            norm_type = v.check_number("norm_type", norm_type, low=0.0, low_open=True)
        super().__init__(
            inner_optimizer,
            initial_scale=scaler.init_scale,
            dynamic_growth_steps=scaler.growth_interval,
            name=name,
        )
        self._scaler = scaler
        self.max_norm = max_norm
        self.norm_type = float(norm_type)

    # -- state ---------------------------------------------------------------------------------
    @property
    def scaler(self) -> LossScaler:
        """The immutable ``numstab.LossScaler`` config."""
        return self._scaler

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the three state variables, then build the inner optimizer."""
        init = self._initial_state()
        made = {}
        for field, dtype in _STATE_DTYPES.items():
            made[field] = self.add_variable(
                shape=(),
                dtype=dtype,
                initializer=keras.initializers.Constant(init[field]),
                # one value for every replica: replicas compute identical updates
                aggregation="only_first_replica",
                name=field,
            )
        self.dynamic_scale = made["scale"]  # Keras 3's name, read by existing code
        self.growth_tracker = made["growth_tracker"]
        self.hysteresis_left = made["hysteresis_left"]
        self.step_counter = self.growth_tracker  # Keras 3's name for the growth tracker
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)  # skip Keras' own scale variables

    def _initial_state(self) -> dict[str, Any]:
        """``LossScaler.init`` as host numbers (build() may run while tracing)."""
        with tf.init_scope():
            init = self._scaler.init(backend="tensorflow")
            return {f: getattr(init, f).numpy().item() for f in _STATE_DTYPES}

    @property
    def state(self) -> LossScaleState:
        """The current state as tensors (scale, growth_tracker, hysteresis_left).

        Before the optimizer is built: the scaler's initial state."""
        if not self.built:
            return self._scaler.init(backend="tensorflow")
        return LossScaleState(
            scale=tf.convert_to_tensor(self.dynamic_scale),
            growth_tracker=tf.convert_to_tensor(self.growth_tracker),
            hysteresis_left=tf.convert_to_tensor(self.hysteresis_left),
        )

    def _assign_state(self, state: LossScaleState) -> None:
        self.dynamic_scale.assign(state.scale)
        self.growth_tracker.assign(state.growth_tracker)
        self.hysteresis_left.assign(state.hysteresis_left)

    def scale_loss(self, loss: Any) -> tf.Tensor:
        """``loss * scale`` via ``LossScaler.scale`` (float32 product, the loss's dtype)."""
        return self._scaler.scale(tf.convert_to_tensor(loss), self.state)

    # -- the step ------------------------------------------------------------------------------
    apply_gradients = wrapping.apply_gradients

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """One step on SCALED gradients: unscale, check, clip, apply if finite, update the
        scale. Must be called in a replica context (as Keras does)."""
        pair = paired(self, grads, trainable_variables)
        if pair is None:
            return
        grads, trainable_variables = pair
        if tf.distribute.in_cross_replica_context():
            raise InvalidArgumentError(
                "apply() must be called in a replica context (inside strategy.run)."
            )
        grads, finite = self._prepare(grads, trainable_variables)
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._apply_and_update(grads, trainable_variables, finite)
        else:
            # MirroredStrategy: the inner apply does a merge_call, which a tf.cond in replica
            # context may not hold (Keras 3's LossScaleOptimizer does the same).
            tf.distribute.get_replica_context().merge_call(
                self._cross_replica_apply, args=(grads, trainable_variables, finite)
            )

    def _prepare(self, grads: list, variables: list) -> tuple[list, tf.Tensor]:
        """(unscaled and clipped gradients, finite flag common to every replica)."""
        ctx = tf.distribute.get_replica_context()
        replicas = ctx.num_replicas_in_sync if ctx is not None else 1
        # Keras' float8 layers overwrite variables with their "gradient": no unscaling there.
        passthrough = [
            g is not None and self._overwrite_variable_with_gradient(var)
            for g, var in zip(grads, variables, strict=True)
        ]
        if self.max_norm is not None and replicas > 1:
            # Clip the gradient actually applied: the sum over replicas (the inner optimizer
            # would sum them later). IndexedSlices are all-reduced by concatenation.
            present = [i for i, g in enumerate(grads) if g is not None and not passthrough[i]]
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
            grads = list(grads)
            for i, g in zip(present, summed, strict=True):
                grads[i] = g
        tree = [None if p else _dense_or_values(g) for g, p in zip(grads, passthrough, strict=True)]
        unscaled, finite = self._scaler.unscale(tree, self.state)
        if self.max_norm is not None:
            unscaled, norm = numstab.clip_by_global_norm(
                unscaled, self.max_norm, norm_type=self.norm_type
            )
            finite = tf.logical_and(finite, tf.math.is_finite(norm))
            if replicas > 1:
                # Every replica holds the clipped sum; the inner optimizer sums the replicas'
                # gradients, so replica 0 hands it over and the others add zeros.
                first = tf.equal(ctx.replica_id_in_sync_group, 0)
                unscaled = [
                    None if g is None else tf.where(first, g, tf.zeros_like(g)) for g in unscaled
                ]
        elif replicas > 1:
            bad = ctx.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
            )
            finite = tf.equal(bad, 0.0)
        out = [
            g if p else _rebuild(g, u) for g, u, p in zip(grads, unscaled, passthrough, strict=True)
        ]
        return out, finite

    def _apply_inner(self, grads: list, variables: list) -> None:
        self.inner_optimizer.apply(grads, trainable_variables=variables)

    def _apply_and_update(self, grads: list, variables: list, finite: tf.Tensor) -> None:
        """Replica (or default) context: apply when finite, then update the scaler state."""
        state = self.state
        tf.cond(finite, lambda: self._apply_inner(grads, variables), lambda: None)
        self._assign_state(self._scaler.update(state, finite))

    def _cross_replica_apply(
        self, distribution: tf.distribute.Strategy, grads: Any, variables: list, finite: Any
    ) -> None:
        # Every replica holds the same flag (all-reduced in _prepare): take the first one.
        finite = distribution.experimental_local_results(finite)[0]
        state = self.state

        def apply_fn() -> None:
            distribution.extended.call_for_each_replica(self._apply_inner, args=(grads, variables))

        tf.cond(finite, apply_fn, lambda: None)
        self._assign_state(self._scaler.update(state, finite))

    def stateless_apply(
        self, optimizer_variables: Any, grads: Any, trainable_variables: Any
    ) -> NoReturn:
        """Not supported: the TensorFlow backend of Keras has no stateless apply."""
        raise NotImplementedError(
            "stateless_apply is not supported with the TensorFlow backend; use apply()."
        )

    # -- serialisation -------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """The inner optimizer (serialised), the scaler's fields, max_norm, norm_type, name."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "scaler": dataclasses.asdict(self._scaler),
            "max_norm": self.max_norm,
            "norm_type": self.norm_type,
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> LossScaleOptimizer:
        """Inverse of ``get_config``."""
        inner, config = inner_from_config(config, custom_objects)
        scaler = LossScaler(**config.pop("scaler"))
        return cls(inner, scaler, **config)


# tf.IndexedSlices: like TF's own clip_by_global_norm and tf-keras, only the raw values are
# unscaled, checked and clipped (numstab's core would sum repeated rows first: numstab.tree).
def _dense_or_values(g: Any) -> Any:
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _rebuild(original: Any, new: Any) -> Any:
    if isinstance(original, tf.IndexedSlices) and new is not None:
        return tf.IndexedSlices(new, original.indices, original.dense_shape)
    return new
