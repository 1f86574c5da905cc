"""PyTorch for the benchmark: the model's ops, autograd, eager execution, memory stats."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from numstab.bench.errors import FrameworkSetupError

name = "torch"
_device = torch.device("cpu")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def setup(device: str) -> None:
    global _device
    if device == "gpu":
        if not torch.cuda.is_available():
            raise FrameworkSetupError("torch sees no CUDA GPU (torch.cuda.is_available() is False)")
        _device = torch.device("cuda:0")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))


def versions() -> dict[str, str]:
    return {"torch": torch.__version__}


def device_name() -> str:
    if _device.type == "cuda":
        return torch.cuda.get_device_name(_device)
    return f"cpu ({torch.get_num_threads()} threads)"


class ops:
    cast = staticmethod(lambda x, dtype: x.to(_DTYPES[dtype]))
    take = staticmethod(lambda table, ids: table[ids.long()])
    matmul = staticmethod(torch.matmul)
    reshape = staticmethod(torch.reshape)
    transpose = staticmethod(lambda x, perm: x.permute(*perm))
    mean = staticmethod(lambda x: x.mean(dim=-1, keepdim=True))
    rsqrt = staticmethod(torch.rsqrt)
    tanh = staticmethod(torch.tanh)
    exp = staticmethod(torch.exp)
    max = staticmethod(lambda x: x.amax(dim=-1, keepdim=True))
    sum = staticmethod(lambda x: x.sum(dim=-1, keepdim=True))
    constant = staticmethod(lambda a: torch.from_numpy(a).to(_device))
    absmax = staticmethod(lambda x: x.detach().abs().amax().float())


def asarray(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.array(a), device=_device)


def to_numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def value_and_grad(fn: Callable) -> Callable:
    def wrapped(params: dict, *args: Any) -> tuple:
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        out, aux = fn(leaves, *args)
        grads = torch.autograd.grad(out, list(leaves.values()))
        return (out.detach(), _detach(aux)), dict(zip(leaves, grads, strict=True))

    return wrapped


def _detach(tree: Any) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(_detach(x) for x in tree)
    return tree.detach()


def compile(step: Callable) -> Callable:
    return step  # eager: torch.compile's compile time dwarfs these short runs


def no_grad() -> contextlib.AbstractContextManager:
    return torch.no_grad()


def reset_peak_memory() -> None:
    if _device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(_device)


def peak_memory() -> tuple[int, str]:
    if _device.type == "cuda":
        return torch.cuda.max_memory_allocated(_device), "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS high-water"
