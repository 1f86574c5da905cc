"""Eager calls of a traced step as one cached ``jax.jit``."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_DYNAMIC = (jax.Array, np.ndarray, np.generic, numbers.Number)


def eager_jit(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` (a pure function of pytrees), run eagerly as one ``jax.jit`` kept with the
    returned function: eagerly, a ``lax.cond`` in ``body`` traces and compiles its branches
    on every call (its closures are new each time), 100-200 ms per call, where the jit
    compiles once per structure, shapes and dtypes.

    Leaves that are arrays or numbers (not bools) are jit arguments; the others (an Equinox
    model's activation function, passed as params) are static. A traced leaf (an enclosing
    jit, grad, vmap, shard_map) or an unhashable static leaf calls ``body`` as it is, so a
    traced program is the same as without this wrapper."""
    jitted = jax.jit(_rebuilt(body), static_argnums=(0, 1))

    def call(*args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return body(*args)
        mask = tuple(isinstance(x, _DYNAMIC) and not isinstance(x, bool) for x in leaves)
        static = tuple(x for x, dynamic in zip(leaves, mask, strict=True) if not dynamic)
        try:
            hash(static)
        except TypeError:
            return body(*args)
        arrays = [x for x, dynamic in zip(leaves, mask, strict=True) if dynamic]
        return jitted((treedef, mask), static, arrays)

    return call


def _rebuilt(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` called on the arguments rebuilt from (structure, static leaves, arrays)."""

    def run(structure: tuple, static: tuple, arrays: list) -> Any:
        treedef, mask = structure
        static_it, array_it = iter(static), iter(arrays)
        leaves = [next(array_it) if dynamic else next(static_it) for dynamic in mask]
        return body(*jax.tree.unflatten(treedef, leaves))

    return run
