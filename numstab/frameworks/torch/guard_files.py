"""A torch guard's snapshot payload in a file of ``snapshot_dir`` (``numstab.guard.snapshots``)
and back.

The payload (``model``, ``optimizer`` and ``scheduler`` state dicts) is stored as NumPy
arrays. NumPy has no bfloat16 (without ``ml_dtypes``), so a bfloat16 tensor is stored as
float32, exactly, and the payload's ``"bfloat16"`` entry lists where each one was (its path:
the keys and list indices from the payload's root). Loading casts them back, exactly, and
the optimizer's state is then restored with the file's dtypes (``guard_groups.exact_state``;
torch's ``load_state_dict`` casts every floating state tensor to its parameter's dtype): a
float32 master copy of a bfloat16 parameter stays float32, Adam's bfloat16 moments stay
bfloat16. A file without the entry (written before) cannot tell a bfloat16 state from a
float32 one: its optimizer state is cast as torch casts it, as before (``CAST``).

Data-parallel ranks (a ``torch.distributed`` group of more than one rank) given the same
``snapshot_dir``: ``rank_directory`` says who writes what, ``load_on_every_rank`` resumes
every rank from the same step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from numstab import _validate as v
from numstab.errors import InvalidArgumentError
from numstab.guard.runner import check_fits, check_payload
from numstab.guard.snapshots import SnapshotDirectory

BFLOAT16 = "bfloat16"  # the payload's entry: the paths of its bfloat16 tensors
CAST = "cast_like_torch"  # set on a loaded payload whose file does not say which those were


def to_host(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload as NumPy arrays, and where its bfloat16 tensors were (``"bfloat16"``)."""
    paths: list[list[Any]] = []
    return {**_host(payload, [], paths), BFLOAT16: paths}


def _host(x: Any, path: list[Any], paths: list[list[Any]]) -> Any:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            paths.append(path)
            t = t.float()
        return t.numpy()
    if isinstance(x, dict):
        return {k: _host(v, [*path, k], paths) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v, [*path, i], paths) for i, v in enumerate(x))
    return x


def from_host(tree: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """A snapshot file's payload as tensors, after checking that it fits ``model`` and
    ``optimizer`` (``check_fits``: before, torch's load_state_dict raised after loading the
    parameters that did fit); its bfloat16 tensors bfloat16 again."""
    check_payload(tree, ("model", "optimizer"), "torch")
    current = model.state_dict()
    check_fits(
        "model's state_dict",
        list(tree["model"].items()),
        [(k, tuple(t.shape)) for k, t in current.items()],
    )
    groups = lambda state: [
        (f"param_groups[{i}]['params']", g["params"]) for i, g in enumerate(state)
    ]
    check_fits(
        "optimizer's parameter groups",
        groups(tree["optimizer"]["param_groups"]),
        [(name, (len(p),)) for name, p in groups(optimizer.param_groups)],
    )
    payload = _tensors({k: x for k, x in tree.items() if k != BFLOAT16})
    if BFLOAT16 not in tree:
        return {**payload, CAST: True}
    for path in tree[BFLOAT16]:
        try:
            payload = _bfloat16_at(payload, list(path))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"Expected the paths of the payload's tensors in a torch snapshot's "
                f"'{BFLOAT16}' entry. Received: {path!r} ({type(exc).__name__}: {exc})"
            ) from None
    return payload


def _bfloat16_at(node: Any, path: list[Any]) -> Any:
    """``node`` with the tensor at ``path`` cast to bfloat16 (tuples rebuilt)."""
    if not path:
        if not isinstance(node, torch.Tensor):
            raise TypeError(f"a {type(node).__name__}, not a tensor")
        return node.to(torch.bfloat16)
    k, rest = path[0], path[1:]
    if isinstance(node, tuple):
        if not (isinstance(k, int) and 0 <= k < len(node)):
            raise IndexError(f"no item {k!r} of a tuple of {len(node)}")
        return type(node)(_bfloat16_at(x, rest) if i == k else x for i, x in enumerate(node))
    if not isinstance(node, (dict, list)):
        raise TypeError(f"a {type(node).__name__} on the way")
    node[k] = _bfloat16_at(node[k], rest)
    return node


