"""Backends whose framework spells a primitive as NumPy does (``xp.exp(x)``,
``xp.sum(x, axis=..., keepdims=...)``): each such primitive written once, over the
backend's array namespace ``xp`` (``numpy``, ``jax.numpy``, ``torch``); a backend overrides
only what its framework spells differently."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from numstab.backends._base import Array, Backend


def _forwarded(name: str) -> Callable[..., Array]:
    """The primitive ``name`` as ``self.xp.<name>(*args, **kwargs)``."""

    def primitive(self: NamespaceBackend, *args: Any, **kwargs: Any) -> Array:
        return getattr(self.xp, name)(*args, **kwargs)

    primitive.__name__ = primitive.__qualname__ = name
    primitive.__doc__ = getattr(Backend, name).__doc__
    return primitive


class NamespaceBackend(Backend):
    """A :class:`Backend` whose primitives default to ``self.xp.<name>`` (``FORWARDED`` and
    the few below that take keywords or index)."""

    #: the array namespace (a module)
    xp: Any

    def sum(self, x: Array, axis: int | None = None, keepdims: bool = False) -> Array:
        return self.xp.sum(x, axis=axis, keepdims=keepdims)

    def max(self, x: Array, axis: int | None = None, keepdims: bool = False) -> Array:
        return self.xp.max(x, axis=axis, keepdims=keepdims)

    def arange(self, n: int, like: Array | None = None) -> Array:
        return self.xp.arange(n)  # the default device (torch overrides: on ``like``'s)

    def matmul(
        self, a: Array, b: Array, transpose_a: bool = False, transpose_b: bool = False
    ) -> Array:
        return self.xp.matmul(a.T if transpose_a else a, b.T if transpose_b else b)

    def concat(self, arrays: list[Array]) -> Array:
        return self.xp.concatenate(arrays)

    def any(self, x: Array) -> bool:
        return bool(self.xp.any(x))

    def real_view(self, x: Array) -> Array:
        return self.xp.stack([self.xp.real(x), self.xp.imag(x)], axis=-1)

    def take_rows(self, x: Array, index: Array) -> Array:
        return self.xp.take_along_axis(x, index[:, None], axis=-1)[:, 0]

    def gather(self, vector: Array, index: Array) -> Array:
        return vector[index]

    def unflatten_rows(self, rows: Array, like: Array) -> Array:
        return self.xp.reshape(rows, self.xp.shape(like)[:-1])


#: primitives spelled ``xp.<name>(...)`` with NumPy's arguments in every such namespace
FORWARDED = (
    "where", "exp", "log", "isfinite", "abs", "sqrt", "cos", "all", "stack", "maximum", "clip",
    "reshape", "moveaxis",
)  # fmt: skip
for _name in FORWARDED:
    setattr(NamespaceBackend, _name, _forwarded(_name))
abc.update_abstractmethods(NamespaceBackend)
