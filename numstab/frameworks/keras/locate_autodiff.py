"""The autodiff that locating a Keras model needs, per Keras backend with a tape-like
autodiff (TensorFlow, torch): record a forward pass, take the total gradients of the loss
w.r.t. recorded tensors, and one layer call's own vector-Jacobian product."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from numstab.tree import flatten, unflatten


class TensorFlowAutodiff:
    """A persistent ``tf.GradientTape`` over the pass; layer inputs are watched."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf
        self.tape: Any = None

    def floating(self, x: Any) -> list:
        tf = self.tf
        return [
            t
            for t in flatten(x)[0]
            if isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating
        ]

    @contextlib.contextmanager
    def recording(self, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        with self.tf.GradientTape(persistent=True) as self.tape:
            yield

    def differentiable(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.tape.watch(self.floating((args, kwargs)))
        return args, kwargs

    def scalar(self, loss: Any) -> Any:
        tf = self.tf
        return tf.reduce_sum(tf.cast(loss, tf.float32))

    def gradients(self, loss: Any, sources: list) -> list:
        return self.tape.gradient(loss, sources)

    def own_vjp(self, call: Callable, args: tuple, kwargs: dict, ins: list, seeds: list):
        with self.tf.GradientTape() as tape:
            tape.watch(ins)
            outs = self.floating(call(*args, **kwargs))
        seeds = [
            g if g is not None else self.tf.zeros_like(o) for g, o in zip(seeds, outs, strict=False)
        ]
        grads = tape.gradient(outs, ins, output_gradients=seeds)
        return [g for g in grads if g is not None]


class TorchAutodiff:
    """``torch.autograd.grad`` on the pass's graph; floating layer inputs that do not
    require grad are handed to the layer as leaves that do, so their gradient exists."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def floating(self, x: Any) -> list:
        torch = self.torch
        return [t for t in flatten(x)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]

    def recording(self, enabled: bool) -> contextlib.AbstractContextManager:
        return self.torch.enable_grad() if enabled else contextlib.nullcontext()

    def differentiable(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, treedef = flatten((args, kwargs))
        torch = self.torch
        leaves = [
            t.detach().requires_grad_()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad
            else t
            for t in leaves
        ]
        return unflatten(treedef, leaves)

    def scalar(self, loss: Any) -> Any:
        return loss.float().sum()

    def gradients(self, loss: Any, sources: list) -> list:
        wanted = [i for i, t in enumerate(sources) if t.requires_grad]
        if not loss.requires_grad:  # a constant loss: no gradient reaches anything
            return [None] * len(sources)
        grads = self.torch.autograd.grad(
            loss, [sources[i] for i in wanted], allow_unused=True, retain_graph=True
        )
        out: list = [None] * len(sources)
        for i, g in zip(wanted, grads, strict=True):
            out[i] = g
        return out

    def own_vjp(self, call: Callable, args: tuple, kwargs: dict, ins: list, seeds: list):
        torch = self.torch
        fresh = {id(t): t.detach().requires_grad_() for t in ins}
        leaves, treedef = flatten((args, kwargs))
        args, kwargs = unflatten(treedef, [fresh.get(id(t), t) for t in leaves])
        with torch.enable_grad():
            outs = self.floating(call(*args, **kwargs))
        pairs = [
            (o, g if g is not None else torch.zeros_like(o))
            for o, g in zip(outs, seeds, strict=False)
            if o.requires_grad
        ]
        if not pairs:
            return []
        grads = torch.autograd.grad(
            [o for o, _ in pairs], list(fresh.values()), [g for _, g in pairs], allow_unused=True
        )
        return [g for g in grads if g is not None]


def autodiff_for(framework: str) -> TensorFlowAutodiff | TorchAutodiff:
    return {"tensorflow": TensorFlowAutodiff, "torch": TorchAutodiff}[framework]()
