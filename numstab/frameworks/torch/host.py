"""Reading a tensor's values on the host, also inside ``torch.func`` transforms."""

from __future__ import annotations

import numpy as np
import torch

FT = torch._C._functorch


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
