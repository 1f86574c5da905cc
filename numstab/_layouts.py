"""torch tensors of layouts the tree functions cannot compute on: a typed error instead of
torch's dispatcher trace.

torch's sparse gradients (``nn.Embedding(sparse=True)``, layout ``torch.sparse_coo``) have no
kernels for the norms, comparisons and clamps the tree functions use (torch's own
``clip_grad_norm_`` fails on them too), and nested tensors (``torch.nested``, strided or
jagged) have none for ``_foreach_mul``, ``clamp`` or a unit's ``sum`` over an axis. Testing
every leaf's layout up front would cost a C call per leaf on every call; instead the public
functions translate torch's ``NotImplementedError`` / ``RuntimeError`` when, and only when, a
leaf of an argument is sparse or nested. What only reads (``all_finite``, ``find_nonfinite``,
``global_norm``) reads a nested tensor through its components.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from numstab import frameworks
from numstab.errors import InvalidArgumentError
from numstab.tree import leaves_with_paths

F = TypeVar("F", bound=Callable[..., Any])


def dense_only(fn: F) -> F:
    """Decorate a function taking trees: torch's NotImplementedError or RuntimeError on a
    sparse or nested leaf of any argument becomes ``InvalidArgumentError`` naming the
    argument, the leaf and its layout; any other error passes unchanged."""
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as error:
            named = [*zip(names, args, strict=False), *kwargs.items()]
            found = _first_unsupported_leaf(named)
            if found is None:
                raise
            raise InvalidArgumentError(_message(*found)) from error

    return wrapper  # type: ignore[return-value]


def _message(name: str, path: str, layout: Any, nested: bool) -> str:
    """The error for a sparse or nested leaf at ``path`` of argument ``name``."""
    where = f"{path or '<root>'} of {name}"
    if nested:
        return (
            f"Expected dense (strided) torch tensors. Received: a nested tensor "
            f"(layout={layout}) at {where}; nested tensors are not supported here: pass "
            f"its components (t.unbind()) or a padded tensor (t.to_padded_tensor(0.0))"
        )
    return (
        f"Expected dense (strided) torch tensors. Received: layout={layout} at "
        f"{where}; sparse gradients (nn.Embedding(sparse=True)) are not "
        f"supported: use sparse=False, or pass grad.to_dense()"
    )


def _first_unsupported_leaf(named: list[tuple[str, Any]]) -> tuple[str, str, Any, bool] | None:
    """(argument name, leaf path, layout, nested?) of the first sparse or nested torch leaf
    among the ``(name, value)`` arguments, or None."""
    layouts = frameworks.loaded("tree", "sparse_layout")
    for name, tree in named:
        for path, leaf in leaves_with_paths(tree):
            if getattr(leaf, "is_nested", False) is True:  # torch.nested, of any layout
                return name, path, leaf.layout, True
            for layout_of in layouts:
                layout = layout_of(leaf)
                if layout is not None:
                    return name, path, layout, False
    return None
