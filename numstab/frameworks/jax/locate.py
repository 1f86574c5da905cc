"""Named layers for plain JAX models, and locate_nonfinite for them.

JAX has no module objects to hook, so a model marks its sub-computations::

    from numstab.frameworks.jax.locate import layer

    def model(params, tokens):
        x = layer("embed", embed, params["embed"], tokens)
        for i, p in enumerate(params["blocks"]):
            x = layer(f"blocks.{i}", block, p, x)   # block may call layer() itself
        return layer("head", linear, params["head"], x)

``layer(name, fn, params, *args, **kwargs)`` is just ``fn(params, *args, **kwargs)`` outside
``locate_nonfinite`` (free under jit and grad). Names nest: a ``layer("fc1", ...)`` inside
``layer("blocks.1.mlp", ...)`` is ``"blocks.1.mlp.fc1"``. ``fn`` must depend only on its
arguments (no closed-over arrays), because locating replays it alone. The model itself is
the layer ``""`` (its own code between sub-layers, as torch's root module): ``model(*inputs)``
runs as ``layer("", ...)``, unless the model makes that call itself, at its top level (the
module libraries and Keras do, with the root's own parameters).

Locating jit-compiles one instrumented pass per (model, loss_fn, input structure and shapes)
and reuses it; a module library's model is split into its arrays (arguments of the pass) and
the rest (the cache key: ``Split``), so another model of the same structure, or the same
model after training steps, reuses the pass.

Each layer call adds a zero "probe" to its floating parameters, to its other floating
arguments (as this call sees them) and to its outputs; one backward pass then gives, per
call, the gradient the layer received (output probe) and the gradients it produced itself
(input and parameter probes), as torch's full backward hooks do. Only maxima and NaN/inf
counts come back to the host, in one transfer.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.jax.tree_checks import check_values
from numstab.locate._report import (
    LOSS,
    LayerCall,
    LocateReport,
    check_loss,
    nonfinite_counts,
    nonfinite_names,
    summarise,
)

__all__ = ["layer"]

_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "numstab_locate_jax", default=None
)


def layer(name: str, fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(params, *args, **kwargs)``, seen by ``locate_nonfinite`` as the layer ``name``.

    ``fn.reported_params``, where set, is called once ``fn`` returned and gives, for each
    floating leaf of ``params`` (flattening order), whether it is the layer's own: all are
    probed, only those are in its report (a module library's root: its own parameters and
    those of the sub-modules it did not call as layers)."""
    recorder = _RECORDER.get()
    if recorder is None:
        return fn(params, *args, **kwargs)
    return recorder.call(name, fn, params, args, kwargs)


def is_float(x: Any) -> bool:
    """Whether ``x`` is an array of a floating dtype (the leaves that are probed)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _split(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """The floating leaves of ``tree`` and a function putting new ones in their place."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    where = [i for i, x in enumerate(leaves) if is_float(x)]

    def put(new: list) -> Any:
        out = list(leaves)
        for i, x in zip(where, new, strict=True):
            out[i] = x
        return treedef.unflatten(out)

    return [leaves[i] for i in where], put


class _Call:
    """One layer call seen while tracing: its name and order, and its floating parameters,
    other arguments and outputs (traced values, returned through the pass's aux data)."""

    def __init__(self, name: str, kind: str, start: int):
        self.name, self.kind, self.start, self.end = name, kind, start, -1
        self.params: list = []
        self.inputs: list = []
        self.outputs: list = []
        self.param_paths: list[str] = []
        self.hidden = False  # the implicit root, when the model names its root itself
        # which of ``params`` are the call's own, for its report (None: all of them)
        self.reported: list[bool] | None = None

    def mine(self, leaves: list) -> list:
        """``leaves`` (its params or their gradients) that are the call's own."""
        if self.reported is None:
            return leaves
        return [x for x, k in zip(leaves, self.reported, strict=True) if k]


