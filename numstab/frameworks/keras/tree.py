"""What numstab's tree functions need from Keras 3: a layer's variables as named leaves, and
a variable found inside a tree standing for its backend tensor."""

from __future__ import annotations

from typing import Any

import keras


def named_leaves(tree: Any) -> list[tuple[str, Any]] | None:
    """A layer's or model's variables under their ``.path`` ("dense/kernel"); None for
    anything else."""
    if isinstance(tree, keras.Layer):
        return [(w.path, w.value) for w in tree.weights]
    return None


def wrapper_framework(cls: type) -> str | None:
    """The Keras backend (``keras.backend.backend()``: ``"tensorflow"``, ``"jax"``,
    ``"torch"``, ...) for a Keras 3 variable class, whose ``.value`` is that backend's tensor;
    None for any other class (``numstab._dispatch`` detects and converts by it)."""
    if isinstance(cls, type) and issubclass(cls, keras.Variable):
        return keras.backend.backend()
    return None


def unwrap(leaf: Any) -> Any:
    """A Keras variable's backend tensor; anything else as it is."""
    if isinstance(leaf, keras.Variable):
        return leaf.value
    return leaf
