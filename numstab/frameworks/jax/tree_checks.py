"""Checks of the pytrees a JAX user hands numstab: leaves ``jax.jit`` takes, gradients shaped
as their parameters, an optimizer state made by the optimizer's own ``init``. Shared by the
optax transformations, the optax guard and ``locate_nonfinite``; each raises
``InvalidArgumentError`` naming the argument where JAX or optax raised their own errors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from numstab.errors import InvalidArgumentError
from numstab.frameworks.jax.sharding import typeof


def is_jax_value(x: Any) -> bool:
    """Whether ``jax.jit`` takes ``x`` as an argument leaf: a JAX array (a tracer too), a
    NumPy array or scalar of a numeric dtype, a Python number (JAX's own rule, ``jax.typeof``).
    Not a string, an object array, a torch tensor, nor an object that merely has a ``dtype``
    attribute (a linen Module's field). None is no leaf: pytree walks skip it."""
    try:
        typeof(x)
    except TypeError:
        return False
    return True


def check_values(named: Iterable[tuple[str, Any]], expected: str = "a pytree of arrays") -> None:
    """``InvalidArgumentError`` naming the tree (``name``) and the leaf's path unless every
    leaf of each ``(name, tree)`` is ``is_jax_value``."""
    for name, tree in named:
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if not is_jax_value(leaf):
                raise InvalidArgumentError(
                    f"Expected {name} to be {expected}. Received: a leaf of type "
                    f"{type(leaf).__name__} at {name}{jax.tree_util.keystr(path)}"
                )


def check_matches(grads: Any, params: Any) -> None:
    """InvalidArgumentError unless grads and params (when given) have one structure and shapes.
    A None gradient matches any params subtree: Equinox's ``filter_grad`` gives None where
    the model holds no array (an activation function), and the model itself is passed as
    params, as optax's own transformations accept.

    Integer or other non-floating gradients are rejected by ``LossScaler.unscale``.
    """
    if params is None:
        return

    def check(path: Any, g: Any, p: Any) -> None:
        if g is not None and jnp.shape(g) != jnp.shape(p):
            raise InvalidArgumentError(
                f"Expected gradient shapes equal to param shapes. Received: at "
                f"{jax.tree_util.keystr(path)} grad shape {jnp.shape(g)}, param shape "
                f"{jnp.shape(p)}"
            )

    try:
        jax.tree_util.tree_map_with_path(check, grads, params, is_leaf=lambda x: x is None)
    except InvalidArgumentError:
        raise
    except (ValueError, TypeError) as error:  # JAX's structure mismatch
        raise InvalidArgumentError(
            f"Expected gradients with the structure of params. Received: grads "
            f"{jax.tree.structure(grads)}, params {jax.tree.structure(params)}"
        ) from error


def check_state_made_by(
    init: Callable[[Any], Any], params: Any, state: Any, name: str, error: Exception
) -> None:
    """Why an optimizer's ``update`` raised ``error``, when the reason is the state passed:
    ``InvalidArgumentError`` naming ``name`` if ``state`` is not what ``init(params)`` makes
    (another optimizer's state, one made for other parameters, an ``nnx.Optimizer``: optax
    raised an AttributeError or a shape error from inside the update), compared as trees of
    shapes and dtypes. Otherwise nothing: the caller re-raises ``error``, the optimizer's."""
    try:
        expected = jax.eval_shape(init, params)
    except Exception:  # an init that needs the real params: nothing to compare with
        return

    def layout(tree: Any) -> tuple:
        leaves, structure = jax.tree.flatten(tree)
        return structure, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]

    try:
        (want, want_leaves), (got, got_leaves) = layout(expected), layout(state)
    except TypeError:  # leaves that are no arrays: not an optax state at all
        want, got, want_leaves, got_leaves = jax.tree.structure(expected), type(state), 0, 1
    if want != got or want_leaves != got_leaves:
        differs = "other shapes or dtypes" if want == got else f"the tree {_short(got)}"
        raise InvalidArgumentError(
            f"Expected {name} to be the state the optimizer's init makes for these "
            f"parameters (not another optimizer's state, one made for other parameters, nor "
            f"an nnx.Optimizer). Received: {name} of type {type(state).__name__} with "
            f"{differs}, where init gives {_short(want)}"
        ) from error


def _short(tree: Any, limit: int = 200) -> str:
    text = str(tree)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checked_update(tx: Any, grads: Any, opt_state: Any, params: Any, /, **extra_args: Any) -> tuple:
    """``tx.update(grads, opt_state, params, **extra_args)`` with ``InvalidArgumentError``
    where optax or JAX raised their own (AttributeError, a pytree structure ValueError): a
    ``tx`` that is no optax transformation, ``grads`` not shaped as ``params``
    (``check_matches``: an NNX module or linen ``variables`` as params), and, when the update
    raises, an ``opt_state`` that ``tx.init(params)`` does not make (``check_state_made_by``);
    the optimizer's other errors pass through. Checked as it is traced: nothing in a compiled
    step. ``extra_args``: optax's extra arguments (``value=`` of ``reduce_on_plateau``, a line
    search's), given to a plain ``GradientTransformation`` through
    ``optax.with_extra_args_support`` (which ignores them, as ``optax.chain`` does); the names
    ``tx.update`` binds itself (``updates``, ``state``, ``params``) are refused."""
    import optax

    taken = sorted(set(extra_args) & {"updates", "state", "params"})
    if taken:
        raise InvalidArgumentError(
            f"Expected extra arguments other than tx.update's own (updates, state, params: "
            f"the guard passes those). Received: extra argument(s) {taken}"
        )

    if not isinstance(tx, optax.GradientTransformation):
        raise InvalidArgumentError(
            f"Expected tx to be an optax.GradientTransformation (optax.adam(1e-3)). "
            f"Received: tx of type {type(tx).__name__}"
        )
    check_matches(grads, params)
    if extra_args:
        tx = optax.with_extra_args_support(tx)
    try:
        return tx.update(grads, opt_state, params, **extra_args)
    except InvalidArgumentError:
        raise
    except Exception as error:
        check_state_made_by(tx.init, params, opt_state, "opt_state", error)
        raise
