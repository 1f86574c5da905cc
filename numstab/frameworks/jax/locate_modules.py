"""Sub-module calls of a module library's model as ``numstab.locate.jax.layer`` calls, so that
``locate_nonfinite`` takes Equinox and Flax NNX models as they are.

While locating, the ``__call__`` of every module class in the model is replaced (and put back
afterwards): a call on a direct child of the module that is running becomes
``layer(child_name, fn, child, *args)``, where ``fn`` runs the original ``__call__`` on the
(probed) child it is handed. Names are the library's own paths, relative to the parent and
joined by ``layer`` into full paths. The root model is the layer ``""`` (as in torch), whose
parameters are its own only (those outside its sub-modules, torch's ``recurse=False``); a
sub-module's parameters include its sub-modules'.

- Equinox: the module is its own pytree of parameters; names are field paths (``layers[0]``,
  ``mlp.linear1``).
- Flax NNX: ``nnx.split`` gives the parameters' pytree (``State``) and ``fn`` merges it back;
  names are NNX attribute paths joined by dots (``layers.0``, ``block.attn``). A module that
  changes its state while it runs (Dropout's RNG count, BatchNorm's statistics: training
  mode) is refused; a value that a lifted transformation (``nnx.remat``, ``nnx.jit``) only
  wrote back, as a new tracer forwarding the old one, is no change (``_unchanged``).

The model's arrays are arguments of the compiled pass and the rest its cache key (Equinox:
the non-array leaves and the tree structure; NNX: the ``GraphDef``), so a model of the same
structure, with other values, reuses the pass (``locate.Split``).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from numstab.frameworks.jax.locate import Split, deterministic_only, layer, locate
from numstab.locate._report import LocateReport

#: id of each direct child of the running module -> its name relative to that module
_CHILDREN: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "numstab_locate_children", default=None
)
_MISSING = object()


class Library:
    """How one library exposes a module's children and its parameters."""

    module_type: type

    def children(self, module: Any) -> dict[int, str]:
        """id -> name of the direct sub-modules (through lists, tuples and dicts)."""
        out: dict[int, str] = {}
        for name, value in self.fields(module):
            self._collect(value, name, out)
        return out

    def _collect(self, value: Any, path: str, out: dict[int, str]) -> None:
        # containers first: NNX's List and Dict are modules that hold modules
        if isinstance(value, Sequence) and not isinstance(value, str):
            for i, item in enumerate(value):
                self._collect(item, self.index(path, i), out)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                self._collect(item, self.key(path, key), out)
        elif isinstance(value, self.module_type):
            out.setdefault(id(value), path)

    def modules(self, model: Any) -> Iterator[Any]:
        """Every module in the model, the root included."""
        seen: set[int] = set()
        stack = [model]
        while stack:
            module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield module
            for _, value in self.fields(module):
                self._collect_objects(value, stack)

    def _collect_objects(self, value: Any, stack: list) -> None:
        if isinstance(value, Sequence) and not isinstance(value, str):
            for item in value:
                self._collect_objects(item, stack)
        elif isinstance(value, Mapping):
            for item in value.values():
                self._collect_objects(item, stack)
        elif isinstance(value, self.module_type):
            stack.append(value)

    def fields(self, module: Any) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def index(self, path: str, i: int) -> str:
        raise NotImplementedError

    def key(self, path: str, k: Any) -> str:
        raise NotImplementedError

    def params_of(self, module: Any) -> tuple[Any, Callable[[Any], Any]]:
        """(the module's parameters as a pytree, a function rebuilding the module from it)."""
        raise NotImplementedError

    def own_params_of(self, module: Any) -> tuple[Any, Callable[[Any], Any]]:
        """``params_of`` for the parameters outside the module's sub-modules only."""
        raise NotImplementedError

    def split(self, model: Any) -> Split:
        """The model as its arrays and a hashable rest, run as layers (``as_layers``)."""
        raise NotImplementedError

    def run(self, module: Any, call: Callable[[], Any]) -> Any:
        """``call()``, the module's own code; a library whose modules hold state checks here
        that it is left unchanged."""
        return call()

    def call_as_layer(self, name: str, call: Callable, module: Any, args: tuple, kw: dict):
        """``call(module, *args, **kw)`` as ``layer(name, ...)``, with the (probed) module's
        own children named while it runs; the root (``name == ""``) with its own parameters."""
        params, rebuild = self.params_of(module) if name else self.own_params_of(module)

        def fn(params: Any, *a: Any, **k: Any) -> Any:
            probed = rebuild(params)
            token = _CHILDREN.set(self.children(probed))
            try:
                return self.run(probed, lambda: call(probed, *a, **k))
            finally:
                _CHILDREN.reset(token)

        fn.__name__ = type(module).__name__  # the report's layer type
        return layer(name, fn, params, *args, **kw)


