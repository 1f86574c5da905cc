"""locate_nonfinite for torch.nn.Module (``named_modules`` names).

Forward: a pre and a post hook on every sub-module (``locate_state.forward_hooks``: torch's
global module hooks where a module's own would change its computation) record each call's
input and output tensors; each distinct (tensor, version) is reduced once, when first seen,
by one ``torch.aminmax`` kernel (so a later in-place edit cannot hide a value; ``aminmax`` is one
pass, unlike the slow ``inf``-norm kernels on CPU). Backward: one ``torch.autograd.grad``
call (the user's ``.grad`` fields are not touched) returns the gradient of the loss w.r.t.
every recorded tensor, taken as a ``GradientEdge`` at record time, and every parameter; no
backward hooks run. A call's own input gradient (this call's vector-Jacobian product alone,
on the retained graph) is computed only when its total input gradient is non-finite: own
non-finite implies total non-finite (NaN and inf survive a sum). Every extremum is read to
the host in one transfer; the reported layer's parameters and incoming gradient are reduced
only once it is chosen. With a loss, floating model inputs that do not require grad are
passed as copies that do (``locate_state.differentiable``), so a gradient that is
non-finite only with respect to the model's input is found, as on Keras and JAX. The
model's buffers and the RNG are put back afterwards (``locate_state.kept_state``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.torch.backend import flat_values
from numstab.frameworks.torch.locate_state import differentiable, eager, forward_hooks, kept_state
from numstab.frameworks.torch.tensor_reads import checkable, readable
from numstab.locate._report import (
    LOSS,
    LayerCall,
    LocateReport,
    backward_bad,
    backward_needed,
    check_loss,
    mark_shared,
    nonfinite_counts,
    summarise,
)
from numstab.nonfinite import find_nonfinite
from numstab.tree import flatten


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if type(x) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in x):
        return list(x)
    return [t for t in flatten(x)[0] if isinstance(t, torch.Tensor)]


class _Extrema:
    """min and max of each distinct floating tensor (one ``aminmax`` kernel each, taken when
    the tensor is first seen); ``read`` brings every new one to the host at once and
    ``absmax(slots)`` is then max |x| over a group: NaN if any NaN, else inf if any inf."""

    def __init__(self) -> None:
        self.mins: list[torch.Tensor] = []
        self.maxs: list[torch.Tensor] = []
        self.seen: dict[tuple[int, int], int] = {}  # (id, version) -> slot
        self.alive: list[torch.Tensor] = []  # keeps ids unique while locating
        self.host = np.zeros(0)

    def slots(self, tensors: list) -> list[int]:
        out = []
        for t in tensors:
            if not checkable(t) or t.is_complex():  # complex: unrecorded on every backend (§15)
                continue
            key = (id(t), _version(t))
            slot = self.seen.get(key)
            if slot is None:
                low, high = torch.aminmax(readable(t.detach()))
                slot = self.seen[key] = len(self.mins)
                self.mins.append(low)
                self.maxs.append(high)
                self.alive.append(t)
            out.append(slot)
        return out

    def read(self) -> None:
        new = slice(len(self.host), len(self.mins))
        if new.start == new.stop:
            return
        low, high = self.mins[new], self.maxs[new]
        wide = torch.float64 if any(x.dtype == torch.float64 for x in low) else torch.float32
        device = low[0].device
        if any(x.device != device for x in low):
            low, high = [x.to(device) for x in low], [x.to(device) for x in high]
        # stack promotes float16 / bfloat16 to float32 (float64 stays), exactly
        low, high = torch.stack(low).to(wide), torch.stack(high).to(wide)
        values = (torch.maximum(-low, high) + 0.0).cpu().numpy()  # + 0.0: no -0 shown
        self.host = np.concatenate([self.host, values.astype(np.float64)])  # exact

    def absmax(self, slots: list[int]) -> float | None:
        return float(self.host[slots].max()) if slots else None


def _version(t: torch.Tensor) -> int:
    """How many in-place edits ``t`` has had; -1 for inference tensors (no counter)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _edge(t: torch.Tensor) -> GradientEdge:
    """Where the gradient of ``t`` arrives, as of now (later in-place edits move ``t``)."""
    if t.grad_fn is None:
        return get_gradient_edge(t)  # a leaf: its gradient accumulator
    return GradientEdge(t.grad_fn, t.output_nr)