class _Recorder:
    """Installed while the model runs; ``probes[k]`` = (params, inputs, outputs) zero probes
    of the k-th call, or None for a forward-only pass."""

    def __init__(self, probes: list | None):
        self.probes = probes
        self.calls: list[_Call] = []
        self.prefix: list[str] = []
        self.clock = itertools.count()
        self.open: list[tuple[str, Any]] = []  # (full name, trace state) of running calls

    def call(self, name, fn, params, args, kwargs):
        here = _trace_state()
        if self.open and here is not None and self.open[-1][0] and self.open[-1][1] != here:
            # called under a transformation that the running layer's own code opened
            # (Equinox's MultiheadAttention vmaps its Linear layers): its values cannot
            # leave it, so it is part of that layer. At the model's top level ("") it is
            # recorded, and its leaked values make the typed error of ``locate``.
            return fn(params, *args, **kwargs)
        full = ".".join(part for part in [*self.prefix, name] if part)  # "": the model
        record = _Call(full, getattr(fn, "__name__", type(fn).__name__), next(self.clock))
        record.param_paths = getattr(fn, "param_paths", None) or [
            (full + jax.tree_util.keystr(path)).removeprefix(".")  # the root's: "w", not ".w"
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if is_float(x)
        ]
        index = len(self.calls)
        self.calls.append(record)
        p_leaves, put_p = _split(params)
        in_leaves, put_in = _split((args, kwargs))
        if self.probes is not None:
            dp, din, _ = self.probes[index]
            p_leaves = [x + d for x, d in zip(p_leaves, dp, strict=True)]
            in_leaves = [x + d for x, d in zip(in_leaves, din, strict=True)]
            params, (args, kwargs) = put_p(p_leaves), put_in(in_leaves)
        record.params, record.inputs = p_leaves, in_leaves
        self.prefix.append(name)
        self.open.append((full, here))
        try:
            out = fn(params, *args, **kwargs)
        finally:
            self.prefix.pop()
            self.open.pop()
        record.end = next(self.clock)
        reported = getattr(fn, "reported_params", None)
        if reported is not None:  # known once it ran (a module library's root, see layer)
            record.reported = reported()
            record.param_paths = record.mine(record.param_paths)
        out_leaves, put_out = _split(out)
        if self.probes is not None:
            out_leaves = [x + d for x, d in zip(out_leaves, self.probes[index][2], strict=True)]
            out = put_out(out_leaves)
        record.outputs = out_leaves
        return out

    def root(self, model: Callable, inputs: tuple, kwargs: dict) -> Any:
        """``model(*inputs, **kwargs)`` as the layer ``""``, the model itself (torch's root
        module). A model that calls ``layer("", ...)`` at its top level names its root itself
        (with its own parameters): this implicit entry is then hidden, not reported nor
        counted."""

        def fn(_: Any, *args: Any, **kw: Any) -> Any:
            return model(*args, **kw)

        fn.__name__ = getattr(model, "__name__", type(model).__name__)  # the report's type
        first = len(self.calls)
        out = self.call("", fn, {}, inputs, kwargs)
        self.calls[first].hidden = any(c.name == "" for c in self.calls[first + 1 :])
        return out


def _trace_state() -> Any:
    """An opaque, comparable token of the JAX trace running now (it changes inside
    ``jax.vmap``, ``lax.scan``, ``jax.checkpoint``, ``jax.jit``, ...); None on a JAX too
    old to tell (before 0.4.36), where every layer call is recorded."""
    try:
        from jax.extend.core import get_opaque_trace_state
    except ImportError:
        return None
    return get_opaque_trace_state(convention="numstab")


def _absmax(xs: list) -> jax.Array | None:
    xs = [x for x in xs if x.size]
    if not xs:
        return None
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float32))) for x in xs]))


def _run(model, loss_fn, inputs, fixed, targets, probes):
    """The model and the loss (recorded as the call "<loss>"), with a recorder installed;
    ``inputs``: (positional, array keyword arguments), ``fixed``: the other keywords."""
    recorder = _Recorder(probes)
    token = _RECORDER.set(recorder)
    try:
        args, traced = inputs
        output = recorder.root(model, args, {**traced, **fixed})
        if loss_fn is not None:

            def loss_of(_, output):
                loss = loss_fn(output) if targets is None else loss_fn(output, targets)
                check_loss(loss, "jax")
                return jnp.sum(jnp.asarray(loss, jnp.float32))

            recorder.prefix = []
            loss = recorder.call(LOSS, loss_of, {}, (output,), {})
            recorder.calls[-1].kind = "loss_fn"
            return recorder, loss
    finally:
        _RECORDER.reset(token)
    return recorder, None


