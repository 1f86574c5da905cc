"""Sub-module calls of a bound Flax linen module as ``numstab.locate.jax.layer`` calls, so
that ``locate_nonfinite`` takes ``module.bind(variables)`` as it is.

While locating, ``flax.linen.intercept_methods`` sees every module method call: a
``__call__`` on a sub-module (not the root) becomes ``layer(name, fn, variables, *args)``,
where ``variables`` are the sub-module's own (all collections) and ``fn`` applies an unbound
clone of it to them, so its own sub-modules are intercepted in turn. Names are linen scope
names, joined by dots: ``blocks_1.attn.v`` for a list attribute made in ``setup``,
``Dense_0`` for an unnamed ``nn.compact`` sub-module. The model itself is the layer ``""``
(as in torch), applied the same way; its parameters are its own variables only (those
outside its sub-modules' scopes).

The model and its sub-modules are applied with their variables immutable and without RNGs:
call the model in its deterministic mode (no dropout, BatchNorm on running averages) while
locating.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from numstab.errors import InvalidArgumentError
from numstab.frameworks.jax.locate import Split, deterministic_only, layer, locate
from numstab.locate._report import LocateReport


def split(model: Any) -> Split:
    """The bound module as its variables (the compiled pass's arguments) and its unbound
    clone (the cache key), run as layers."""
    if model.scope is None:
        raise InvalidArgumentError(
            "Expected a bound Flax linen module (module.bind(variables)); an unbound module "
            "has no parameters to run. Received: model of type "
            f"{type(model).__name__} with model.scope=None"
        )
    unbound = model.clone(parent=None)
    variables = {c: dict(tree) for c, tree in model.variables.items()}
    return Split(variables, ("linen", unbound), lambda v: as_layers(unbound.bind(v)))


def as_layers(model: Any) -> Callable[..., Any]:
    """``model(*inputs, **kwargs)`` (a bound module) with every sub-module ``__call__`` a
    ``layer``."""
    import flax.linen as nn

    def run(*inputs: Any, **kwargs: Any) -> Any:
        with nn.intercept_methods(_as_layer):
            return _root(model, inputs, kwargs)

    return run


def _root(model: Any, inputs: tuple, kwargs: dict) -> Any:
    """``model(*inputs, **kwargs)`` as ``layer("", ...)``: its params are the root's own
    variables (not a sub-module's: those are the collections' nested scopes), merged back
    before applying."""
    variables = {c: dict(tree) for c, tree in model.variables.items()}
    own = {
        c: {k: v for k, v in t.items() if not isinstance(v, Mapping)} for c, t in variables.items()
    }
    unbound = model.clone(parent=None)

    def fn(own: dict, *args: Any, **kw: Any) -> Any:
        merged = {c: {**tree, **own[c]} for c, tree in variables.items()}
        return unbound.apply(merged, *args, **kw)

    fn.__name__ = type(model).__name__  # the report's layer type
    return layer("", fn, own, *inputs, **kwargs)


def _as_layer(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
    module = context.module
    path = module.scope.path if module.scope is not None else ()
    if context.method_name != "__call__" or not path:  # setup, other methods, the root
        return next_fun(*args, **kwargs)
    unbound = module.clone(parent=None)

    def fn(variables: Any, *a: Any, **k: Any) -> Any:
        return unbound.apply(variables, *a, **k)

    fn.__name__ = type(module).__name__  # the report's layer type
    return layer(".".join(path), fn, module.variables, *args, **kwargs)


def locate_model(
    model: Any, inputs: tuple, loss_fn, targets, kwargs: dict | None = None
) -> LocateReport:
    """The registry's entry point: a bound linen module, located as ``layer`` calls. Its
    sub-modules run with immutable variables and no RNGs: a training-mode Dropout or
    BatchNorm (flax's ``InvalidRngError``, ``ModifyScopeVariableError``) is refused."""
    refused = ("InvalidRngError", "ModifyScopeVariableError")
    with deterministic_only(model, refused, "deterministic=True, use_running_average=True"):
        return locate(split(model), inputs, loss_fn, targets, kwargs)
