"""Backends by name: each framework's ``backend`` module (``numstab/frameworks/<name>/``,
found through the one registry, ``numstab.frameworks``), whose framework is imported only
when that backend is first used."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import TYPE_CHECKING

from numstab import frameworks
from numstab.backends._on_import import load_after_import
from numstab.errors import BackendUnavailableError, UnknownBackendError
from numstab.frameworks import FRAMEWORKS

if TYPE_CHECKING:
    from numstab.backends._base import Backend

ALIASES = {alias: f.name for f in FRAMEWORKS.values() for alias in f.aliases}
BACKEND_NAMES = tuple(FRAMEWORKS)

_loaded: dict[str, Backend] = {}


def canonical_name(name: str) -> str:
    """Normalise a user-given backend name (case, aliases) or raise UnknownBackendError."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in FRAMEWORKS:
        valid = ", ".join(repr(n) for n in (*BACKEND_NAMES, "auto"))
        aliases = ", ".join(repr(a) for a in ALIASES)
        raise UnknownBackendError(
            f"Unknown backend {name!r}. Valid names: {valid} (aliases: {aliases})."
        )
    return key


def load_backend(name: str) -> Backend:
    """Return the backend object for a canonical name, importing its framework on first use."""
    backend = _loaded.get(name)
    if backend is not None:
        return backend
    framework = FRAMEWORKS[name]
    try:
        module = frameworks.module(framework.name, "backend")  # the folder the entry names
    except (ImportError, OSError) as exc:  # OSError: a broken install (a missing CUDA library)
        hint = (
            f" Install it with: pip install 'numstab[{framework.extra}]'" if framework.extra else ""
        )
        raise BackendUnavailableError(
            f"numstab backend {name!r} needs {' and '.join(framework.distributions)}, which "
            f"could not be imported ({exc}).{hint}"
        ) from exc
    if frameworks.has_module(framework.name, "tree"):  # its tree hooks, imported with it:
        frameworks.module(framework.name, "tree")  # a torch.compile trace cannot import them
    backend = module.BACKEND
    _loaded[name] = backend
    return backend


def preload_imported_frameworks() -> None:
    """Load the backends of frameworks the user has already imported.

    Cheap (their framework is in memory) and it keeps the import out of the first numstab
    call, which may be traced by torch.compile(fullgraph=True), where imports cannot run, or
    by tf.function, whose AutoGraph warns that it cannot convert the import. For the same
    reason torch's and TensorFlow's backends load right after ``import torch`` / ``import
    tensorflow`` when that comes later (``_on_import``).
    """
    for name, framework in FRAMEWORKS.items():
        if name != "numpy" and all(sys.modules.get(d) is not None for d in framework.distributions):
            _preload(name)
    # torch or TensorFlow imported later: its backend loads right after it (torch.compile
    # cannot trace an import; AutoGraph warns that it cannot convert importlib's _gcd_import)
    for name in ("torch", "tensorflow"):
        load_after_import(name, functools.partial(_preload, name))


def _preload(name: str) -> None:
    """Load backend ``name`` if its framework can be imported (else at first use, raising)."""
    with contextlib.suppress(BackendUnavailableError):
        load_backend(name)


def available_backends() -> dict[str, str]:
    """Backends whose frameworks are installed, mapped to the framework's version.

    Looks at installed distributions only: nothing is imported.
    """
    import importlib.util

    found = {}
    for name, framework in FRAMEWORKS.items():
        dists = framework.distributions
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
