"""Choosing between a backend's fused ``native_<op>`` kernel and the generic ``<op>``:
``NUMSTAB_FORCE_GENERIC=1`` asks for the generic path everywhere (the test suite runs both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from numstab._env import EnvVar

if TYPE_CHECKING:
    from numstab.backends._base import Backend

FORCE_GENERIC_ENV = "NUMSTAB_FORCE_GENERIC"
_FORCE_GENERIC = EnvVar(FORCE_GENERIC_ENV)


def generic_forced() -> bool:
    """True when ``NUMSTAB_FORCE_GENERIC`` asks for the generic composites."""
    return _FORCE_GENERIC.get() not in (None, "", "0")


def native_op(backend: Backend, name: str, allowed: bool | None = None) -> Callable[..., Any]:
    """The backend's fused ``native_<name>`` if it has one and it is allowed, else ``<name>``.
    ``allowed``: ``not generic_forced()`` when the caller already read it (an environment
    read is a lookup, but one clipping call would make four), else None (read here)."""
    if not generic_forced() if allowed is None else allowed:
        native = getattr(backend, "native_" + name, None)
        if native is not None:
            return native
    return getattr(backend, name)


def has_native(backend: Backend, name: str) -> bool:
    """True when ``native_op(backend, name)`` would return the backend's ``native_<name>``."""
    return not generic_forced() and hasattr(backend, "native_" + name)