class _Call:
    """One module call: its report entry and the tensors behind it."""

    __slots__ = (
        "call",
        "in_edges",
        "in_slots",
        "inputs",
        "late_kwargs",
        "module",
        "out_edges",
        "out_slots",
        "outputs",
    )

    def __init__(self, call: LayerCall, module: Any, inputs: list, edges: list) -> None:
        self.call, self.module, self.inputs, self.in_edges = call, module, inputs, edges
        self.in_slots: list[int] = []
        self.outputs: list[torch.Tensor] = []
        self.out_slots: list[int] = []
        self.out_edges: list[GradientEdge] = []
        self.late_kwargs = False


def _record_forward(
    model, inputs: tuple, kwargs: dict, names: dict, grad: bool, ext: _Extrema, clock
) -> tuple:
    """Run the model with a pre and a post hook on every module (``forward_hooks``): (its
    calls, in the order they finished, each with its inputs, outputs and their gradient
    edges; the output). A module hooked without keyword arguments at its start (``kwargs``
    None) has its keyword tensors recorded at its end."""
    records: list[_Call] = []
    opened: dict[Any, list[_Call]] = {}

    def inputs_of(rec: _Call, ins: list) -> None:
        rec.inputs += ins
        rec.in_edges += [_edge(t) for t in ins if t.requires_grad] if grad else []
        rec.in_slots += ext.slots(ins)  # as received, before the module may edit them

    def pre(mod, args, kwargs):
        rec = _Call(LayerCall(names[mod], type(mod).__name__, start=next(clock)), mod, [], [])
        inputs_of(rec, _tensors(args) + (_tensors(kwargs) if kwargs else []))
        rec.late_kwargs = kwargs is None
        opened.setdefault(mod, []).append(rec)

    def post(mod, args, kwargs, output):
        rec = opened[mod].pop()
        if rec.late_kwargs and kwargs:
            inputs_of(rec, _tensors(kwargs))
        rec.call.end = next(clock)
        rec.outputs = _tensors(output)
        rec.out_slots = ext.slots(rec.outputs)
        if grad:
            rec.out_edges = [_edge(t) for t in rec.outputs if t.requires_grad]
        records.append(rec)

    with forward_hooks(names, pre, post), torch.set_grad_enabled(grad):
        output = model(*inputs, **kwargs)
    return records, output


def locate(
    model: torch.nn.Module, inputs: tuple, loss_fn, targets, kwargs: dict | None = None
) -> LocateReport:
    """``locate_nonfinite`` for a torch module (arguments checked by the caller). The
    model's buffers and the RNG are as before on return (``kept_state``)."""
    model, names = eager(model)
    with kept_state(model):
        return _locate(model, names, inputs, loss_fn, targets, kwargs or {})


