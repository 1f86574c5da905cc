"""locate_nonfinite for Keras 3 models on TensorFlow and on torch (on JAX: ``locate_jax``).

While locating, every layer's ``call`` is wrapped (``layers.wrapped_calls``) and
records its floating inputs, outputs and own variables. A layer's name is the nesting of
layer names below the model, joined by "." ("blocks.1.mlp.fc1"); the model itself is "".

Backward: one pass of the framework's autodiff (a persistent ``tf.GradientTape``; one
``torch.autograd.grad`` call) gives the total gradient of the loss w.r.t. every layer's
outputs, inputs and variables. A layer whose incoming gradient is finite but whose input
gradient is not is a candidate; candidates are replayed alone (latest started first: the
backward order) and the first whose OWN vector-Jacobian product is non-finite is the
culprit. A clean backward pass replays nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.keras.layers import own_variables, wrapped_calls
from numstab.frameworks.keras.locate_autodiff import autodiff_for
from numstab.locate._report import (
    LOSS,
    LayerCall,
    LocateReport,
    absmax,
    check_loss,
    mark_shared,
    nonfinite_counts,
    nonfinite_names,
    summarise,
)


class _Entry:
    def __init__(self, call, orig, args, kwargs, ins, outs, variables):
        self.call, self.orig = call, orig
        self.args, self.kwargs = args, kwargs
        self.ins, self.outs, self.variables = ins, outs, variables
        self.grad_ins: list = []
        self.grad_vars: dict = {}


class _Recorder:
    """The wrapped calls' shared state: the entries so far and the running layer path."""

    def __init__(self, be, autodiff, backward: bool):
        self.be, self.autodiff, self.backward = be, autodiff, backward
        self.entries: list[_Entry] = []
        self.clock = itertools.count()
        self.prefix: list[str] = []
        self.recording = True

    def wrap(self, layer, orig, is_root: bool):
        def call(*args, **kwargs):
            if not self.recording:
                return orig(*args, **kwargs)
            name = "" if is_root else ".".join([*self.prefix, layer.name])
            record = LayerCall(name, type(layer).__name__, start=next(self.clock))
            if self.backward:
                args, kwargs = self.autodiff.differentiable(args, kwargs)
            ins = self.autodiff.floating((args, kwargs))
            if not is_root:
                self.prefix.append(layer.name)
            try:
                out = orig(*args, **kwargs)
            finally:
                if not is_root:
                    self.prefix.pop()
            record.end = next(self.clock)
            outs = self.autodiff.floating(out)
            variables = own_variables(layer)
            be = self.be
            record.inputs, record.outputs = absmax(be, ins), absmax(be, outs)
            record.params = absmax(be, [w.value for w in variables])
            self.entries.append(_Entry(record, orig, args, kwargs, ins, outs, variables))
            return out

        return call


def runs_on() -> str:
    """The framework Keras runs its models on: its backend (``keras.backend.backend()``)."""
    import keras

    return keras.backend.backend()


def locate_model(
    model: Any, inputs: tuple, loss_fn, targets, kwargs: dict | None = None
) -> LocateReport:
    """The registry's entry point: a Keras model on its Keras backend."""
    framework, kwargs = runs_on(), kwargs or {}
    build(model, inputs, kwargs)
    if framework == "jax":
        from numstab.frameworks.jax.locate import locate as locate_jax
        from numstab.frameworks.keras.locate_jax import split

        return locate_jax(split(model), inputs, loss_fn, targets, kwargs)
    return locate(model, inputs, loss_fn, targets, framework, kwargs)


def build(model: Any, inputs: tuple, kwargs: dict) -> None:
    """Build an unbuilt model (or one holding unbuilt layers) by one plain call on the
    inputs, before any wrapping or tracing: Keras would otherwise build it inside the
    instrumented pass, symbolically (TensorFlow: graph tensors out of scope; torch: meta
    tensors) or under ``jax.jit`` (variables made of tracers, leaked into the model)."""
    layers = model._flatten_layers(include_self=True, recursive=True)
    if all(layer.built for layer in layers):
        return
    try:
        model(*inputs, **kwargs)
    except Exception as error:
        raise InvalidArgumentError(
            "Expected a built Keras model: calling the unbuilt model on the inputs to build "
            f"it raised {type(error).__name__} (the cause, below). Build it first (call it "
            f"once, or model.build(input_shape)). Received: model={type(model).__name__} "
            f"{model.name!r} with built=False"
        ) from error
    if not model.built:
        raise InvalidArgumentError(
            "Expected a built Keras model: one call on the inputs did not build it. Build it "
            f"first (model.build(input_shape)). Received: model={type(model).__name__} "
            f"{model.name!r} with built=False"
        )