def _tensors(tree: Any) -> Any:
    """``tree`` with its NumPy arrays as tensors (``load_state_dict`` casts and moves them)."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.array(tree))
    if isinstance(tree, dict):
        return {k: _tensors(x) for k, x in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tensors(x) for x in tree)
    return tree


# -- data-parallel ranks sharing snapshot_dir -----------------------------------------------------


def rank_directory(
    disk: SnapshotDirectory | None, group: Any, per_rank: bool
) -> SnapshotDirectory | None:
    """Where this rank of ``group`` writes its snapshots; ``disk`` itself for one process.

    - Replicated state (DDP; ``per_rank`` False): every rank holds the same files' worth,
      so rank 0 alone writes and prunes ``disk``'s folder; the others read it
      (``writer=False``) and keep their snapshots in memory. Before, every rank wrote
      there and each write removed the other ranks' temporary files being written (their
      ``os.replace`` raised FileNotFoundError, and the other ranks hung in the next
      collective), and a rank took another's step-0 file for an earlier run's.
    - Per-rank state (``sharded=True``, FSDP2's DTensors): rank r writes its own files in
      the subfolder ``rank-<r>``, each rank's earlier-run test and pruning seeing only its own.
    """
    if disk is None or group is None:
        return disk
    rank = dist.get_rank(group)
    if per_rank:
        return SnapshotDirectory(os.path.join(disk.directory, f"rank-{rank}"), disk.keep)
    return SnapshotDirectory(disk.directory, disk.keep, writer=rank == 0)


def load_on_every_rank(
    disk: SnapshotDirectory,
    load: Callable[[int], tuple[int, Any]],
    step: int | None,
    group: Any,
    device: Any,
) -> tuple[int, Any]:
    """``load(s)`` on every rank of ``group`` at one step ``s``, agreed in collectives, so
    that every rank restores the same step or every rank raises (none hangs in the next
    step's collective, none trains on alone). Every rank must call it.

    1. One all-reduce first, so that what a rank wrote before (rank 0's first snapshot at
       construction) is complete on disk when the others list the folder.
    2. ``s`` = the MIN over ranks of ``step``, by default of each rank's newest file (-1:
       none): the newest step every rank holds when a crash lost one rank's last write.
       A ``step`` that differs across ranks, or a rank without files, raises on every rank.
    3. Each rank loads ``s``; the MIN of the success flags: a rank that failed raises its
       error, the others an InvalidArgumentError saying so.
    """
    if step is not None:
        v.check_int("step", step)
    flags = lambda values: torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(flags([0]), group=group)
    steps = disk.steps()
    wanted = step if step is not None else (steps[-1] if steps else -1)
    agreed = flags([wanted, -wanted])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    low, high = int(agreed[0]), -int(agreed[1])
    if low != high and step is not None:
        raise InvalidArgumentError(
            f"Expected the same step on every rank. Received: step={step!r} on this rank, "
            f"steps from {low} to {high} across ranks"
        )
    if low < 0:
        raise InvalidArgumentError(
            f"Expected a snapshot file on every rank. Found none on at least one rank "
            f"(this rank's {disk.directory} holds steps {steps})"
        )
    error: Exception | None = None
    try:
        result = load(low)
    except Exception as exc:  # re-raised below, once every rank knows
        error = exc
    ok = flags([error is None])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if error is not None:
        raise error
    if not int(ok[0]):
        raise InvalidArgumentError(
            f"Expected every rank to load the snapshot of step {low}. Another rank could "
            f"not (its error says why); this rank's {disk.directory} holds steps {steps}"
        )
    return result
