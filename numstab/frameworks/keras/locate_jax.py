"""A Keras 3 model on JAX as ``numstab.locate.jax.layer`` calls, so that
``locate_nonfinite`` takes it as it is, with the report Keras on TensorFlow gives.

While locating, every layer call ``layer.call(*args)`` becomes
``layer(name, fn, values, *args)``: ``values`` are the layer's variables as the caller sees
them (the model's own at the top, the probed ones of the enclosing layer below), and ``fn``
runs the original ``call`` inside a ``keras.StatelessScope`` that maps each variable to the
value it is handed, so the probes reach the layer's own computation and its sub-layers. The
model itself is the layer ``""``; names are Keras layer names joined by ".", parameter paths
Keras variable paths, as on TensorFlow. The variables' values are arguments of the compiled
pass and the model its cache key (``split``): locating the model again, after training steps,
reuses the pass.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from numstab.frameworks.jax.locate import Split
from numstab.frameworks.jax.locate import layer as as_layer
from numstab.frameworks.keras.layers import wrapped_calls

#: id(variable) -> the value the running layer was handed for it
_VALUES: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "numstab_locate_keras_jax", default=None
)


def split(model: Any) -> Split:
    """The model as its variables' values and itself (a Keras model is one object, whose
    variables are fixed once it is built), run as layers."""
    variables = list(model.variables)
    # the stored values, read outside any layer (inside one, Keras may autocast them)
    values = [v.value for v in variables]
    return Split(values, ("keras", model), lambda values: as_layers(model, variables, values))


def as_layers(model: Any, variables: list, values: list) -> Callable[..., Any]:
    """``model(*inputs)`` with every layer call made a ``layer``, ``variables`` mapped to
    ``values``."""

    def run(*inputs: Any, **kwargs: Any) -> Any:
        token = _VALUES.set({id(v): x for v, x in zip(variables, values, strict=True)})
        try:
            with wrapped_calls(model, _layer_call):
                return model(*inputs, **kwargs)
        finally:
            _VALUES.reset(token)

    return run


def _layer_call(keras_layer: Any, call: Callable, is_root: bool) -> Callable:
    import keras

    variables = list(keras_layer.variables)

    def fn(values: list, *args: Any, **kwargs: Any) -> Any:
        mapping = list(zip(variables, values, strict=True))
        token = _VALUES.set({id(v): x for v, x in mapping})
        try:
            with keras.StatelessScope(state_mapping=mapping):
                return call(*args, **kwargs)
        finally:
            _VALUES.reset(token)

    fn.__name__ = type(keras_layer).__name__  # the report's layer type
    fn.param_paths = [v.path for v in variables if "float" in str(v.dtype)]

    def layer_call(*args: Any, **kwargs: Any) -> Any:
        outer = _VALUES.get()  # the stored values, or those the enclosing layer was handed
        values = [outer[id(v)] for v in variables]
        name = "" if is_root else keras_layer.name
        return as_layer(name, fn, values, *args, **kwargs)

    return layer_call
