"""Sub-module calls of a module library's model as ``numstab.locate.jax.layer`` calls, so that
``locate_nonfinite`` takes Equinox and Flax NNX models as they are.

While locating, the ``__call__`` of every module class in the model is replaced (and put back
afterwards): a call on a direct child of the module that is running becomes
``layer(child_name, fn, child, *args)``, where ``fn`` runs the original ``__call__`` on the
(probed) child it is handed. Names are the library's own paths, relative to the parent and
joined by ``layer`` into full paths. The root model is the layer ``""`` (as in torch), whose
parameters are its own (those outside its sub-modules, torch's ``recurse=False``) and those of
the sub-modules it does not call as layers (``reported_params``): a transformation in its own
code (``nnx.scan`` over stacked blocks, ``nnx.remat``, ``lax.scan`` over ``eqx.combine``-d
layers) runs them as copies, which are part of its code; a sub-module's parameters include
its sub-modules'.

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

from numstab.errors import InvalidArgumentError
from numstab.frameworks.jax.locate import Split, deterministic_only, is_float, layer, locate
from numstab.locate._report import LocateReport

#: id of each direct child of the running module -> its name relative to that module
_CHILDREN: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "numstab_locate_children", default=None
)
#: names of the children that the running module called as layers
_CALLED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "numstab_locate_called", default=None
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

    def owners(self, module: Any, params: Any) -> list[str | None]:
        """For each floating leaf of ``params = params_of(module)[0]``, in flattening order,
        the name of the direct sub-module holding it (``children``), or None for the
        module's own."""
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
        own children named while it runs. The root (``name == ""``) reports, of its
        parameters, its own and those of the children it did not call as layers
        (``fn.reported_params``, read by ``layer`` once the call returned)."""
        params, rebuild = self.params_of(module)
        called: set[str] = set()

        def fn(params: Any, *a: Any, **k: Any) -> Any:
            probed = rebuild(params)
            token = _CHILDREN.set(self.children(probed))
            called_token = _CALLED.set(called)
            try:
                return self.run(probed, lambda: call(probed, *a, **k))
            finally:
                _CALLED.reset(called_token)
                _CHILDREN.reset(token)

        fn.__name__ = type(module).__name__  # the report's layer type
        if not name:
            owners = self.owners(module, params)
            fn.reported_params = lambda: [o is None or o not in called for o in owners]
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

    def owners(self, module: Any, params: Any) -> list[str | None]:
        import jax

        kids = self.children(module)
        out: list[str | None] = []
        for x in jax.tree_util.tree_leaves(params, is_leaf=lambda x: id(x) in kids):
            floats = sum(map(is_float, jax.tree_util.tree_leaves(x)))
            out += [kids.get(id(x))] * floats
        return out

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

    def owners(self, module: Any, params: Any) -> list[str | None]:
        import jax

        kids = self.children(module).values()
        out: list[str | None] = []
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            if is_float(x):
                keys = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
                joined = ".".join(map(str, (*keys, "")))
                out.append(next((k for k in kids if joined.startswith(k + ".")), None))
        return out

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
        called = _CALLED.get()
        if called is not None:
            called.add(name)
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
    with (
        deterministic_only(model, refused, how),
        _dropout_key_error_named(),
        _outside_modules_refused(model),
    ):
        return locate(library.split(model), inputs, loss_fn, targets, kwargs)


#: NNX Variable types that only training mode writes (Dropout's RNGs, BatchNorm's statistics)
_TRAINING_STATE = ("Rng", "BatchStat")


@contextlib.contextmanager
def _outside_modules_refused(model: Any) -> Iterator[None]:
    """``InvalidArgumentError`` for flax's "different trace level" errors that are not about
    training-mode state: an NNX transformation (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``,
    ``nnx.jit``) in the model's code handed a module or Variable that the model does not
    hold (a global, one closed over). Locating traces the model, rebuilt from its arrays, so
    such a module belongs to the trace outside, which flax refuses to lift (the same model
    fails under ``jax.jit``). Flax raises ``ValueError`` (graph node extraction) or
    ``TraceContextError`` (its write back); one naming an RNG or a BatchNorm statistic is
    left to ``deterministic_only``."""
    try:
        yield
    except Exception as error:
        text = str(error)
        if (
            type(error).__name__ not in ("ValueError", "TraceContextError")
            or "different trace level" not in text
            or any(kind in text.split("level")[0] for kind in _TRAINING_STATE)
        ):
            raise
        raise InvalidArgumentError(
            "Expected every module that an NNX transformation (nnx.scan, nnx.vmap, "
            "nnx.remat, nnx.jit) in the model's code is handed to be held by the model: "
            "locating traces the model, rebuilt from its arrays, and flax cannot lift a "
            "module or Variable made outside that trace (a global, or one closed over), as "
            "under jax.jit. Make it an attribute of the model (a sub-module transformed in "
            "the model's own code is part of the model itself, '', or of the sub-module "
            f"whose code transforms it). Received: {type(model).__name__}, which raised "
            f"{type(error).__name__}: {text}"
        ) from error


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
