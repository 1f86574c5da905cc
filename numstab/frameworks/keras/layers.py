"""Every layer call of a Keras 3 model, seen while locating: shared by the per-backend
locators (``locate`` for TensorFlow and torch, ``locate_jax`` for JAX).

Each layer's ``call`` (the model's own included) is replaced on the instance, so Sequential,
functional and subclassed models all report each layer call; the replacements are removed
afterwards. A layer's name is its own Keras name; nesting joins the names with ".".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def wrapped_calls(model: Any, wrap: Callable[[Any, Callable, bool], Callable]) -> Iterator[None]:
    """While open, ``layer.call`` is ``wrap(layer, original_call, layer is model)`` for every
    layer of ``model``."""
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    try:
        for layer in layers:
            object.__setattr__(layer, "call", wrap(layer, layer.call, layer is model))
        yield
    finally:
        for layer in layers:
            with contextlib.suppress(AttributeError):
                object.__delattr__(layer, "call")


def own_variables(layer: Any) -> list:
    """The layer's variables that none of its sub-layers holds."""
    inner = {id(w) for sub in layer._flatten_layers(include_self=False) for w in sub.weights}
    return [w for w in layer.weights if id(w) not in inner]
