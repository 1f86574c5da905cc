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

import importlib
from collections.abc import Callable
from typing import Any

from numstab import frameworks
from numstab._config import AUTO, configured_backend
from numstab._dispatch import detect
from numstab._validate import short_repr
from numstab.errors import InvalidArgumentError
from numstab.locate._report import LOSS, LayerCall, LocateReport

__all__ = ["LOSS", "LayerCall", "LocateReport", "locate_nonfinite"]


def locate_nonfinite(
    model: Any,
    *inputs: Any,
    loss_fn: Callable[..., Any] | None = None,
    targets: Any = None,
    backend: str | None = None,
    **model_kwargs: Any,
) -> LocateReport:
    """Run ``model(*inputs, **model_kwargs)`` once (and ``loss_fn(output, targets)`` with its
    backward pass; ``loss_fn(output)`` when ``targets`` is None) and report the first layer,
    in execution order, whose output (forward) or own gradient (backward) is non-finite.

    ``model_kwargs``: the model's keyword arguments (Hugging Face's ``attention_mask=``,
    Flax's ``deterministic=True``); on JAX, those holding arrays are traced and the others
    are static (part of the compiled pass's cache key). Reads values on the host once at the
    end; eager only. The model's parameters and their ``.grad`` fields are not changed.
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
    library = _model_library(model, (*inputs, *model_kwargs.values()), backend)
    if library is None:  # a plain function of JAX arrays made of numstab.locate.jax.layer calls
        locate = frameworks.module("jax", "locate").locate
        return locate(model, inputs, loss_fn, targets, model_kwargs)
    return _code(library).locate_model(model, inputs, loss_fn, targets, model_kwargs)


def _code(library: frameworks.ModelLibrary) -> Any:
    """The numstab module that locates ``library``'s models."""
    return importlib.import_module(f"{frameworks.__name__}.{library.code}")


_KERAS_BACKENDS = ("tensorflow", "torch", "jax")


def _model_library(
    model: Any, inputs: tuple, backend: str | None
) -> frameworks.ModelLibrary | None:
    """The model's library (None for a plain JAX function), from the model's type
    (``numstab.frameworks.MODEL_LIBRARIES``); the framework it runs on must agree with the
    configured backend."""
    name = configured_backend(backend)
    library = frameworks.model_library(model)
    if library is None:
        if not callable(model) or (
            name != "jax" and (name != AUTO or detect(*_leaves(inputs)) != "jax")
        ):
            raise InvalidArgumentError(
                "Expected model to be a torch.nn.Module, a Keras 3 Layer/Model, an Equinox "
                "Module, a Flax NNX Module or bound linen Module, or a function of JAX arrays "
                "built from numstab.locate.jax.layer calls. Received: "
                f"model={short_repr(model, 80)}"
            )
        framework = "jax"
    elif library.runs_on is None:  # Keras: the backend it was imported with
        framework = _code(library).runs_on()
        if framework not in _KERAS_BACKENDS:
            raise InvalidArgumentError(
                f"Expected a Keras model on one of the backends {_KERAS_BACKENDS}. Received: "
                f"keras.backend.backend()={framework!r}"
            )
    else:
        framework = library.runs_on
    if name not in (AUTO, framework):
        kind = "jax" if library is None else library.name
        raise InvalidArgumentError(
            f"Expected backend={framework!r} (or None) for a {kind} model. "
            f"Received: backend={name!r}"
        )
    return library


def _leaves(inputs: tuple) -> list:
    from numstab.tree import flatten

    return [x for x in flatten(list(inputs))[0] if x is not None]