class Split(NamedTuple):
    """A model as its arrays and the rest: ``build(arrays)`` is ``model(*inputs)`` as a
    function of the inputs, ``key`` everything else that the pass depends on (hashable; None
    when it is not, and each call then compiles its own pass); ``advice`` how to locate a
    model whose own code calls a layer under a transformation (the library's idiom)."""

    arrays: Any
    key: Hashable | None
    build: Callable[[Any], Callable[..., Any]]
    advice: str = (
        "Locate one sample with the model that the transformation maps (Equinox: model(x[0]))"
    )

    @classmethod
    def of_function(cls, model: Callable[..., Any]) -> Split:
        """A plain function of JAX arrays: it holds no arrays (its parameters are inputs)."""
        return cls((), model, lambda _: model)


_CACHE: dict[Any, tuple[Callable, list, list]] = {}


def _spec(tree: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(
        (x.shape, str(x.dtype)) if hasattr(x, "shape") else type(x).__name__ for x in leaves
    )


def _instrumented(split: Split, loss_fn, inputs, fixed: dict, targets):
    """A jitted ``(arrays, inputs, targets) -> per-call maxima and counts`` and a list whose
    last element is the recorder of its trace (names and order). Cached per model key,
    loss_fn, the static keyword arguments ``fixed`` and the structure, shapes and dtypes of
    the arrays and inputs (the last 16)."""
    key = None
    if split.key is not None:
        key = (split.key, loss_fn, tuple(fixed.items()), _spec((split.arrays, inputs, targets)))
        try:
            if key in _CACHE:
                return _CACHE[key]
        except (TypeError, ValueError):  # a part of the model that cannot be a key
            key = None

    def shapes(arrays, inputs, targets):
        recorder, _ = _run(split.build(arrays), loss_fn, inputs, fixed, targets, None)
        spec = lambda xs: [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
        return [(spec(r.params), spec(r.inputs), spec(r.outputs)) for r in recorder.calls]

    probe_shapes = None
    if loss_fn is not None:
        probe_shapes = jax.eval_shape(shapes, split.arrays, inputs, targets)
    static: list = []
    layout: list = []

    def analyze(arrays, inputs, targets):
        model = split.build(arrays)

        def forward(probes):
            recorder, loss = _run(model, loss_fn, inputs, fixed, targets, probes)
            static.append(recorder)
            aux = [(r.params, r.inputs, r.outputs) for r in recorder.calls]
            return (loss if loss is not None else jnp.float32(0)), aux

        if probe_shapes is None:
            _, values = forward(None)
            grads = None
        else:
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), probe_shapes)
            _, pullback, values = jax.vjp(forward, zeros, has_aux=True)
            (grads,) = pullback(jnp.ones((), jnp.float32))
        maxima, tensors = [], []
        for k, (params, ins, outs) in enumerate(values):
            if static[-1].calls[k].hidden:
                maxima.append({})
                tensors.append({})
                continue
            mine = static[-1].calls[k].mine
            params = mine(params)
            entry = {"inputs": _absmax(ins), "outputs": _absmax(outs), "params": _absmax(params)}
            kept = {"outputs": outs, "params": params}
            if grads is not None:
                g_params, g_ins, g_outs = grads[k]
                g_params = mine(g_params)
                entry.update(
                    grad_outputs=_absmax(g_outs),
                    grad_inputs=_absmax(g_ins),
                    grad_params=_absmax(g_params),
                )
                kept.update(grad_inputs=g_ins, grad_params=g_params)
            maxima.append(entry)
            tensors.append(kept)
        # one vector of every maximum (read in one transfer); where each one goes is static
        present = [(k, f, x) for k, e in enumerate(maxima) for f, x in e.items() if x is not None]
        layout[:] = [(k, f) for k, f, _ in present]
        vector = jnp.stack([x for _, _, x in present]) if present else jnp.zeros((0,))
        return vector, tensors  # the tensors stay on the device for the details

    jitted = jax.jit(analyze)
    if key is not None:
        _CACHE[key] = (jitted, static, layout)
        if len(_CACHE) > 16:
            _CACHE.pop(next(iter(_CACHE)))
    return jitted, static, layout