class Equinox(Library):
    def __init__(self) -> None:
        import equinox

        self.module_type = equinox.Module

    def fields(self, module: Any) -> list[tuple[str, Any]]:
        import dataclasses

        return [(f.name, getattr(module, f.name, None)) for f in dataclasses.fields(module)]

    def index(self, path: str, i: int) -> str:
        return f"{path}[{i}]"

    def key(self, path: str, k: Any) -> str:
        return f"{path}[{k!r}]"

    def params_of(self, module: Any) -> tuple[Any, Callable[[Any], Any]]:
        return module, lambda probed: probed  # an Equinox module is its own pytree

    def own_params_of(self, module: Any) -> tuple[Any, Callable[[Any], Any]]:
        import jax

        kids = self.children(module)
        leaves, treedef = jax.tree_util.tree_flatten(module, is_leaf=lambda x: id(x) in kids)
        mine = [id(x) not in kids for x in leaves]
        own = treedef.unflatten([x if m else None for m, x in zip(mine, leaves, strict=True)])

        def rebuild(probed: Any) -> Any:
            new = iter(jax.tree_util.tree_leaves(probed))  # the module, children in place
            return treedef.unflatten(
                [next(new) if m else x for m, x in zip(mine, leaves, strict=True)]
            )

        return own, rebuild

    def split(self, model: Any) -> Split:
        import equinox
        import jax

        arrays, rest = equinox.partition(model, equinox.is_array)
        leaves, treedef = jax.tree_util.tree_flatten(rest)
        return Split(
            arrays,
            ("equinox", treedef, tuple(leaves)),
            lambda arrays: as_layers(self, equinox.combine(arrays, rest)),
        )


class FlaxNNX(Library):
    def __init__(self) -> None:
        from flax import nnx

        self.nnx = nnx
        self.module_type = nnx.Module

    def fields(self, module: Any) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in vars(module).items() if not k.startswith("_")]

    def index(self, path: str, i: int) -> str:
        return f"{path}.{i}"

    def key(self, path: str, k: Any) -> str:
        return f"{path}.{k}"

    def params_of(self, module: Any) -> tuple[Any, Callable[[Any], Any]]:
        graphdef, state = self.nnx.split(module)
        return state, lambda probed: self.nnx.merge(graphdef, probed)

    def own_params_of(self, module: Any) -> tuple[Any, Callable[[Any], Any]]:
        kids = [k + "." for k in self.children(module).values()]

        def own(path: tuple, _: Any) -> bool:
            return not ".".join(map(str, (*path, ""))).startswith(tuple(kids))

        graphdef, state, rest = self.nnx.split(module, own, ...)
        return state, lambda probed: self.nnx.merge(graphdef, probed, rest)

    def split(self, model: Any) -> Split:
        graphdef, state = self.nnx.split(model)
        return Split(
            state,
            ("nnx", graphdef),
            lambda state: as_layers(self, self.nnx.merge(graphdef, state)),
        )

    def run(self, module: Any, call: Callable[[], Any]) -> Any:
        import jax

        before = jax.tree_util.tree_leaves(self.nnx.state(module))
        out = call()
        after = jax.tree_util.tree_leaves(self.nnx.state(module))
        if len(after) != len(before) or not all(map(_unchanged, after, before)):
            raise StateChanged(
                f"{type(module).__name__} changed its state while running (Dropout's RNG "
                "count, BatchNorm's statistics)"
            )
        return out


def _unchanged(after: Any, before: Any) -> bool:
    """Whether a state leaf is the one it was before the call: the same object, or a value
    that a lifted transformation (``nnx.remat``, ``nnx.jit``) only passed through. Those write
    every Variable back on exit, each a new tracer: it counts as unchanged when the traced
    program forwards it from ``before`` (its staged equation's inner jaxpr returns an input
    as is; in the backward pass, their primal values are compared). Any other new value, or
    a JAX whose tracers cannot be read so, is a change."""
    for _ in range(64):  # nested transformations: one step each
        if after is before:
            return True
        try:
            if hasattr(after, "primal") and hasattr(before, "primal"):
                after, before = after.primal, before.primal  # the backward pass: linearized
            else:
                after = _forwarded_from(after)
        except Exception:  # JAX internals differ: a change, as before
            return False
        if after is None:
            return False
    return False


