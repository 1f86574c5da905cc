"""What a case sees: arrays of the backend under test, and the expected outcomes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from numstab import errors

#: the framework whose arrays a "mixed frameworks" case adds, per backend under test
OTHER_FRAMEWORK = {"numpy": "torch", "torch": "jax", "jax": "torch", "tensorflow": "torch"}


class Ctx:
    """Arrays of one backend: ``a(values, dtype)``; ``other(values)``: another framework's."""

    def __init__(self, backend: str) -> None:
        from numstab.backends import load_backend

        self.name = backend
        self.be = load_backend(backend)

    def a(self, values: Any, dtype: str | None = None) -> Any:
        x = np.asarray(values)
        if dtype is not None:
            x = x.astype(dtype)
        elif x.dtype == np.float64:
            x = x.astype(np.float32)
        if x.dtype == np.int64 and self.name == "jax":
            x = x.astype(np.int32)  # JAX without x64
        return self.be.asarray(x)

    def float8(self, values: Any) -> Any:
        """A float8_e4m3fn array of the backend (rounded from float32)."""
        return self.be.cast(self.a(np.asarray(values, np.float32)), "float8_e4m3fn")

    def other(self, values: Any) -> Any:
        from numstab.backends import load_backend

        name = OTHER_FRAMEWORK[self.name]
        if self.name == "numpy":  # NumPy arrays are host data: mix two frameworks instead
            return load_backend("jax").asarray(np.asarray(values, np.float32))
        return load_backend(name).asarray(np.asarray(values, np.float32))

    def other_first(self, values: Any) -> Any:
        """For the NumPy backend the first array of a mixed call must be a framework's."""
        if self.name == "numpy":
            from numstab.backends import load_backend

            return load_backend("torch").asarray(np.asarray(values, np.float32))
        return self.a(values)

    def np(self, x: Any) -> np.ndarray:
        return np.asarray(self.be.to_numpy(x), dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class Raises:
    """A ``NumstabError`` subclass whose message names ``argument``."""

    error: type
    argument: str


@dataclasses.dataclass(frozen=True)
class Valid:
    """A documented valid result; ``check(result, ctx)`` says whether it is the right one."""

    check: Callable[[Any, Ctx], bool]
    rule: str


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Ctx], Any]
    expect: Raises | Valid


def bad(argument: str, error: type = errors.InvalidArgumentError) -> Raises:
    return Raises(error, argument)


class StateChanged(AssertionError):
    """A stateful object changed although the call was rejected."""


def unchanged(state: Callable[[], Any], call: Callable[[], Any]) -> Any:
    """Run ``call``; if it raises a NumstabError, ``state()`` must be what it was before."""
    before = _plain(state())
    try:
        return call()
    except errors.NumstabError:
        after = _plain(state())
        if not _same(before, after):
            raise StateChanged(f"state changed by a rejected call: {before} -> {after}") from None
        raise


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "_asdict"):
        return _plain(x._asdict())
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        x = x.numpy()
    if hasattr(x, "shape") or isinstance(x, (int, float, np.number, bool)):
        return np.array(np.asarray(x), copy=True)
    return x


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=True)
    return a == b
