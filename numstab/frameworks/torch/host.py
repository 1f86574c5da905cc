"""Reading a tensor's values on the host, also inside ``torch.func`` transforms."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

FT = torch._C._functorch


def is_dtensor(x) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP2 parameters and gradients). None
    exists before that module is imported, so nothing is imported here."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(x, dtensor)


def host_array(x: torch.Tensor) -> np.ndarray:
    """``x``'s values as a NumPy array (bfloat16, which NumPy lacks, as float32).

    Inside ``torch.func.grad`` / ``jvp`` even a plain tensor's ``.numpy()`` raises "Cannot
    access data pointer of Tensor that doesn't have storage" (its ``.detach()`` comes back
    wrapped). There the value is read with functorch off, through the wrappers that only
    record gradients. A ``torch.vmap``-batched tensor stays as it is: its unwrapped value
    holds the whole batch, not the value seen here."""
    if FT.peek_interpreter_stack() is None:  # no transform: the common case
        return _numpy(x)
    while FT.is_functorch_wrapped_tensor(x) and not FT.is_batchedtensor(x):
        x = FT.get_unwrapped(x)
    with torch._C._DisableFuncTorch():
        return _numpy(x)


def _numpy(x: torch.Tensor) -> np.ndarray:
    x = x.detach().cpu()
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy()


def host_view(x: Any) -> np.ndarray | None:
    """``x``'s values as a zero-copy NumPy view (detached: only read) where reading them waits
    for nothing: a strided CPU tensor, not negated or conjugated, of a dtype NumPy has, not a
    ``DTensor`` (its ``.numpy()`` is one shard), outside torch.compile and torch.func; else
    None (CUDA, bfloat16, sparse, traced)."""
    if torch.compiler.is_compiling() or FT.peek_interpreter_stack() is not None:
        return None  # first: Dynamo cannot trace is_neg()
    if not isinstance(x, torch.Tensor) or not x.is_cpu or x.layout != torch.strided:
        return None
    if x.is_neg() or x.is_conj() or x.dtype is torch.bfloat16 or is_dtensor(x):
        return None
    return x.detach().numpy() if x.requires_grad else x.numpy()
