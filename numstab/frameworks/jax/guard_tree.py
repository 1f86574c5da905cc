"""The optax guard's walks over the user's trees: ``select`` (and its check of NNX
``Variable`` objects shared by both sides), the update applied where a gradient is None, and
the leaves whose norms the guard records, with their names."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp

from numstab import _validate as v
from numstab.errors import InvalidArgumentError


def select(decision: Any, new: Any, old: Any) -> Any:
    """``new`` where the step is applied, ``old`` where it is skipped, leaf by leaf (traced):
    state that the forward pass writes (BatchNorm statistics) keeps its old value when the
    guard skips the step (before, a skipped NaN batch still wrote NaN statistics).

    Flax NNX: ``nnx.state(model, nnx.BatchStat)`` holds the model's live ``Variable``
    objects, which the forward pass overwrites, so a copy taken that way before the pass
    already holds the new values: ``InvalidArgumentError`` when ``new`` and ``old`` hold the
    same ``Variable`` (before, the select chose between equal trees and kept the NaN
    statistics). Take ``old`` as ``nnx.as_pure(nnx.state(...))``; a ``Variable`` on one side
    and its pure value on the other is taken too (the result keeps ``new``'s form)."""
    variable = _nnx_variable()
    if variable is None:  # flax not imported: no Variable can be in the trees
        return jax.tree.map(lambda n, o: where(decision.apply, n, o), new, old)

    def pick(path: Any, n: Any, o: Any) -> Any:
        if isinstance(n, variable) and n is o:
            raise InvalidArgumentError(
                "Expected new and old to be different states: old taken before the forward "
                "pass as a pure tree of arrays, stats = nnx.as_pure(nnx.state(model, "
                "nnx.BatchStat)); nnx.state alone holds the model's live Variables, which "
                "the forward pass overwrites. Received: new and old holding the same "
                f"nnx.Variable at {jax.tree_util.keystr(path)}"
            )
        value = where(decision.apply, _value(n, variable), _value(o, variable))
        return n.replace(value=value) if isinstance(n, variable) else value

    return jax.tree_util.tree_map_with_path(
        pick, new, old, is_leaf=lambda x: isinstance(x, variable)
    )


def _nnx_variable() -> type | None:
    """``flax.nnx.Variable`` when flax is already imported (never imports it)."""
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)


def _value(x: Any, variable: type) -> Any:
    if not isinstance(x, variable):
        return x
    return x.get_value() if hasattr(x, "get_value") else x.value  # flax < 0.11: .value


def where(apply: jax.Array, new: Any, old: Any) -> Any:
    """``jnp.where(apply, new, old)`` in ``new``'s dtype."""
    return jnp.where(apply, new, old).astype(jnp.result_type(new))


def apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``, where a None update leaves its params leaf (or subtree) as it
    is, as ``eqx.apply_updates`` does: Equinox's ``filter_grad`` gives None for an integer
    array the model holds, and optax passes None through (before: ``TypeError: unsupported
    operand type(s) for +: 'ArrayImpl' and 'NoneType'``). ``p + u`` in ``p``'s dtype."""

    def apply(u: Any, p: Any) -> Any:
        if u is None:
            return p
        return jax.tree.map(lambda p, u: jnp.asarray(p + u).astype(jnp.result_type(p)), p, u)

    return jax.tree.map(apply, updates, params, is_leaf=lambda x: x is None)


def is_floating(x: Any) -> bool:
    """Whether a leaf can have a gradient: a floating or complex dtype."""
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def layer_names(params: Any) -> list[str]:
    """The names of the per-leaf gradient norms: the paths of ``params``' floating and
    complex leaves (an integer leaf has no gradient: None from Equinox's ``filter_grad``,
    where before its name took the next leaf's norm)."""
    return [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if is_floating(x)
    ]


def gradient_leaves(grads: Any, params: Any) -> list[Any]:
    """The gradient leaves in the order of ``layer_names(params)``: a None gradient where
    ``params`` (when given) holds floating leaves stands for each as an empty array (norm 0).
    ``InvalidArgumentError`` for a leaf that is not floating or complex."""

    def fill(g: Any, p: Any) -> Any:
        if g is not None:
            return g
        return jax.tree.map(
            lambda x: jnp.zeros((0,), jnp.result_type(x)) if is_floating(x) else None, p
        )

    if params is not None:
        grads = jax.tree.map(fill, grads, params, is_leaf=lambda x: x is None)
    leaves = jax.tree.leaves(grads)
    for i, leaf in enumerate(leaves):
        dtype = getattr(leaf, "dtype", None)
        name = dtype.name if dtype is not None else type(leaf).__name__
        if not (v.is_floating(name) or v.is_complex(name)):  # complex: |z|
            raise InvalidArgumentError(
                f"Expected floating-point gradients ({v.FLOAT_DTYPES} or complex). Received: "
                f"leaf {i} with dtype={name}"
            )
    return leaves


def check_norms_named(count: int | None, names: list[str]) -> None:
    """``InvalidArgumentError`` unless the decision's per-layer norms (``count``; None when
    not tracked) are one per name: before, a None gradient at a floating leaf (a frozen part)
    shifted every later norm under the previous leaf's name in the history."""
    if count is not None and count != len(names):
        raise InvalidArgumentError(
            f"Expected one gradient per floating leaf of the params given to init ({len(names)}"
            f": {_short(names)}). Received: grads with {count} floating leaves; where a "
            "gradient is None at floating leaves, pass params to og.check(..., params=params) "
            "(og.step does): each then counts as norm 0"
        )


def _short(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
