"""The optax guard's snapshot files: its payload (params, opt_state and extra) as NumPy
leaves, and back into the structure of the trees it restores into.

Typed PRNG keys (``jax.random.key``: NNX's ``RngKey`` state, a key kept in ``extra``) are
written as their key data (uint32; NumPy has no key dtype) and read back as keys of the
current leaf's implementation: before, the file writer refused them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from numstab.guard.runner import check_fits, check_payload


def to_host(names: tuple[str, ...], payload: tuple[Any, ...]) -> dict[str, Any]:
    """``{name: leaves}`` for each tree of ``payload``, in one transfer."""
    trees = zip(names, jax.device_get(jax.tree.map(_raw, payload)), strict=False)
    return {name: jax.tree.leaves(tree) for name, tree in trees}


def from_host(file: dict[str, Any], names: tuple[str, ...], current: tuple[Any, ...]) -> list:
    """The saved leaves of each of ``names`` in the structure of the ``current`` trees, after
    checking their number and shapes (``check_fits``: before, JAX's "Too many leaves for
    PyTreeDef", or other shapes loaded silently)."""
    check_payload(file, names, "optax", exact=True)  # extra= in the file iff in the guard
    out = []
    for name, tree in zip(names, current, strict=False):
        paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths_named = [name + jax.tree_util.keystr(path) for path, _ in paths]
        saved = list(file[name])
        check_fits(
            name,
            [
                (paths_named[i] if i < len(paths_named) else f"{name} leaf {i}", x)
                for i, x in enumerate(saved)
            ],
            [(n, jnp.shape(_raw(x))) for n, (_, x) in zip(paths_named, paths, strict=True)],
        )
        leaves = [_like(s, x) for s, (_, x) in zip(saved, paths, strict=True)]
        out.append(jax.tree.unflatten(treedef, leaves))
    return out


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", float), jax.dtypes.prng_key)


def _raw(x: Any) -> Any:
    """A typed PRNG key array as its key data, else ``x``."""
    return jax.random.key_data(x) if _is_key(x) else x


def _like(saved: Any, current: Any) -> jax.Array:
    """A leaf read from a file as the kind of ``current``: a key of its implementation."""
    if _is_key(current):
        return jax.random.wrap_key_data(jnp.asarray(saved), impl=jax.random.key_impl(current))
    return jnp.asarray(saved)
