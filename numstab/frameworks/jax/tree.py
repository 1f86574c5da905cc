"""What ``numstab.tree`` needs from JAX: the nodes registered as pytrees (flax, equinox and
optax states) open the way JAX opens them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def registered_children(node: Any) -> tuple[list[tuple[str, Any]], Callable] | None:
    """(``keystr`` path, child) pairs and JAX's rebuild for a registered pytree node; None
    for what JAX sees as a leaf. A node without children (flax NNX's ``PytreeState``) is an
    empty container, not a leaf: ``num_nodes == 1`` called it one."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_leaves == 1 and pairs[0][1] is node:  # jax sees a leaf too
        return None
    return [(jax.tree_util.keystr(path), c) for path, c in pairs], treedef.unflatten
