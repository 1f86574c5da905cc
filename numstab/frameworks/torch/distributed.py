"""Agreeing across data-parallel ranks in torch: the group to reduce over, and the
GradScaler's per-optimizer flag and gradient norm reduced in one collective per step."""

from __future__ import annotations

import enum
import math
from typing import Any

import torch
import torch.distributed as dist

from numstab.frameworks.torch.backend import is_dtensor


class Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class OptimizerState:
    """Per optimizer and iteration: its stage and its non-finite flag (0-d float32)."""

    __slots__ = ("found_inf", "reduced", "stage")

    def __init__(self) -> None:
        self.stage = Stage.READY
        self.found_inf: torch.Tensor | None = None  # on the scale's device
        self.reduced = False  # True once all-reduced across ranks (or nothing to reduce)


def reduction_group(process_group: Any = None) -> Any:
    """The process group to reduce over: ``process_group``, else the default group when
    ``torch.distributed`` is initialized; None for a single process (world size 1)."""
    group = process_group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def reduced_found_inf(opt_state: OptimizerState, group: Any) -> torch.Tensor:
    """The optimizer's non-finite flag, all-reduced with MAX once per iteration."""
    found = opt_state.found_inf
    assert found is not None
    if not opt_state.reduced:
        if group is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        opt_state.reduced = True
    return found


def reduce_norm(
    norm: torch.Tensor,
    norm_type: float,
    opt_state: OptimizerState | None,
    group: Any,
    sharded: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(global norm, global non-finite flag or None when disabled), in one collective.
    The norm of DTensor gradients (FSDP2) is global already: it is read as replicated."""
    found = None if opt_state is None else opt_state.found_inf
    if is_dtensor(norm):
        norm, sharded = norm.full_tensor(), False
    if group is None or not sharded:
        if opt_state is not None and not opt_state.reduced:
            # a non-finite unscaled norm (scale < 1 overflow) skips too, on every rank
            assert found is not None
            finite = (norm < math.inf).to(found.device)  # a norm is >= 0 or NaN
            opt_state.found_inf = torch.where(finite, found, 1.0)
            found = reduced_found_inf(opt_state, group)
        return norm, found
    # sharded: one SUM of [sum |g|**p, flag] (MAX of [max |g|, flag] for p = inf)
    device = norm.device if found is None else found.device
    flag = torch.zeros((), device=device) if found is None else found
    if norm_type == math.inf:
        # MAX may drop a NaN (gloo's max is order-dependent): report it as inf
        local = torch.where(torch.isnan(norm), math.inf, norm)
        packed = torch.stack([local.to(device), flag.to(local.dtype)])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        norm = packed[0]
    else:
        packed = torch.stack([norm.to(device) ** norm_type, flag.to(norm.dtype)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        norm = packed[0] ** (1.0 / norm_type) if norm_type != 1.0 else packed[0]
    if opt_state is not None:
        opt_state.found_inf = (packed[1] != 0).to(torch.float32)
        opt_state.reduced = True
        found = opt_state.found_inf
    return norm, found


def max_over_ranks(value: int) -> int:
    """The maximum of ``value`` over the ranks of ``torch.distributed``'s default group (world
    size > 1), one all-reduce on the CPU (NCCL: the current CUDA device); ``value`` itself in
    one process. Every rank must call it alike."""
    group = reduction_group()
    if group is None:
        return value
    nccl = dist.get_backend(group) == "nccl"
    found = torch.tensor(value, dtype=torch.int64, device="cuda" if nccl else "cpu")
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return int(found)


def is_data_parallel(module: torch.nn.Module) -> bool:
    """A DDP, FSDP or FSDP2 (``fully_shard``) module: one that every rank of a group runs."""
    from torch.distributed import fsdp

    kinds = (torch.nn.parallel.DistributedDataParallel, fsdp.FullyShardedDataParallel)
    return isinstance(module, (*kinds, getattr(fsdp, "FSDPModule", ())))