def _locate(model, names: dict, inputs: tuple, loss_fn, targets, kwargs: dict) -> LocateReport:
    ext = _Extrema()
    clock = itertools.count()
    grad = loss_fn is not None and torch.is_grad_enabled()
    if grad:  # the model's input gradient exists, as on Keras and JAX (§15.3)
        inputs, kwargs = differentiable(inputs, kwargs)
    records, output = _record_forward(model, inputs, kwargs, names, grad, ext, clock)
    own = [[id(p) for p in _own_params(r.module)] for r in records]
    mark_shared([r.call for r in records], own)  # tied weights, a module called twice
    backward = None
    if loss_fn is not None:
        backward = _Backward(model, names, records, output, loss_fn, targets, clock, ext)
    ext.read()
    calls = [rec.call for rec in records]
    for rec in records:
        rec.call.outputs = ext.absmax(rec.out_slots)
    if backward is not None and backward_needed(calls):  # no forward fault (summarise)
        backward.find_first()
    by_call = {id(rec.call): rec for rec in records}

    def fill(call: LayerCall, phase: str) -> None:
        """A call's input, parameter (backward: incoming and own parameter gradient) maxima."""
        rec = by_call[id(call)]
        rec.call.inputs = ext.absmax(rec.in_slots)
        param_slots = ext.slots(_own_params(rec.module))
        backward_phase = backward is not None and phase == "backward"
        grad_slots = backward.out_grad_slots(rec) if backward_phase else []
        ext.read()
        call.params = ext.absmax(param_slots)
        call.grad_outputs = ext.absmax(grad_slots)
        if backward_phase:
            call.grad_params = ext.absmax(backward.param_slots.get(id(rec), []))

    def counts(call: LayerCall, phase: str) -> tuple[int, int]:
        rec = by_call[id(call)]
        if phase == "forward":
            return nonfinite_counts([flat_values(t) for t in rec.outputs])  # nested: components
        return nonfinite_counts(backward.own_input_grads(rec), backward.named_param_grads(rec))

    def param_paths(call: LayerCall, phase: str) -> list[str]:
        rec = by_call[id(call)]
        if phase == "forward":
            named = _named_params(rec.module, names)
        else:
            named = backward.named_param_grads(rec)
        return [r.path for r in find_nonfinite(named)]

    return summarise(
        load_backend("numpy"),
        calls,
        backward_checked=loss_fn is not None,
        counts=counts,
        param_paths=param_paths,
        framework="torch",
        fill=fill,
    )


def _own_params(module: Any) -> list[torch.Tensor]:
    """``module.parameters(recurse=False)``, without its generator machinery."""
    if module is None:
        return []
    params = {id(p): p for p in module._parameters.values() if p is not None}
    return list(params.values())


def _named_params(module: Any, names: dict) -> dict[str, torch.Tensor]:
    if module is None:
        return {}
    prefix = names[module] + "." if names[module] else ""
    return {prefix + n: p for n, p in module.named_parameters(recurse=False)}


def _bad(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)