def locate(
    model: Any, inputs: tuple, loss_fn, targets, framework: str, kwargs: dict
) -> LocateReport:
    """A Keras model on TensorFlow or torch: wrapped calls and one autodiff pass."""
    be, autodiff = load_backend(framework), autodiff_for(framework)
    recorder = _Recorder(be, autodiff, backward=loss_fn is not None)
    loss_entry = None
    with wrapped_calls(model, recorder.wrap):
        with autodiff.recording(loss_fn is not None):
            output = model(*inputs, **kwargs)
            if loss_fn is not None:
                record = LayerCall(LOSS, "loss_fn", start=next(recorder.clock))
                loss = loss_fn(output) if targets is None else loss_fn(output, targets)
                check_loss(loss, framework)
                record.end = next(recorder.clock)
                outs, losses = autodiff.floating(output), autodiff.floating(loss)
                record.inputs, record.outputs = absmax(be, outs), absmax(be, losses)
                loss_entry = _Entry(record, None, (), {}, outs, losses, [])
                recorder.entries.append(loss_entry)
                loss = autodiff.scalar(loss)
        recorder.recording = False
        entries = recorder.entries
        mark_shared([e.call for e in entries], [[id(w) for w in e.variables] for e in entries])
        if loss_fn is not None:
            _backward(be, autodiff, loss, recorder.entries, loss_entry)
    by_call = {id(e.call): e for e in recorder.entries}

    def counts(call: LayerCall, phase: str) -> tuple[int, int]:
        e = by_call[id(call)]
        tensors = e.outs if phase == "forward" else [*e.grad_ins, *e.grad_vars.values()]
        return nonfinite_counts([t for t in tensors if t is not None])

    def param_paths(call: LayerCall, phase: str) -> list[str]:
        e = by_call[id(call)]
        tree = {w.path: w.value for w in e.variables} if phase == "forward" else e.grad_vars
        paths = [k for k, x in tree.items() if x is not None]
        return nonfinite_names(paths, [tree[k] for k in paths])

    return summarise(
        be,
        [e.call for e in recorder.entries],
        backward_checked=loss_fn is not None,
        counts=counts,
        param_paths=param_paths,
    )


def _backward(be, autodiff, loss, entries: list[_Entry], loss_entry: _Entry) -> None:
    unique: dict[int, Any] = {}
    for e in entries:
        for t in [*e.ins, *e.outs, *(w.value for w in e.variables)]:
            unique.setdefault(id(t), t)
    grads = autodiff.gradients(loss, list(unique.values()))
    total = dict(zip(unique, grads, strict=True))
    for e in entries:
        if e is loss_entry:
            e.grad_ins = [total[id(t)] for t in e.ins]
            e.call.backward = -float("inf")
            e.call.grad_inputs = absmax(be, e.grad_ins)
            continue
        e.call.backward = -float(e.call.start)
        e.grad_outs = [total[id(t)] for t in e.outs]
        e.call.grad_outputs = absmax(be, e.grad_outs)
        e.grad_vars = {w.path: total[id(w.value)] for w in e.variables}
        e.call.grad_params = absmax(be, list(e.grad_vars.values()))
        e.total_in = absmax(be, [total[id(t)] for t in e.ins])
    _replay_candidates(be, autodiff, entries, loss_entry)


def _replay_candidates(be, autodiff, entries: list[_Entry], loss_entry: _Entry) -> None:
    """Own VJPs of the layers whose incoming gradient is finite but whose input gradient is
    not, latest started first, until one is non-finite (one host read per candidate)."""
    candidates = [e for e in entries if e is not loss_entry and e.total_in is not None and e.ins]
    flags = [(e.call.grad_outputs, e.total_in) for e in candidates]
    if not flags:
        return
    stacked = be.to_numpy(
        be.stack([be.stack([_finite(be, a), _finite(be, b)]) for a, b in flags])
    ).tolist()
    chosen = [
        e for e, (out_ok, in_ok) in zip(candidates, stacked, strict=True) if out_ok and not in_ok
    ]
    for e in sorted(chosen, key=lambda e: -e.call.start):
        e.grad_ins = autodiff.own_vjp(e.orig, e.args, e.kwargs, e.ins, e.grad_outs)
        e.call.grad_inputs = absmax(be, e.grad_ins)
        if not bool(be.to_numpy(_finite(be, e.call.grad_inputs))):
            return


def _finite(be, x):
    return be.asarray(True) if x is None else be.isfinite(x)
