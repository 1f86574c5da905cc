"""What numstab's Keras optimizer wrappers share (imports ``keras`` only)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import keras

from numstab.errors import InvalidArgumentError


def arguments(cls: type) -> list[str]:
    """The named arguments of ``cls.__init__`` (not ``self``, not a ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def check_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    """``InvalidArgumentError`` naming the first keyword of ``kwargs`` that ``cls.__init__``
    does not name (a ZClip setting misspelt; a Keras optimizer argument given to a numstab
    wrapper, where Python's ``TypeError`` came before), with ``cls``' arguments."""
    unknown = sorted(set(kwargs) - set(arguments(cls)))
    if not unknown:
        return
    name = unknown[0]
    why = ""
    if name in ("gradient_accumulation_steps", "loss_scale_factor"):
        why = " (not supported: the wrapper would see per-micro-batch or scaled gradients)"
    raise InvalidArgumentError(
        f"Expected arguments of {cls.__name__} ({', '.join(arguments(cls))}){why}. "
        f"Received: {name}={kwargs[name]!r}"
    )


def built_variables(optimizer: Any, trainable_variables: Sequence[Any] | None) -> list:
    """Build ``optimizer`` on its first ``apply`` (as Keras' own optimizers do) and return the
    variables this call applies to: ``trainable_variables``, or those it was built on."""
    if not optimizer.built:
        if trainable_variables is None:
            raise InvalidArgumentError(
                "Expected trainable_variables on the first call (the optimizer is not "
                "built). Received: trainable_variables=None"
            )
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(list(trainable_variables))
        optimizer.built = True
    if trainable_variables is None:
        return list(optimizer._trainable_variables)
    return list(trainable_variables)


def inner_from_config(config: dict[str, Any], custom_objects: dict[str, Any] | None):
    """``(inner optimizer, the rest of the config)`` of a wrapping optimizer's config."""
    config = dict(config)
    inner = keras.saving.deserialize_keras_object(
        config.pop("inner_optimizer"), custom_objects=custom_objects
    )
    return inner, config


def paired(optimizer: Any, grads: Sequence[Any], trainable_variables: Sequence[Any] | None):
    """``(grads, variables)`` of one ``apply`` call as lists (the optimizer built on its first
    call), one gradient per variable; None when there are no gradients."""
    grads = list(grads)
    if not grads:
        return None
    variables = built_variables(optimizer, trainable_variables)
    if len(grads) != len(variables):
        raise InvalidArgumentError(
            f"Expected one gradient per variable. Received: {len(grads)} gradients for "
            f"{len(variables)} variables"
        )
    for i, (g, var) in enumerate(zip(grads, variables, strict=True)):
        have, want = _static_shape(g), _static_shape(var)
        if have is not None and want is not None and have != want:  # (the framework's error)
            raise InvalidArgumentError(
                f"Expected each gradient of its variable's shape. Received: grads[{i}].shape="
                f"{have} for variable {getattr(var, 'path', i)!r} of shape {want}"
            )
    return grads, variables


def _static_shape(x: Any) -> tuple | None:
    """``x``'s shape where every size is known while tracing (None otherwise, or for None)."""
    try:
        dims = tuple(x.shape)
    except (AttributeError, TypeError, ValueError):  # None, no shape, TF's unknown rank
        return None
    return None if any(d is None for d in dims) else tuple(int(d) for d in dims)


def apply_gradients(optimizer: Any, grads_and_vars: Any) -> Any:
    """A wrapper's ``apply_gradients``: its ``apply`` on (gradient, variable) pairs (the
    scaled gradients, for a loss-scale optimizer); returns the inner ``iterations``."""
    grads, trainable_variables = zip(*grads_and_vars, strict=True)
    optimizer.apply(grads, trainable_variables)
    return optimizer.iterations
