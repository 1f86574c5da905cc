"""Which torch tensors ``check_numerics`` reads, and how: the checkable tensors of an aten op's
output or of a module's output (a tree, §6), and a tensor as a real floating tensor with the
same NaN and inf (nested, 8-bit float and complex tensors included)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from numstab.frameworks.torch.backend import flat_values

#: 8-bit floats: no ``aminmax``/``isinf`` kernels, read upcast to float32 (exact); the
#: packed float4 has neither NaN nor inf, nor a cast (``numstab._finite_reads``)
FLOAT8 = frozenset(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))
_NO_NONFINITE = frozenset(getattr(torch, n) for n in dir(torch) if n.startswith("float4_"))


def checkable(t: Any) -> bool:
    """A non-empty floating or complex tensor that can hold NaN or inf (a nested tensor
    counts its components' elements)."""
    return (
        isinstance(t, torch.Tensor)
        and (t.is_floating_point() or t.is_complex())
        and t.dtype not in _NO_NONFINITE
        and t.numel() != 0
    )


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a real floating tensor with the same non-finite values: a nested tensor as its
    components' elements (1-D), an 8-bit float upcast to float32 (every value kept), a
    complex one viewed as its (real, imag) pairs (a complex value is finite when both parts
    are), any other as it is."""
    t = flat_values(t)
    if t.dtype in FLOAT8:
        return t.float()
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def op_tensors(out: Any) -> list[torch.Tensor]:
    """The checkable tensors of an aten op's output: a tensor, or those in a tuple, list or
    dict (an op returns no deeper structure)."""
    out = (out,) if isinstance(out, torch.Tensor) else out
    out = tuple(out.values()) if isinstance(out, dict) else out
    return [t for t in out if checkable(t)] if isinstance(out, (tuple, list)) else []


def module_tensors(out: Any) -> list[torch.Tensor]:
    """The checkable tensors of an ``nn.Module``'s output, in numstab's flattening order (§6):
    a tensor, or the tensors of nested tuples, lists (namedtuples too), mappings (dicts, a
    Hugging Face ``ModelOutput``) and dataclasses. The sentinel's hook runs on every module
    call, so this is a plain walk (a few us; ``numstab.tree.flatten`` took about 20): a bare
    tensor takes none. Anything else is not entered: an iterator (a generator: the caller
    still gets every item, at any depth), a transformers ``Cache`` (its tensors were made by
    the attention modules, whose outputs are recorded already; walked, every model output
    re-read the whole KV cache at every generated token), strings and numbers."""
    if isinstance(out, torch.Tensor):
        return [out] if checkable(out) else []
    found: list[torch.Tensor] = []
    _walk(out, found, set())
    return found


def _walk(node: Any, found: list, entered: set[int]) -> None:
    """``found`` += the checkable tensors under ``node``; each container is entered once
    (``entered``: ids), so one that holds itself, or is held twice, is read once."""
    if isinstance(node, torch.Tensor):
        if checkable(node):
            found.append(node)
        return
    if id(node) in entered:
        return
    if isinstance(node, (tuple, list)):
        children: Any = node
    elif isinstance(node, Mapping):
        children = node.values()
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):  # §6: init fields
        children = [getattr(node, f.name, None) for f in dataclasses.fields(node) if f.init]
    else:
        return
    entered.add(id(node))
    for child in children:
        _walk(child, found, entered)


def counts(t: torch.Tensor) -> tuple[int, int]:
    """Elements holding NaN, and inf (a complex element in either part)."""
    t = flat_values(t)
    t = t.float() if t.dtype in FLOAT8 else t
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
