"""numstab's adaptive clipping (ZClip, AGC) as Keras 3 optimizer wrappers.

    opt = ZClipOptimizer(keras.optimizers.AdamW(1e-3))            # zclip's defaults
    opt = AGCOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), clip_factor=0.01)
    model.compile(optimizer=opt, loss=...)
    model.fit(...)                                 # jit_compile False or True

Every ``apply`` / ``apply_gradients`` clips the gradients with the policy of
``numstab.adaptive_clipping`` (the same code as the torch and optax integrations), then hands
them to the inner optimizer's ``apply``. ZClip's state (``ZClipState``: count, buffer, mean,
var, norm) lives in five non-trainable Keras variables of the wrapper: it is carried through
``model.fit``'s compiled step, listed in ``optimizer.variables`` and saved with the model.

Works on the TensorFlow, JAX and torch backends of Keras (the wrapper reads the variables'
values as backend tensors and runs numstab's backend of the same name; on JAX through the base
class' ``stateless_apply``). Other Keras backends raise ``InvalidArgumentError``.

Edge cases: ``None`` gradients stay None and are left out of the norm. Gradients of variables
with ``overwrite_with_gradient`` (Keras' float8 layers) pass through untouched, as in Keras.
TensorFlow ``IndexedSlices`` (embedding gradients): ZClip takes their norm after summing
repeated indices (the dense gradient's norm; ``numstab.tree``) and scales those rows, keeping
them sparse; AGC needs whole units and densifies them. The inner optimizer may not use
``loss_scale_factor`` or ``gradient_accumulation_steps`` (the clipper would see scaled or
per-micro-batch gradients); wrap the clipping optimizer in a ``LossScaleOptimizer`` instead
(``model.compile`` does so itself under the ``mixed_float16`` policy). Under a TensorFlow
distribution strategy with more than one replica, ``apply`` raises (each replica holds only its
local gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras.src.utils import tracking  # what Keras' own LossScaleOptimizer.build uses

from numstab._dispatch import resolve_backend
from numstab.adaptive_clipping import ZClip, ZClipState
from numstab.agc import AGC
from numstab.clipping import global_norm, scale_leaves
from numstab.errors import InvalidArgumentError
from numstab.frameworks.keras import wrapping
from numstab.frameworks.keras.wrapping import inner_from_config, paired
from numstab.tree import flatten, unflatten

__all__ = ["AGCOptimizer", "ZClipOptimizer"]

_SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")


class _ClipOptimizer(keras.optimizers.Optimizer):
    """Wraps an inner optimizer: ``apply`` = clip (``_clip``), then ``inner.apply``.

    ``learning_rate``, ``iterations`` and ``finalize_variable_values`` are the inner
    optimizer's; ``variables`` are the wrapper's own followed by the inner ones.
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, name: str | None) -> None:
        backend_name = _numstab_backend()
        _check_inner(inner_optimizer)
        super().__init__(learning_rate=0.0, name=name)
        self._backend_name = backend_name
        self.inner_optimizer = inner_optimizer

    # -- delegation ----------------------------------------------------------------------------
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the wrapper's variables, then build the inner optimizer on ``var_list``."""
        self._build_own()
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)

    def _build_own(self) -> None:
        """Subclasses create their state variables here."""

    @property
    def variables(self) -> list:
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the step ------------------------------------------------------------------------------
    apply_gradients = wrapping.apply_gradients

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Clip ``grads``, then ``inner_optimizer.apply`` them."""
        pair = paired(self, grads, trainable_variables)
        if pair is None:
            return
        grads, variables = pair
        _check_single_replica()
        # Keras' float8 layers overwrite their variables with the "gradient": left untouched.
        positions = [
            i
            for i, (g, var) in enumerate(zip(grads, variables, strict=True))
            if g is not None and not self._overwrite_variable_with_gradient(var)
        ]
        clipped = self._clip([grads[i] for i in positions], [variables[i] for i in positions])
        for i, g in zip(positions, clipped, strict=True):
            grads[i] = g
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)

    def _clip(self, grads: list, variables: list) -> list:
        raise NotImplementedError

    # -- serialisation -------------------------------------------------------------------------
    def _policy_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """The name, the inner optimizer (serialised) and the policy's arguments."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **self._policy_config(),
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> Any:
        """Inverse of ``get_config``."""
        inner, config = inner_from_config(config, custom_objects)
        return cls(inner, **config)


