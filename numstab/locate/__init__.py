"""Find the first layer whose output or gradient holds NaN or inf: ``locate_nonfinite``.

One forward pass (and, with ``loss_fn``, one backward pass) with every layer instrumented:

- torch: any ``torch.nn.Module`` (hooks on every sub-module, ``named_modules`` names);
- Keras 3 on TensorFlow, torch or JAX: any ``keras.Layer`` / ``keras.Model`` (Sequential,
  functional or subclassed; every sub-layer's ``call`` is wrapped while locating; names are
  the nesting of layer names below the model, joined by ".");
- JAX: a plain function whose sub-computations go through ``numstab.locate.jax.layer``; an
  Equinox module, a Flax NNX module or a bound Flax linen module as they are (their
  sub-module calls become layers, named by the library's own paths).

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
    kind, framework = _model_kind(model, inputs, backend)
    if kind == "torch":
        from numstab.locate import _torch

        return _torch.locate(model, inputs, loss_fn, targets)
    if kind == "keras" and framework != "jax":
        from numstab.locate import _keras

        return _keras.locate(model, inputs, loss_fn, targets, framework)
    from numstab.locate import jax as _jax

    if kind == "keras":
        from numstab.locate import _keras_jax

        model = _keras_jax.as_layers(model)
    elif kind == "library":
        from numstab.locate import _library_layers

        model = _library_layers.as_layers(_library_layers.library_of(model), model)
    elif kind == "linen":
        from numstab.locate import _linen

        model = _linen.as_layers(model)
    return _jax.locate(model, inputs, loss_fn, targets)


_KERAS_BACKENDS = ("tensorflow", "torch", "jax")


def _model_kind(model: Any, inputs: tuple, backend: str | None) -> tuple[str, str]:
    """(kind, framework): kind 'torch', 'keras', 'linen', 'library' (Equinox, Flax NNX) or
    'jax', from the model's type; the framework it runs on, checked against the backend."""
    name = configured_backend(backend)
    torch = sys.modules.get("torch")
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(model, keras.Layer):  # before torch: Keras on torch
        framework = keras.backend.backend()  # layers are torch.nn.Modules too
        if framework not in _KERAS_BACKENDS:
            raise InvalidArgumentError(
                f"Expected a Keras model on one of the backends {_KERAS_BACKENDS}. Received: "
                f"keras.backend.backend()={framework!r}"
            )
        kind = "keras"
    elif torch is not None and isinstance(model, torch.nn.Module):
        kind, framework = "torch", "torch"
    elif _is_linen_module(model):
        kind, framework = "linen", "jax"
    elif _is_library_module(model):
        kind, framework = "library", "jax"
    elif callable(model) and (
        name == "jax" or (name == AUTO and detect(*_leaves(inputs)) == "jax")
    ):
        kind, framework = "jax", "jax"
    else:
        raise InvalidArgumentError(
            "Expected model to be a torch.nn.Module, a Keras 3 Layer/Model, an Equinox "
            "Module, a Flax NNX Module or bound linen Module, or a function of JAX arrays "
            f"built from numstab.locate.jax.layer calls. Received: model={_short(model)}"
        )
    if name not in (AUTO, framework):
        raise InvalidArgumentError(
            f"Expected backend={framework!r} (or None) for a {kind} model. "
            f"Received: backend={name!r}"
        )
    return kind, framework


def _is_linen_module(model: Any) -> bool:
    linen = sys.modules.get("flax.linen")  # never imported here: a linen model imported it
    return linen is not None and isinstance(model, linen.Module)


def _is_library_module(model: Any) -> bool:
    from numstab.locate._library_layers import library_of

    return library_of(model) is not None


def _leaves(inputs: tuple) -> list:
    from numstab.tree import flatten

    return [x for x in flatten(list(inputs))[0] if x is not None]


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."
