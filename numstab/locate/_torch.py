"""locate_nonfinite for torch.nn.Module: forward hooks and full backward hooks on every
sub-module (``named_modules`` names), gradients by ``torch.autograd.grad`` (the user's
``.grad`` fields are not touched)."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch

from numstab.backends import load_backend
from numstab.locate._report import LOSS, LayerCall, LocateReport, summarise
from numstab.nonfinite import find_nonfinite
from numstab.tree import flatten


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in flatten(x)[0] if isinstance(t, torch.Tensor)]


class _Maxima:
    """Per-tensor max |x| of every hook's tensors: one multi-tensor kernel per hook, taken
    at once (later in-place edits cannot hide a value), read to the host once at the end."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.slots: list[tuple[LayerCall, str, int, int]] = []
        self.pending: list = []
        self.size = 0

    def add(self, call: LayerCall, **groups: list) -> None:
        self._take([(call, field, tensors) for field, tensors in groups.items()])

    def defer(self, call: LayerCall, **groups: list) -> None:
        """Like ``add`` for tensors that do not change before ``read`` (parameters, their
        gradients): all deferred ones share one kernel."""
        self.pending += [(call, field, tensors) for field, tensors in groups.items()]

    def _take(self, groups: list) -> None:
        flat: list[torch.Tensor] = []
        for call, field, tensors in groups:
            tensors = [t for t in tensors if t.is_floating_point() and t.numel()]
            if tensors:
                start = self.size + len(flat)
                self.slots.append((call, field, start, start + len(tensors)))
                flat += tensors
        if not flat:
            return
        norms = torch._foreach_norm([t.detach() for t in flat], float("inf"))
        wide = torch.float64 if any(t.dtype == torch.float64 for t in flat) else torch.float32
        self.parts.append(torch.stack([n.to(norms[0].device, wide) for n in norms]))
        self.size += len(flat)

    def read(self) -> None:
        """Set each call's fields to the max of its tensors' maxima (NaN wins, then inf)."""
        self._take(self.pending)
        self.pending = []
        if not self.parts:
            return
        device = self.parts[0].device
        wide = torch.float64 if any(p.dtype == torch.float64 for p in self.parts) else None
        host = torch.cat([p.to(device, wide or p.dtype) for p in self.parts]).cpu().numpy()
        for call, field, start, stop in self.slots:
            setattr(call, field, host[start:stop].max())


def locate(model: torch.nn.Module, inputs: tuple, loss_fn, targets) -> LocateReport:
    maxima = _Maxima()
    calls: list[LayerCall] = []
    kept: dict[int, dict[str, Any]] = {}  # id(call) -> the tensors behind its maxima
    opened: dict[torch.nn.Module, list[LayerCall]] = {}
    awaiting: dict[torch.nn.Module, list[LayerCall]] = {}
    clock, bclock = itertools.count(), itertools.count()
    names = {m: n for n, m in model.named_modules()}

    def own_params(mod: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        prefix = names[mod] + "." if names[mod] else ""
        return [(prefix + n, p) for n, p in mod.named_parameters(recurse=False)]

    def pre(mod, args, kwargs):
        call = LayerCall(names[mod], type(mod).__name__, start=next(clock))
        opened.setdefault(mod, []).append(call)

    def post(mod, args, kwargs, output):
        call = opened[mod].pop()
        call.end = next(clock)
        ins, outs, params = _tensors((args, kwargs)), _tensors(output), own_params(mod)
        maxima.add(call, inputs=ins, outputs=outs)
        maxima.defer(call, params=[p for _, p in params])
        kept[id(call)] = {"outputs": outs, "params": dict(params)}
        calls.append(call)
        awaiting.setdefault(mod, []).append(call)

    def backward(mod, grad_input, grad_output):
        if not awaiting.get(mod):
            return
        call = awaiting[mod].pop()
        call.backward = next(bclock)
        grads = [g for g in grad_input if g is not None]
        maxima.add(call, grad_inputs=grads, grad_outputs=[g for g in grad_output if g is not None])
        kept[id(call)]["grad_inputs"] = grads

    handles = []
    for mod in names:
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
        if loss_fn is not None:
            handles.append(mod.register_full_backward_hook(backward))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            with torch.set_grad_enabled(loss_fn is not None and torch.is_grad_enabled()):
                output = model(*inputs)
            if loss_fn is not None:
                _loss_and_backward(model, output, loss_fn, targets, calls, kept, clock, maxima)
    finally:
        for h in handles:
            h.remove()

    def counts(call: LayerCall, phase: str) -> tuple[int, int]:
        tensors = kept[id(call)]
        key = "outputs" if phase == "forward" else "grad_inputs"
        found = find_nonfinite(tensors.get(key, []))
        if phase == "backward":
            found += find_nonfinite(tensors.get("grad_params", {}))
        return sum(r.nan_count for r in found), sum(r.inf_count for r in found)

    def param_paths(call: LayerCall, phase: str) -> list[str]:
        key = "params" if phase == "forward" else "grad_params"
        return [r.path for r in find_nonfinite(kept[id(call)].get(key, {}))]

    maxima.read()
    return summarise(
        load_backend("numpy"),
        calls,
        backward_checked=loss_fn is not None,
        counts=counts,
        param_paths=param_paths,
        framework="torch",
    )


def _loss_and_backward(model, output, loss_fn, targets, calls, kept, clock, maxima) -> None:
    outs = _tensors(output)
    loss_call = LayerCall(LOSS, "loss_fn", start=next(clock))
    loss = loss_fn(output) if targets is None else loss_fn(output, targets)
    loss_call.end = next(clock)
    maxima.add(loss_call, inputs=outs, outputs=_tensors(loss))
    kept[id(loss_call)] = {"outputs": _tensors(loss)}
    calls.append(loss_call)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return
    differentiable = [t for t in outs if t.requires_grad]
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    scalar = loss if loss.dim() == 0 else loss.sum()
    grads = torch.autograd.grad(scalar, differentiable + [p for _, p in params], allow_unused=True)
    loss_call.backward = -1.0  # the loss's backward runs first
    loss_grads = [g for g in grads[: len(differentiable)] if g is not None]
    maxima.add(loss_call, grad_inputs=loss_grads)
    kept[id(loss_call)]["grad_inputs"] = loss_grads
    by_param = {id(p): g for (_, p), g in zip(params, grads[len(differentiable) :], strict=True)}
    for call in calls:
        own = kept[id(call)].get("params", {})
        named = {n: by_param.get(id(p)) for n, p in own.items()}
        maxima.defer(call, grad_params=[g for g in named.values() if g is not None])
        kept[id(call)]["grad_params"] = {n: g for n, g in named.items() if g is not None}