@keras.saving.register_keras_serializable(package="numstab")
class ZClipOptimizer(_ClipOptimizer):
    """Wrap a Keras 3 optimizer with ZClip (``numstab.adaptive_clipping.ZClip``).

    Args:
        inner_optimizer: any ``keras.optimizers.Optimizer`` (not a LossScaleOptimizer, without
            ``loss_scale_factor`` or ``gradient_accumulation_steps``).
        name: the optimizer's name.
        **zclip_kwargs: ``ZClip``'s arguments (``alpha=0.97, z_thresh=2.5, max_grad_norm=1.0,
            eps=1e-6, warmup_steps=25, mode="zscore", clip_option="adaptive_scaling",
            clip_factor=1.0, skip_update_on_spike=False``).

    Each step multiplies every gradient by ``ZClip.coefficient`` of their global 2-norm and
    stores the next ``ZClipState`` in the variables ``zclip_count`` (int32), ``zclip_buffer``
    (float32 ``[max(warmup_steps, 1)]``), ``zclip_mean``, ``zclip_var`` and ``zclip_norm``
    (float32, the raw norm of the last step). ``zclip_state`` reads them back.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        *,
        name: str | None = None,
        **zclip_kwargs: Any,
    ) -> None:
        wrapping.check_kwargs(ZClip, zclip_kwargs)
        policy = ZClip(**zclip_kwargs)
        super().__init__(inner_optimizer, name)
        self.policy = policy

    def _build_own(self) -> None:
        init = self.policy.init(backend="numpy")
        self._state_variables = [
            self.add_variable(
                shape=value.shape,
                dtype=str(value.dtype),
                initializer=value,
                aggregation="only_first_replica",
                name=f"zclip_{field}",
            )
            for field, value in init._asdict().items()
        ]

    @property
    def zclip_state(self) -> ZClipState:
        """The current ``ZClipState`` as backend tensors (the initial state before building)."""
        if not self.built:
            return self.policy.init(backend=self._backend_name)
        return ZClipState(*(_value(x) for x in self._state_variables))

    def _clip(self, grads: list, variables: list) -> list:
        be = resolve_backend(backend=self._backend_name)
        leaves, treedef = flatten(grads)  # tf.IndexedSlices: their summed rows, kept sparse
        norm = global_norm(leaves, backend=be.name)
        coef, state = self.policy.coefficient(norm, self.zclip_state, backend=be.name)
        for variable, value in zip(self._state_variables, state, strict=True):
            variable.assign(value)
        return unflatten(treedef, scale_leaves(be, leaves, coef, toward_zero=True))

    def _policy_config(self) -> dict[str, Any]:
        return {name: getattr(self.policy, name) for name in wrapping.arguments(ZClip)}


@keras.saving.register_keras_serializable(package="numstab")
class AGCOptimizer(_ClipOptimizer):
    """Wrap a Keras 3 optimizer with unit-wise adaptive clipping (``AGC``, NFNets).

    Args:
        inner_optimizer: as for ``ZClipOptimizer``.
        clip_factor, eps: ``limit = clip_factor * max(|W|, eps)`` per unit.
        layout: ``"io"`` (default): Keras kernels put the output axis last (Dense
            ``(in, out)``, Conv ``HWIO``) on every backend, so a unit is an output neuron, as
            ``optax.adaptive_grad_clip``.
        axis: reduced axes for every variable, overriding ``layout``.
        name: the optimizer's name.

    Stateless: no variables besides the inner optimizer's.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        *,
        layout: str = "io",
        axis: int | Sequence[int] | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        wrapping.check_kwargs(AGCOptimizer, kwargs)
        policy = AGC(clip_factor, eps, layout=layout, axis=axis)
        super().__init__(inner_optimizer, name)
        self.policy = policy

    def _clip(self, grads: list, variables: list) -> list:
        params = [_value(var) for var in variables]
        return self.policy.clip(grads, params, backend=self._backend_name)  # sparse: dense

    def _policy_config(self) -> dict[str, Any]:
        axis = self.policy.axis
        return {
            "clip_factor": self.policy.clip_factor,
            "eps": self.policy.eps,
            "layout": self.policy.layout,
            "axis": None if axis is None else list(axis),
        }


# -- checks ------------------------------------------------------------------------------------
def _numstab_backend() -> str:
    name = keras.backend.backend()
    if name not in _SUPPORTED_BACKENDS:
        raise InvalidArgumentError(
            "Expected the tensorflow, jax or torch backend of Keras for numstab's clipping "
            f"optimizers. Received: KERAS_BACKEND={name!r}"
        )
    return name


def _check_inner(inner: Any) -> None:
    if not isinstance(inner, keras.optimizers.Optimizer) or isinstance(
        inner, keras.optimizers.LossScaleOptimizer
    ):
        raise InvalidArgumentError(
            "Expected inner_optimizer to be a keras.optimizers.Optimizer that is not a "
            "LossScaleOptimizer (wrap the clipping optimizer in the LossScaleOptimizer "
            f"instead). Received: inner_optimizer={inner!r}"
        )
    for attr in ("loss_scale_factor", "gradient_accumulation_steps"):
        if getattr(inner, attr, None) is not None:
            raise InvalidArgumentError(
                f"Expected an inner_optimizer without {attr} (the clipper would see "
                f"{'scaled' if attr == 'loss_scale_factor' else 'per-micro-batch'} gradients). "
                f"Received: inner_optimizer.{attr}={getattr(inner, attr)!r}"
            )


def _check_single_replica() -> None:
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        raise InvalidArgumentError(
            "Expected a single replica: numstab's clipping optimizers do not all-reduce the "
            "gradients before clipping. Received: num_replicas_in_sync="
            f"{tf.distribute.get_strategy().num_replicas_in_sync}"
        )


# -- values ------------------------------------------------------------------------------------
def _value(variable: Any) -> Any:
    """A variable's current value as a backend tensor (the mapped value in a StatelessScope)."""
    value = variable.value
    if hasattr(value, "read_value"):  # TensorFlow: a tf.Variable
        return value.read_value()
    return value.detach() if hasattr(value, "detach") else value  # torch: no autograd graph
