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

A lifted module (``nn.remat(Block)``, ``nn.scan(Block, ...)``, ``nn.vmap``, ``nn.jit``, a
``__call__`` decorated with one of them) runs its code inside the transformation, where a
sub-module's values cannot be recorded (they cannot leave it), and flax's wrapper of its
``__call__`` is not seen by ``intercept_methods``. While locating, that wrapper is replaced
(``_lifted_calls_as_layers``): a lifted module's call becomes ``layer(scope name, ...)``,
made outside its transformation, like any sub-module's, and its own sub-modules, called
inside it, are part of it (``blocks_1`` for ``nn.remat(Block)(name="blocks_1")``; ``layers``
for an ``nn.scan`` over stacked blocks: the scan is one layer).

The model and its sub-modules are applied with their variables immutable and without RNGs:
call the model in its deterministic mode (no dropout, BatchNorm on running averages) while
locating.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
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
    return Split(variables, ("linen", unbound), lambda v: as_layers(unbound.bind(v)), _ADVICE)


#: how to locate a linen model whose own code lifts a function calling a sub-module
_ADVICE = (
    "Flax linen: lift a module class instead of a function (nn.remat(Block), nn.scan(Block, "
    "...), nn.vmap(Block, ...), nn.jit(Block), or a __call__ decorated with nn.remat: each "
    "is located as one layer, named by its scope)"
)


def as_layers(model: Any) -> Callable[..., Any]:
    """``model(*inputs, **kwargs)`` (a bound module) with every sub-module ``__call__`` a
    ``layer``."""
    import flax.linen as nn

    def run(*inputs: Any, **kwargs: Any) -> Any:
        with nn.intercept_methods(_as_layer), _lifted_calls_as_layers():
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
    return _sub_module_layer(module, args, kwargs)


def _sub_module_layer(module: Any, args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` as ``layer(scope name, fn, its variables, ...)``, where
    ``fn`` applies an unbound clone of it to the (probed) variables it is handed."""
    path = module.scope.path
    unbound = module.clone(parent=None)

    def fn(variables: Any, *a: Any, **k: Any) -> Any:
        return unbound.apply(variables, *a, **k)

    fn.__name__ = type(module).__name__  # the report's layer type
    return layer(".".join(path), fn, module.variables, *args, **kwargs)


#: flax.linen.transforms' functions that make a lifted module class (nn.remat(Block), ...)
_CLASS_LIFTS = ("module_class_lift_transform", "module_class_lift_transform_cached")


@contextlib.contextmanager
def _lifted_calls_as_layers() -> Iterator[None]:
    """While it is active, the ``__call__`` of every lifted linen module class, those that
    exist and those made meanwhile (a compact ``__call__`` making ``nn.remat(Block)`` on
    each call), is ``_lifted_layer`` of flax's; all are put back on exit."""
    import flax.linen as nn
    import flax.linen.transforms as lifts

    patched: dict[type, Any] = {}
    makers = {name: getattr(lifts, name) for name in _CLASS_LIFTS if hasattr(lifts, name)}

    def hooked(make: Callable) -> Callable:
        @functools.wraps(make)
        def make_and_patch(*args: Any, **kwargs: Any) -> Any:
            made = make(*args, **kwargs)
            _patch(getattr(made, "func", made), patched)  # a class or a functools.partial
            return made

        return make_and_patch

    try:
        for cls in _subclasses(nn.Module):
            _patch(cls, patched)
        for name, make in makers.items():
            setattr(lifts, name, hooked(make))
        yield
    finally:
        for name, make in makers.items():
            setattr(lifts, name, make)
        for cls, call in patched.items():
            cls.__call__ = call


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    stack = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in seen:
            seen.add(sub)
            yield sub
            stack.extend(sub.__subclasses__())


def _patch(cls: Any, patched: dict[type, Any]) -> None:
    """Replace ``cls.__call__`` when it is flax's lifting wrapper (``wrapped_fn`` of
    ``flax.linen.transforms``: a lifted class, or a ``__call__`` decorated with a lift)."""
    import flax.linen.transforms as lifts

    call = vars(cls).get("__call__") if isinstance(cls, type) else None
    code = getattr(call, "__code__", None)
    if cls in patched or code is None or code.co_filename != lifts.__file__:
        return
    if code.co_name != "wrapped_fn":
        return
    patched[cls] = call
    cls.__call__ = _lifted_layer(call)


def _lifted_layer(call: Callable) -> Callable:
    """A lifted module's ``__call__`` as a layer, called outside its transformation; applied
    alone (``fn`` of that layer: its scope is then the root's) it is flax's own."""

    @functools.wraps(call)
    def lifted_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.scope is None or not self.scope.path:  # applied alone, or the model itself
            return call(self, *args, **kwargs)
        return _sub_module_layer(self, args, kwargs)

    return lifted_call


def locate_model(
    model: Any, inputs: tuple, loss_fn, targets, kwargs: dict | None = None
) -> LocateReport:
    """The registry's entry point: a bound linen module, located as ``layer`` calls. Its
    sub-modules run with immutable variables and no RNGs: a training-mode Dropout or
    BatchNorm (flax's ``InvalidRngError``, ``ModifyScopeVariableError``) is refused."""
    refused = ("InvalidRngError", "ModifyScopeVariableError")
    with deterministic_only(model, refused, "deterministic=True, use_running_average=True"):
        return locate(split(model), inputs, loss_fn, targets, kwargs)
