"""Sparse torch tensors in trees: a typed error instead of torch's dispatcher trace.

torch's sparse gradients (``nn.Embedding(sparse=True)``, layout ``torch.sparse_coo``) have no
kernels for the norms, comparisons and clamps the tree functions use (torch's own
``clip_grad_norm_`` fails on them too). Testing every leaf's layout up front would cost a
C call per leaf on every call; instead the public functions translate torch's
``NotImplementedError`` when, and only when, a leaf is sparse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from numstab import frameworks
from numstab.errors import InvalidArgumentError
from numstab.tree import leaves_with_paths

F = TypeVar("F", bound=Callable[..., Any])


def dense_only(fn: F) -> F:
    """Decorate a function taking trees: torch's NotImplementedError on a non-strided leaf of
    any positional argument becomes ``InvalidArgumentError`` naming the leaf."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as error:
            found = _first_sparse_leaf(args)
            if found is None:
                raise
            path, layout = found
            raise InvalidArgumentError(
                f"Expected dense (strided) torch tensors. Received: layout={layout} at "
                f"{path or '<root>'}; sparse gradients (nn.Embedding(sparse=True)) are not "
                f"supported: use sparse=False, or pass grad.to_dense()"
            ) from error

    return wrapper  # type: ignore[return-value]


def _first_sparse_leaf(trees: tuple) -> tuple[str, Any] | None:
    layouts = frameworks.loaded("tree", "sparse_layout")
    for tree in trees:
        for path, leaf in leaves_with_paths(tree):
            for layout_of in layouts:
                layout = layout_of(leaf)
                if layout is not None:
                    return path, layout
    return None
