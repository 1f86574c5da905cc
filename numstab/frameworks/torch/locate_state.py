"""What a torch ``locate_nonfinite`` pass runs on and leaves behind: the eager module and
its names (``eager``), differentiable copies of the model's inputs (``differentiable``),
the forward hooks, placed so that the hooked pass computes what the model computes
without them (``forward_hooks``), and the RNG and buffers put back afterwards
(``kept_state``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from numstab.errors import InvalidArgumentError


@contextlib.contextmanager
def kept_state(model: torch.nn.Module) -> Iterator[None]:
    """What a located (or replayed) pass changes in the model and the process, put back on
    exit, also on error: the RNG states (CPU, and the CUDA devices of the model's
    parameters and buffers: dropout draws) and every buffer (BatchNorm's running
    statistics and ``num_batches_tracked``, updated by a forward in training mode, NaN after
    a NaN batch). Each buffer's values are copied back into the tensor the module held
    before, which the module holds again (one that the pass reassigned is put back). A
    buffer no pass can write in place is not copied: an expanded one (stride 0, whose
    ``copy_`` torch refuses) and an uninitialised lazy one (``LazyBatchNorm``: the pass
    materialises it, as the model's own first call would, and its module's
    ``reset_running_stats`` then gives it a fresh module's values, not the located batch's).
    (BatchNorm's kernel updates its running statistics without moving their ``_version``:
    every other buffer is copied back; an inference tensor inside ``inference_mode``.)
    Cost: one copy of the buffers."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not is_lazy(t)]
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    saved = [
        (mod, name, buf, None if _unwritable(buf) else buf.detach().clone())
        for mod in model.modules()
        for name, buf in mod._buffers.items()
        if buf is not None
    ]
    lazy = [mod for mod in model.modules() if any(is_lazy(b) for b in mod._buffers.values())]
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for mod, name, buf, copy in saved:
                    if copy is not None:
                        with torch.inference_mode(buf.is_inference()):
                            buf.copy_(copy)
                    mod._buffers[name] = buf
                for mod in lazy:  # materialised by the pass: back to a fresh module's values
                    reset = getattr(mod, "reset_running_stats", None)
                    if callable(reset) and not any(is_lazy(b) for b in mod._buffers.values()):
                        reset()


def _unwritable(buf: torch.Tensor) -> bool:
    """A lazy buffer not initialised yet, or one whose elements share memory (expanded):
    no in-place write can have changed it."""
    if is_lazy(buf):
        return True
    strided = buf.layout == torch.strided and not buf.is_nested  # (others have no strides)
    return strided and torch._debug_has_internal_overlap(buf) == 1  # 1: MemOverlap::Yes


def hook_blind(names: dict) -> set:
    """The modules whose hooks change what the model computes: a ``TransformerEncoderLayer``
    takes torch's fused fast path (eval, no grad) only when neither it nor any of its
    sub-modules has a forward (pre) hook of its own, so it and its sub-modules are hooked
    through torch's global module hooks, which that check does not read."""
    blind: set = set()
    for module in names:
        if isinstance(module, torch.nn.TransformerEncoderLayer):
            blind.update(m for m in module.modules() if m in names)
    return blind


@contextlib.contextmanager
def forward_hooks(
    names: dict, pre: Callable[..., None], post: Callable[..., None]
) -> Iterator[None]:
    """``pre(mod, args, kwargs)`` and ``post(mod, args, kwargs, output)`` around the call of
    every module in ``names``, removed on exit (also on error). Hooks are the modules' own,
    except for ``hook_blind`` modules: torch's global module hooks, filtered to them, where
    ``pre`` gets ``kwargs=None`` (torch hands global pre hooks no keyword arguments; ``post``
    gets them)."""
    blind = hook_blind(names)
    handles = []
    try:
        for mod in names:
            if mod not in blind:
                handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(mod.register_forward_hook(post, with_kwargs=True))
        if blind:
            module_hooks = torch.nn.modules.module

            def global_pre(mod: Any, args: tuple) -> None:
                if mod in blind:
                    pre(mod, args, None)

            def global_post(mod: Any, args: tuple, kwargs: dict, output: Any) -> None:
                if mod in blind:
                    post(mod, args, kwargs, output)

            handles.append(module_hooks.register_module_forward_pre_hook(global_pre))
            handles.append(module_hooks.register_module_forward_hook(global_post, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def differentiable(inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The model's arguments for the instrumented pass: each floating (not complex) tensor
    that does not require grad, positional or keyword, top level or inside tuples, lists,
    namedtuples and dicts, becomes ``t.detach().requires_grad_().clone()``, so its gradient
    (``d loss / d input``) is taken, as Keras on torch does with its layers' inputs. The
    clone (one copy) keeps the model's in-place edits of its input legal (a leaf that
    requires grad cannot be edited) and off the caller's tensor; an inference tensor is
    copied out of inference mode first. One tensor given twice becomes one new tensor;
    integer (token ids), bool and complex tensors, tensors inside other objects and tensors
    already requiring grad are passed as given; a nest with nothing to replace is the same
    object."""
    fresh: dict[int, torch.Tensor] = {}

    def swap(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.requires_grad or not x.is_floating_point():
                return x
            if id(x) not in fresh:
                base = x.detach()
                if base.is_inference():  # requires_grad_ is refused outside inference mode
                    base = base.clone()
                fresh[id(x)] = base.requires_grad_().clone()
            return fresh[id(x)]
        if type(x) in (tuple, list) or _is_namedtuple(x) or type(x) is dict:
            keys = list(x) if type(x) is dict else range(len(x))
            values = [swap(x[k]) for k in keys]
            if all(v is x[k] for v, k in zip(values, keys, strict=True)):
                return x
            if type(x) is dict:
                return dict(zip(keys, values, strict=True))
            return type(x)(*values) if _is_namedtuple(x) else type(x)(values)
        return x

    return swap(inputs), swap(kwargs)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def eager(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """The eager module behind ``model`` and its ``named_modules`` names: a
    ``torch.compile`` wrapper (``OptimizedModule``) is located as the module it compiles,
    under the same names; TorchScript modules cannot be hooked."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    compiled = getattr(eval_frame, "OptimizedModule", None)
    while compiled is not None and isinstance(model, compiled):
        model = model._orig_mod
    names = {m: n for n, m in model.named_modules()}
    for module, name in names.items():
        if isinstance(module, torch.jit.ScriptModule):
            where = f"model.{name}" if name else "model"
            raise InvalidArgumentError(
                "Expected an eager torch.nn.Module: TorchScript modules (torch.jit.script, "
                "torch.jit.trace) cannot be hooked; pass the eager module they were made "
                f"from. Received: {where}={type(module).__name__}"
            )
    return model, names