def locate(
    model: Callable | Split, inputs: tuple, loss_fn, targets, kwargs: dict | None = None
) -> LocateReport:
    """Locate in a plain function of JAX arrays, or in a module library's ``Split`` model.
    ``kwargs`` holding arrays (every leaf) are traced, the others static."""
    load_backend("jax")
    split = model if isinstance(model, Split) else Split.of_function(model)
    traced, fixed = {}, {}
    for name, value in (kwargs or {}).items():
        leaves = jax.tree_util.tree_leaves(value)
        is_data = leaves and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves)
        (traced if is_data else fixed)[name] = value
    named = [(f"inputs[{i}]", x) for i, x in enumerate(inputs)] + [("targets", targets)]
    # they are arguments of the jitted pass (a torch tensor or a string raised JAX's "Error
    # interpreting argument to <function analyze>"); None, an omitted optional argument,
    # is an empty pytree; keywords that are not arrays are static on purpose (§15.3)
    named += [(f"model_kwargs[{k!r}]", v) for k, v in traced.items()]
    check_values(named, "a JAX or NumPy array, a number, or a pytree of them")
    jitted, static, layout = _instrumented(split, loss_fn, (inputs, traced), fixed, targets)
    try:
        vector, tensors = jitted(split.arrays, (inputs, traced), targets)
    except jax.errors.UnexpectedTracerError as error:
        raise InvalidArgumentError(
            "Expected the model's layers to be called directly, not inside a JAX "
            "transformation of its own (jax.vmap, lax.scan, jax.checkpoint, ...): each "
            f"layer's values are recorded, and cannot leave that transformation. {split.advice}; a "
            "sub-layer called so inside a layer (Equinox's MultiheadAttention, "
            "jax.vmap(self.linear) in a block) is part of that layer, so only the model's "
            "own top-level code cannot do it (move it into a sub-module). "
            f"Received: {type(error).__name__} from inside the model"
        ) from error
    values = jax.device_get(vector)  # the one host transfer
    recorder = static[-1]
    calls, details = [], {}
    for record, kept in zip(recorder.calls, tensors, strict=True):
        call = LayerCall(record.name, record.kind, start=record.start, end=record.end)
        if loss_fn is not None:
            call.backward = -float(record.start)  # backward runs in reverse start order
        calls.append(call)
        details[id(call)] = (record, kept)
    for (k, field), value in zip(layout, values, strict=True):
        setattr(calls[k], field, value)
    calls = [c for c in calls if not details[id(c)][0].hidden]

    def counts(call: LayerCall, phase: str) -> tuple[int, int]:
        kept = details[id(call)][1]
        xs = kept["outputs"] if phase == "forward" else kept["grad_inputs"] + kept["grad_params"]
        return nonfinite_counts(list(xs))

    def param_paths(call: LayerCall, phase: str) -> list[str]:
        record, kept = details[id(call)]
        return nonfinite_names(
            record.param_paths, kept["params" if phase == "forward" else "grad_params"]
        )

    return summarise(
        load_backend("numpy"),
        calls,
        backward_checked=loss_fn is not None,
        counts=counts,
        param_paths=param_paths,
        framework="jax",
    )


@contextlib.contextmanager
def deterministic_only(model: Any, refused: tuple[str, ...], how: str) -> Iterator[None]:
    """``InvalidArgumentError`` for a Flax error named in ``refused``: a model in training
    mode (Dropout drawing RNGs, BatchNorm updating its statistics) cannot be replayed inside
    the traced pass; ``how`` says how to switch it to its deterministic mode."""
    try:
        yield
    except Exception as error:
        if type(error).__name__ not in refused:
            raise
        raise InvalidArgumentError(
            f"Expected a model in its deterministic mode ({how}): locating traces it, and a "
            "module in training mode (Dropout, BatchNorm) draws RNGs or updates its state "
            f"there. Received: {type(model).__name__}, which raised {type(error).__name__}: "
            f"{error}"
        ) from error
