"""The backend registry: names map to module paths; a backend's framework is imported only
when that backend is first used."""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import TYPE_CHECKING

from numstab.errors import BackendUnavailableError, UnknownBackendError

if TYPE_CHECKING:
    from numstab.backends._base import Backend

#: backend name -> (module implementing it, distributions it needs, pip extra)
REGISTRY: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "numpy": ("numstab.backends.numpy", ("numpy",), None),
    "torch": ("numstab.backends.torch", ("torch",), "torch"),
    "tensorflow": ("numstab.backends.tensorflow", ("tensorflow",), "tensorflow"),
    "jax": ("numstab.backends.jax", ("jax", "optax"), "jax"),
}
ALIASES = {"tf": "tensorflow", "pytorch": "torch", "np": "numpy"}
BACKEND_NAMES = tuple(REGISTRY)

_loaded: dict[str, Backend] = {}


def canonical_name(name: str) -> str:
    """Normalise a user-given backend name (case, aliases) or raise UnknownBackendError."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in REGISTRY:
        valid = ", ".join(repr(n) for n in (*BACKEND_NAMES, "auto"))
        raise UnknownBackendError(
            f"Unknown backend {name!r}. Valid names: {valid} (aliases: 'tf', 'pytorch', 'np')."
        )
    return key


def load_backend(name: str) -> Backend:
    """Return the backend object for a canonical name, importing its framework on first use."""
    backend = _loaded.get(name)
    if backend is not None:
        return backend
    module_name, dists, extra = REGISTRY[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" Install it with: pip install 'numstab[{extra}]'" if extra else ""
        raise BackendUnavailableError(
            f"numstab backend {name!r} needs {' and '.join(dists)}, which could not be "
            f"imported ({exc}).{hint}"
        ) from exc
    backend = module.BACKEND
    _loaded[name] = backend
    return backend


def preload_imported_frameworks() -> None:
    """Load the backends of frameworks the user has already imported.

    Cheap (their framework is in memory) and it keeps the import out of the first numstab
    call, which may be traced by torch.compile(fullgraph=True), where imports cannot run.
    """
    for name, (_, dists, _) in REGISTRY.items():
        if name != "numpy" and all(d in sys.modules for d in dists):
            with contextlib.suppress(BackendUnavailableError):
                load_backend(name)


def available_backends() -> dict[str, str]:
    """Backends whose frameworks are installed, mapped to the framework's version.

    Looks at installed distributions only: nothing is imported.
    """
    import importlib.util

    found = {}
    for name, (_, dists, _) in REGISTRY.items():
        if all(importlib.util.find_spec(d) is not None for d in dists):
            found[name] = _version(dists[0])
    return found


def _version(module: str) -> str:
    import importlib.metadata  # ~30 ms: only when versions are asked for

    for dist in (module, f"{module}-cpu"):  # tensorflow may be installed as tensorflow-cpu
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
