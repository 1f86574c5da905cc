"""What the data firewall needs from torch: its data loading, and its tensors on the fast
paths (``batch_leaf`` for ``numstab.data._fast``, ``host_view`` for ``numstab.data._fields``,
``flat_leaf`` for ``numstab.data._lean``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.utils.data as torch_data
from torch.utils.data import default_collate

from numstab.frameworks.torch.host import host_view as _view

__all__ = ["batch_leaf", "default_collate", "flat_leaf", "host_view", "worker_id"]


def worker_id() -> int | None:
    """The DataLoader worker's id (0 to num_workers - 1); None in the main process."""
    info = torch_data.get_worker_info()
    return None if info is None else int(getattr(info, "id", 0))


_HOST_FLOATS = (torch.float32, torch.float64, torch.float16)
_F32, _F64 = torch.float32, torch.float64
#: the dtypes with nothing to read (set lookups: each ``dtype.is_*`` is a C call)
_EXACT = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
_HALF = frozenset((torch.float16, torch.bfloat16))


def _batch_leaf(node: torch.Tensor, axis: int, sums: list, sizes: list) -> bool:
    """A tensor of a batch: its size along ``axis`` into ``sizes`` and, if floating, one
    fused sum (float32 or wider) into ``sums``, all read in one host sync per batch; False
    for any other dtype (complex, float8, uint16...: the general path decides). Measured: a
    NumPy view of a CPU tensor (``.numpy()`` + ``isfinite``) costs more than this sum on a
    freshly gathered batch."""
    if node.ndim > axis:
        sizes.append(node.shape[axis])
    dtype = node.dtype  # read once: each tensor attribute is a C call
    if dtype is _F32 or dtype is _F64:
        sums.append(node.sum())
    elif dtype in _EXACT:
        pass
    elif dtype in _HALF:
        sums.append(node.sum(dtype=_F32))
    else:
        return False
    return True


#: (the type, its check) for ``numstab.data._fast``'s walk over a batch (a leaf of exactly
#: this type skips the walk's container tests; a subclass takes the walk's ``isinstance``)
batch_leaf = (torch.Tensor, _batch_leaf)


def host_view(x: Any) -> np.ndarray | None:
    """The zero-copy view (``host.host_view``) of a float16/32/64 CPU tensor, else None."""
    return _view(x) if isinstance(x, torch.Tensor) and x.dtype in _HOST_FLOATS else None


class _Gather:
    """A drop's gather of torch tensors: ``index`` converts the kept positions (a NumPy
    index vector) once per batch, ``take`` selects them, one ``index_select`` per field."""

    index = staticmethod(torch.from_numpy)

    @staticmethod
    def take(x: torch.Tensor, index: torch.Tensor, axis: int) -> torch.Tensor:
        return x.index_select(axis, index)


_GATHER = _Gather()


def flat_leaf(x: Any, axis: int) -> tuple[np.ndarray | None, Any] | None:
    """For the short way of a dirty flat batch (``numstab.data._lean``): a strided CPU
    tensor with a batch axis as (its ``host_view`` for float16/32/64, None for an integer or
    bool one; its gather, ``index`` and ``take``); None for anything else (bfloat16, complex,
    another device or layout), which the general path handles."""
    if not isinstance(x, torch.Tensor) or x.ndim <= axis or not x.is_cpu:
        return None
    if x.layout != torch.strided:
        return None
    if x.dtype.is_floating_point or x.dtype.is_complex:
        view = host_view(x)
        return None if view is None else (view, _GATHER)
    return None, _GATHER
