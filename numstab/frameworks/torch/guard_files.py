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
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from numstab.errors import InvalidArgumentError
from numstab.guard.runner import check_fits, check_payload

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
