"""Find the first layer whose output or gradient holds NaN or inf: ``locate_nonfinite``.

One forward pass (and, with ``loss_fn``, one backward pass) with every layer instrumented:

- torch: any ``torch.nn.Module`` (hooks on every sub-module, ``named_modules`` names);
- Keras 3 on TensorFlow: any ``keras.Layer`` / ``keras.Model`` (Sequential, functional or
  subclassed; every sub-layer's ``call`` is wrapped while locating; names are the nesting
  of layer names below the model, joined by ".");
- JAX: a plain function whose sub-computations go through ``numstab.locate.jax.layer``
  (flax and equinox are not supported: they are not installed where numstab is tested).

See docs/semantics.md §15 for the exact rules.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from numstab._config import AUTO, configured_backend
from numstab._dispatch import detect
from numstab.errors import InvalidArgumentError
from numstab.locate._report import LOSS, LayerCall, LocateReport

__all__ = ["LOSS", "LayerCall", "LocateReport", "locate_nonfinite"]


def locate_nonfinite(
    model: Any,
    *inputs: Any,
    loss_fn: Callable[..., Any] | None = None,
    targets: Any = None,
    backend: str | None = None,
) -> LocateReport:
    """Run ``model(*inputs)`` once (and ``loss_fn(output, targets)`` with its backward pass;
    ``loss_fn(output)`` when ``targets`` is None) and report the first layer, in execution
    order, whose output (forward) or own gradient (backward) is non-finite.

    Reads values on the host once at the end; eager only. The model's parameters and their
    ``.grad`` fields are not changed.
    """
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidArgumentError(
            f"Expected loss_fn to be callable or None. Received: loss_fn={loss_fn!r}"
        )
    if loss_fn is None and targets is not None:
        raise InvalidArgumentError(
            "Expected loss_fn when targets are given (targets are only passed to loss_fn). "
            "Received: loss_fn=None"
        )
    kind = _model_kind(model, inputs, backend)
    if kind == "torch":
        from numstab.locate import _torch

        return _torch.locate(model, inputs, loss_fn, targets)
    if kind == "keras":
        from numstab.locate import _keras

        return _keras.locate(model, inputs, loss_fn, targets)
    from numstab.locate import jax as _jax

    if kind == "library":
        from numstab.locate import _library_layers

        model = _library_layers.as_layers(_library_layers.library_of(model), model)
    return _jax.locate(model, inputs, loss_fn, targets)


def _model_kind(model: Any, inputs: tuple, backend: str | None) -> str:
    """'torch', 'keras' or 'jax': from the model's type, checked against the backend."""
    name = configured_backend(backend)
    torch = sys.modules.get("torch")
    keras = sys.modules.get("keras")
    if torch is not None and isinstance(model, torch.nn.Module):
        kind = "torch"
    elif keras is not None and isinstance(model, keras.Layer):
        if keras.backend.backend() != "tensorflow":
            raise InvalidArgumentError(
                "Expected a Keras model on the TensorFlow backend (KERAS_BACKEND=tensorflow); "
                "for Keras on JAX, locate the model's stateless call through "
                "numstab.locate.jax. Received: keras.backend.backend()="
                f"{keras.backend.backend()!r}"
            )
        kind = "keras"
    elif "flax.linen" in sys.modules and isinstance(model, sys.modules["flax.linen"].Module):
        raise InvalidArgumentError(
            "Expected a torch.nn.Module, a Keras 3 model on TensorFlow, an Equinox or Flax NNX "
            "Module, or a function built from numstab.locate.jax.layer calls; Flax linen "
            f"modules are not supported yet. Received: model of type {type(model).__name__}"
        )
    elif _is_library_module(model):
        kind = "library"  # Equinox, Flax NNX: JAX models whose sub-modules become layers
    elif callable(model) and (
        name == "jax" or (name == AUTO and detect(*_leaves(inputs)) == "jax")
    ):
        kind = "jax"
    else:
        raise InvalidArgumentError(
            "Expected model to be a torch.nn.Module, a Keras 3 Layer/Model, an Equinox or Flax "
            "NNX Module, or a function of JAX arrays built from numstab.locate.jax.layer "
            "calls. Received: "
            f"model={_short(model)}"
        )
    wanted = {"torch": "torch", "keras": "tensorflow", "jax": "jax", "library": "jax"}[kind]
    if name not in (AUTO, wanted):
        raise InvalidArgumentError(
            f"Expected backend={wanted!r} (or None) for a {kind} model. Received: backend={name!r}"
        )
    return kind


def _is_library_module(model: Any) -> bool:
    from numstab.locate._library_layers import library_of

    return library_of(model) is not None


def _leaves(inputs: tuple) -> list:
    from numstab.tree import flatten

    return [x for x in flatten(list(inputs))[0] if x is not None]


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
