"""What numstab's tree functions need from torch: modules and state dicts as named leaves,
and the layout of sparse gradients."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch


def named_leaves(tree: Any) -> list[tuple[str, Any]] | None:
    """A module's ``named_parameters`` then floating ``named_buffers``; a state dict (a
    non-empty mapping of str to tensors) as its items; None for anything else, a Keras layer
    on Keras' torch backend included (a ``torch.nn.Module`` too: the Keras hook names its
    variables by their Keras paths, as on the other backends)."""
    if isinstance(tree, torch.nn.Module) and not _is_keras_layer(tree):
        buffers = [(n, b) for n, b in tree.named_buffers() if b.is_floating_point()]
        return list(tree.named_parameters()) + buffers
    if (
        isinstance(tree, Mapping)
        and len(tree) > 0
        and all(isinstance(k, str) and isinstance(x, torch.Tensor) for k, x in tree.items())
    ):
        return list(tree.items())
    return None


def _is_keras_layer(module: torch.nn.Module) -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(module, keras.Layer)


def sparse_layout(leaf: Any) -> Any | None:
    """The layout of a tensor that is not strided (``torch.sparse_coo``, ...), else None."""
    if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
        return leaf.layout
    return None