class _Backward:
    """The loss call, one ``autograd.grad`` over every recorded edge and parameter, and the
    walk in backward order (reverse start order; the loss first) to the first call whose
    own input or own parameter gradient is non-finite."""

    def __init__(self, model, names, records, output, loss_fn, targets, clock, ext) -> None:
        self.ext, self.records, self.names = ext, records, names
        self.grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.param_grads: dict[int, torch.Tensor | None] = {}
        self.own: dict[int, list] = {}  # id(record) -> its own input gradients
        self.in_slots: dict[int, list[int]] = {}
        self.param_slots: dict[int, list[int]] = {}
        self.refused: InvalidArgumentError | None = None
        outs = _tensors(output)
        self.loss_rec = rec = _Call(LayerCall(LOSS, "loss_fn", start=next(clock)), None, outs, [])
        rec.in_slots = ext.slots(outs)
        loss = loss_fn(output) if targets is None else loss_fn(output, targets)
        check_loss(loss, "torch")
        rec.call.end = next(clock)
        rec.outputs = _tensors(loss)
        rec.out_slots = ext.slots(rec.outputs)
        records.append(rec)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            rec.in_edges = [_edge(t) for t in outs if t.requires_grad]
            self._gradients(model, loss.sum() if loss.dim() else loss)

    def _gradients(self, model, scalar) -> None:
        """One ``autograd.grad`` (graph retained for the own-gradient products); then the
        backward position of each reached call and the extrema of its input gradients and
        own parameter gradients."""
        edges: dict[tuple[int, int], GradientEdge] = {}
        for rec in self.records:
            for e in rec.in_edges + rec.out_edges:
                edges.setdefault(_key(e), e)
        params = [p for p in model.parameters() if p.requires_grad]
        try:
            found = torch.autograd.grad(
                scalar, list(edges.values()) + params, retain_graph=True, allow_unused=True
            )
        except RuntimeError as error:
            self.refused = _reentrant_refusal(model, error)  # raised if the backward is needed
            if self.refused is None:
                raise
            return
        self.grads = dict(zip(edges, found[: len(edges)], strict=True))
        self.param_grads = {id(p): g for p, g in zip(params, found[len(edges) :], strict=True)}
        last = self.loss_rec.call.start
        for rec in self.records:
            param_grads = [g for g in self._own_param_grads(rec) if g is not None]
            if rec is self.loss_rec:
                rec.call.backward = -1.0  # the loss's backward runs first
            elif param_grads or any(self.grads[_key(e)] is not None for e in rec.out_edges):
                rec.call.backward = float(last - rec.call.start)  # reverse start order
            else:
                continue
            grads = [self.grads[_key(e)] for e in rec.in_edges]
            self.in_slots[id(rec)] = self.ext.slots(grads)
            self.param_slots[id(rec)] = self.ext.slots(param_grads)

    def _own_param_grads(self, rec: _Call) -> list:
        return [self.param_grads.get(id(p)) for p in _own_params(rec.module)]

    def find_first(self) -> None:
        """Set grad_inputs / grad_params in backward order up to the first bad call
        (``backward_bad``: a shared parameter's gradient does not stop the walk); raise
        ``refused`` (InvalidArgumentError) when the backward pass could not be taken."""
        if self.refused is not None:
            raise self.refused
        ext = self.ext
        order = sorted(
            (r for r in self.records if r.call.backward is not None),
            key=lambda r: r.call.backward,
        )
        for rec in order:
            call = rec.call
            call.grad_params = ext.absmax(self.param_slots[id(rec)])
            call.grad_inputs = ext.absmax(self.in_slots[id(rec)])
            if _bad(call.grad_inputs) and rec is not self.loss_rec:
                own = self.own_input_grads(rec)
                slots = ext.slots(own)
                ext.read()
                call.grad_inputs = ext.absmax(slots)
            if backward_bad(call, call.grad_inputs, call.grad_params):
                return  # (none: every call is set, for a shared parameter's total)

    def own_input_grads(self, rec: _Call) -> list:
        """This call's vector-Jacobian product alone, given its incoming gradient (the
        loss's: the gradient w.r.t. the model's outputs)."""
        if rec is self.loss_rec:
            return [self.grads[_key(e)] for e in rec.in_edges]
        if id(rec) not in self.own:
            pairs = [(e, self.grads.get(_key(e))) for e in rec.out_edges]
            pairs = [(e, g) for e, g in pairs if g is not None]
            own: list = []
            if pairs and rec.in_edges:
                own = list(
                    torch.autograd.grad(
                        [e for e, _ in pairs],
                        rec.in_edges,
                        grad_outputs=[g for _, g in pairs],
                        retain_graph=True,
                        allow_unused=True,
                    )
                )
            self.own[id(rec)] = [g for g in own if g is not None]
        return self.own[id(rec)]

    def out_grad_slots(self, rec: _Call) -> list[int]:
        return self.ext.slots([self.grads.get(_key(e)) for e in rec.out_edges])

    def named_param_grads(self, rec: _Call) -> dict[str, torch.Tensor]:
        named = _named_params(rec.module, self.names)
        grads = {n: self.param_grads.get(id(p)) for n, p in named.items()}
        return {n: g for n, g in grads.items() if g is not None}


def _reentrant_refusal(model: Any, error: RuntimeError) -> InvalidArgumentError | None:
    """The refusal, ``error`` its cause, when ``autograd.grad`` failed on a checkpoint with
    ``use_reentrant=True`` ("... incompatible with .grad()"; torch < 2.1: "Checkpointing is
    not compatible with .grad()"), else None (``.backward()`` would write ``.grad`` fields)."""
    if "heckpoint" not in str(error) or ".grad()" not in str(error):
        return None
    refusal = InvalidArgumentError(
        "Expected a model whose backward pass torch.autograd.grad can take (locate_nonfinite "
        "leaves .grad untouched): torch.utils.checkpoint.checkpoint(..., use_reentrant=True) "
        "refuses it. Checkpoint with use_reentrant=False (Hugging Face: gradient_checkpointing_"
        "enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or pass loss_fn=None "
        f"(a forward fault is reported all the same). Received: model={type(model).__name__}"
    )
    refusal.__cause__ = error
    return refusal


def _key(edge: GradientEdge) -> tuple[int, int]:
    return id(edge.node), edge.output_nr


locate_model = locate  # the registry's entry point (numstab.frameworks.MODEL_LIBRARIES)