def _forwarded_from(value: Any) -> Any:
    """The input tracer that the staged equation making ``value`` returns as is, or None."""
    import jax

    if not isinstance(value, jax.core.Tracer) or getattr(value, "parent", None) is None:
        return None
    eqn = value.parent
    k = _passed_through(eqn, [id(v) for v in eqn.outvars].index(id(value.val)))
    return None if k is None else eqn.in_tracers[k]


def _passed_through(eqn: Any, out: int) -> int | None:
    """The index of the input that output ``out`` of a call-like equation (``jit``,
    ``checkpoint``) is, through any calls nested in its jaxpr; None if it is computed, or if
    its type differs (``scan`` stacking a constant)."""
    k = _inner_source(eqn, out)
    if k is None or eqn.outvars[out].aval != getattr(eqn.invars[k], "aval", None):
        return None
    return k


def _inner_source(eqn: Any, out: int) -> int | None:
    jaxpr = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's open jaxpr
    if jaxpr is None or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    var = jaxpr.outvars[out]
    made_by = _PRODUCERS.get(jaxpr)
    if made_by is None:
        made_by = {id(v): (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}
        _PRODUCERS[jaxpr] = made_by
    for _ in range(len(jaxpr.eqns) + 1):
        for k, invar in enumerate(jaxpr.invars):
            if invar is var:
                return k
        if id(var) not in made_by:
            return None
        inner, i = made_by[id(var)]
        k = _passed_through(inner, i)
        if k is None:
            return None
        var = inner.invars[k]
    return None


#: an inner jaxpr -> {id(var): (the equation making it, its output index)}
_PRODUCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StateChanged(Exception):
    """An NNX module wrote its state while located: it runs in training mode."""


def library_of(model: Any) -> Library | None:
    """The library whose module ``model`` is, as the registry's ``MODEL_LIBRARIES`` finds it
    (only libraries already imported are asked); None for any other model."""
    from numstab import frameworks

    found = frameworks.model_library(model)
    library = {"equinox": Equinox, "nnx": FlaxNNX}.get(found.name if found else "")
    return library() if library else None


def as_layers(library: Library, model: Any) -> Callable[..., Any]:
    """``model(*inputs, **kwargs)`` with every sub-module call made a ``layer``."""
    classes = {type(m) for m in library.modules(model)}

    def run(*inputs: Any, **kwargs: Any) -> Any:
        with _patched(library, classes):
            token = _CHILDREN.set({id(model): ""})  # the model itself is the layer ""
            try:
                return model(*inputs, **kwargs)
            finally:
                _CHILDREN.reset(token)

    return run


@contextlib.contextmanager
def _patched(library: Library, classes: set[type]) -> Iterator[None]:
    own = {cls: vars(cls).get("__call__", _MISSING) for cls in classes}
    try:
        for cls in classes:
            cls.__call__ = _layer_call(library, cls.__call__)
        yield
    finally:
        for cls, original in own.items():
            if original is _MISSING:
                delattr(cls, "__call__")
            else:
                cls.__call__ = original


def _layer_call(library: Library, call: Callable) -> Callable:
    def layer_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = (_CHILDREN.get() or {}).get(id(self))
        if name is None:  # a module called through super(), or one made on the fly
            return call(self, *args, **kwargs)
        token = _CHILDREN.set({})  # the child's own children are set by call_as_layer
        try:
            return library.call_as_layer(name, call, self, args, kwargs)
        finally:
            _CHILDREN.reset(token)

    return layer_call


def locate_model(
    model: Any, inputs: tuple, loss_fn, targets, kwargs: dict | None = None
) -> LocateReport:
    """The registry's entry point: an Equinox or Flax NNX module, located as ``layer`` calls.
    An NNX module in training mode (Dropout's RNG counts, BatchNorm's running statistics)
    changes its state inside the traced pass (``StateChanged``; flax's ``TraceContextError``
    for state it reaches outside the model). An Equinox Dropout in training mode asks for a
    key (its ``RuntimeError``, which named no way out)."""
    library = library_of(model)
    if isinstance(library, Equinox):
        how, refused = "eqx.nn.inference_mode(model)", ("EquinoxDropoutNeedsKey",)
    else:
        how, refused = "model.eval()", ("StateChanged", "TraceContextError")
    with deterministic_only(model, refused, how), _dropout_key_error_named():
        return locate(library.split(model), inputs, loss_fn, targets, kwargs)


class EquinoxDropoutNeedsKey(RuntimeError):
    """Equinox's "Dropout requires a key when running in non-deterministic mode"."""


@contextlib.contextmanager
def _dropout_key_error_named() -> Iterator[None]:
    try:
        yield
    except RuntimeError as error:
        if "requires a key" not in str(error) or "Dropout" not in str(error):
            raise
        raise EquinoxDropoutNeedsKey(str(error)) from error
