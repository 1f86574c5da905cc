"""locate_nonfinite for Keras 3 models on TensorFlow.

While locating, every layer's ``call`` (the model's own included) is wrapped on the
instance, so Sequential, functional and subclassed models all report each layer call; the
wrappers are removed afterwards. A layer's name is the nesting of layer names below the
model, joined by "." ("blocks.1.mlp.fc1"); the model itself is "".

Backward: one ``tf.GradientTape`` pass gives the total gradient of the loss w.r.t. every
layer's outputs, inputs and variables. A layer whose incoming gradient is finite but whose
input or variable gradient is not is a candidate; candidates are replayed alone (latest
started first: the backward order) and the first whose OWN vector-Jacobian product is
non-finite is the culprit. A clean backward pass replays nothing.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import keras
import tensorflow as tf

from numstab.backends import load_backend
from numstab.locate._report import LOSS, LayerCall, LocateReport, absmax, summarise
from numstab.nonfinite import find_nonfinite
from numstab.tree import flatten


def _tensors(x: Any) -> list:
    return [
        t
        for t in flatten(x)[0]
        if isinstance(t, (tf.Tensor, tf.Variable)) and (t.dtype.is_floating)
    ]


class _Entry:
    def __init__(self, call, layer, orig, args, kwargs, ins, outs, variables):
        self.call, self.layer, self.orig = call, layer, orig
        self.args, self.kwargs = args, kwargs
        self.ins, self.outs, self.variables = ins, outs, variables


def _own_variables(layer: keras.Layer) -> list:
    inner = {id(w) for sub in layer._flatten_layers(include_self=False) for w in sub.weights}
    return [w for w in layer.weights if id(w) not in inner]


def locate(model: keras.Layer, inputs: tuple, loss_fn, targets) -> LocateReport:
    be = load_backend("tensorflow")
    entries: list[_Entry] = []
    clock = itertools.count()
    prefix: list[str] = []
    recording = [True]
    tape_box: list[tf.GradientTape | None] = [None]

    def wrap(layer: keras.Layer, orig, is_root: bool):
        def call(*args, **kwargs):
            if not recording[0]:
                return orig(*args, **kwargs)
            name = "" if is_root else ".".join([*prefix, layer.name])
            record = LayerCall(name, type(layer).__name__, start=next(clock))
            ins = _tensors((args, kwargs))
            if tape_box[0] is not None:
                tape_box[0].watch(ins)
            if not is_root:
                prefix.append(layer.name)
            try:
                out = orig(*args, **kwargs)
            finally:
                if not is_root:
                    prefix.pop()
            record.end = next(clock)
            outs = _tensors(out)
            variables = _own_variables(layer)
            record.inputs, record.outputs = absmax(be, ins), absmax(be, outs)
            record.params = absmax(be, [w.value for w in variables])
            entries.append(_Entry(record, layer, orig, args, kwargs, ins, outs, variables))
            return out

        return call

    layers = list(model._flatten_layers(include_self=True, recursive=True))
    for layer in layers:
        object.__setattr__(layer, "call", wrap(layer, layer.call, layer is model))
    try:
        with tf.GradientTape(persistent=True) if loss_fn is not None else _no_tape() as tape:
            tape_box[0] = tape
            output = model(*inputs)
            loss_entry = None
            if loss_fn is not None:
                record = LayerCall(LOSS, "loss_fn", start=next(clock))
                loss = loss_fn(output) if targets is None else loss_fn(output, targets)
                record.end = next(clock)
                outs = _tensors(output)
                record.inputs, record.outputs = absmax(be, outs), absmax(be, _tensors(loss))
                loss_entry = _Entry(record, None, None, (), {}, outs, _tensors(loss), [])
                entries.append(loss_entry)
        tape_box[0] = None
        if loss_fn is not None:
            recording[0] = False
            _backward(be, tape, loss, entries, loss_entry)
    finally:
        recording[0] = False
        for layer in layers:
            with contextlib.suppress(AttributeError):
                object.__delattr__(layer, "call")

    by_call = {id(e.call): e for e in entries}

    def counts(call: LayerCall, phase: str) -> tuple[int, int]:
        e = by_call[id(call)]
        tensors = e.outs if phase == "forward" else [*e.grad_ins, *e.grad_vars.values()]
        found = find_nonfinite([t for t in tensors if t is not None])
        return sum(r.nan_count for r in found), sum(r.inf_count for r in found)

    def param_paths(call: LayerCall, phase: str) -> list[str]:
        e = by_call[id(call)]
        tree = {w.path: w.value for w in e.variables} if phase == "forward" else e.grad_vars
        paths = [k for k, x in tree.items() if x is not None]
        found = find_nonfinite([tree[k] for k in paths])
        return [paths[int(r.path[1:-1])] for r in found]  # "[i]" -> the variable's path

    return summarise(
        be,
        [e.call for e in entries],
        backward_checked=loss_fn is not None,
        counts=counts,
        param_paths=param_paths,
    )


@contextlib.contextmanager
def _no_tape():
    yield None


def _backward(be, tape, loss, entries: list[_Entry], loss_entry: _Entry) -> None:
    unique: dict[int, Any] = {}
    for e in entries:
        for t in [*e.ins, *e.outs, *(w.value for w in e.variables)]:
            unique.setdefault(id(t), t)
    sources = list(unique.values())
    scalar = tf.reduce_sum(tf.cast(loss, tf.float32)) if loss.shape.rank else loss
    grads = tape.gradient(scalar, sources)
    total = {k: g for k, g in zip(unique, grads, strict=True)}
    for e in entries:
        e.grad_ins, e.grad_vars = [], {}
        if e is loss_entry:
            e.grad_ins = [total[id(t)] for t in e.ins]
            e.call.backward = -float("inf")
            e.call.grad_inputs = absmax(be, e.grad_ins)
            continue
        e.call.backward = -float(e.call.start)
        grad_outs = [total[id(t)] for t in e.outs]
        e.call.grad_outputs = absmax(be, grad_outs)
        e.grad_vars = {w.path: total[id(w.value)] for w in e.variables}
        e.call.grad_params = absmax(be, list(e.grad_vars.values()))
        e.total_in = absmax(be, [total[id(t)] for t in e.ins])
        e.grad_outs = grad_outs
    _replay_candidates(be, entries, loss_entry)


def _replay_candidates(be, entries: list[_Entry], loss_entry: _Entry) -> None:
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
        with tf.GradientTape() as tape:
            tape.watch(e.ins)
            y = e.orig(*e.args, **e.kwargs)
        outs = _tensors(y)
        seeds = [
            g if g is not None else tf.zeros_like(o)
            for g, o in zip(e.grad_outs, outs, strict=False)
        ]
        e.grad_ins = [
            g for g in tape.gradient(outs, e.ins, output_gradients=seeds) if g is not None
        ]
        e.call.grad_inputs = absmax(be, e.grad_ins)
        if not bool(be.to_numpy(_finite(be, e.call.grad_inputs))):
            return


def _finite(be, x):
    return be.asarray(True) if x is None else be.isfinite(x)
