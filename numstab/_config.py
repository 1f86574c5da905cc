"""Which backend a call uses, and where that choice came from.

Precedence, highest first:
  1. the ``backend=`` keyword of a call;
  2. the innermost ``use_backend(name)`` context (a ContextVar: per thread and per asyncio task);
  3. ``set_backend(name)``;
  4. the ``NUMSTAB_BACKEND`` environment variable;
  5. the config file ``$NUMSTAB_CONFIG``, else ``~/.config/numstab/config.toml``, key ``backend``;
  6. ``"auto"``: detect the framework from the array arguments.

Any level may say ``"auto"``, which defers to detection. numstab only reads the config file;
it never writes anything to the user's home.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import NamedTuple

from numstab._env import EnvVar
from numstab.backends import canonical_name
from numstab.errors import InvalidArgumentError, UnknownBackendError

AUTO = "auto"
ENV_VAR = "NUMSTAB_BACKEND"
CONFIG_ENV_VAR = "NUMSTAB_CONFIG"
DEFAULT_CONFIG = "~/.config/numstab/config.toml"

_context_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "numstab_backend", default=None
)
_global_backend: str | None = None
_config_values: dict[str, str | None] = {}  # config file path -> its backend key


class BackendChoice(NamedTuple):
    """A selected backend name (or "auto") and the source that selected it."""

    name: str
    source: str


def normalised_backend(name: str | None) -> str | None:
    """A user-given backend name made canonical (``"auto"`` kept, None passed through), or
    ``UnknownBackendError`` for one that names no backend."""
    if name is None:
        return None
    if str(name).strip().lower() == AUTO:
        return AUTO
    return canonical_name(name)


def set_backend(name: str | None) -> None:
    """Select the backend for the whole process.

    ``"auto"`` forces detection from the arrays (over NUMSTAB_BACKEND and the config file);
    ``None`` clears the selection, so the environment variable and config file apply again.
    """
    global _global_backend
    _global_backend = normalised_backend(name)


class use_backend(contextlib.ContextDecorator):  # lower case: a function before
    """Select a backend inside a ``with`` block (safe across threads and asyncio tasks).

    The object is reusable and re-entrant, as ``torch.no_grad()``: each ``with`` pushes its
    own token and restores what was selected before (a generator context manager raised a
    raw AttributeError on its second ``with``). The name is checked at ``__enter__``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> str:
        self._tokens.append(_context_backend.set(normalised_backend(self.name)))
        return _context_backend.get()

    def __exit__(self, *exc: object) -> None:
        _context_backend.reset(self._tokens.pop())


_DEFAULT_CONFIG_PATH = os.path.expanduser(DEFAULT_CONFIG)
_BACKEND_ENV, _CONFIG_ENV = EnvVar(ENV_VAR), EnvVar(CONFIG_ENV_VAR)  # read on every call


def _config_path() -> str:
    return _CONFIG_ENV.get() or _DEFAULT_CONFIG_PATH


def _config_file_backend(path: str) -> str | None:
    """The ``backend`` key of a TOML config file, read once per path (None if absent)."""
    if path not in _config_values:
        _config_values[path] = _read_config_file(path)
    return _config_values[path]


def _read_config_file(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    import tomllib  # only when there is a file to read

    try:
        with open(path, "rb") as fh:
            value = tomllib.load(fh).get("backend")
    except FileNotFoundError:
        return None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgumentError(f"Cannot read numstab config file {path}: {exc}") from exc
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentError(
            f"Expected a string for 'backend' in {path}. Received: backend={value!r}"
        )
    return value


def configured_backend(explicit: str | None = None) -> str:
    """The name ``backend_choice`` selects: a string, so compilers can treat it as constant."""
    return backend_choice(explicit).name


# The configured backend cannot change inside a compiled region, and torch.compile cannot
# trace a ContextVar lookup: let it evaluate this once per trace, as a constant. This is
# exactly what torch.compiler.assume_constant_result does, without importing torch._dynamo.
configured_backend._dynamo_marked_constant = True  # type: ignore[attr-defined]


def backend_choice(explicit: str | None = None) -> BackendChoice:
    """Resolve the configured backend name by the precedence above (without detection)."""
    if explicit is not None:
        return BackendChoice(normalised_backend(explicit), "backend= argument")
    name = _context_backend.get()
    if name is not None:
        return BackendChoice(name, "use_backend() context")
    if _global_backend is not None:
        return BackendChoice(_global_backend, "set_backend()")
    env = _BACKEND_ENV.get()
    if env:
        return _choice_from(env, f"{ENV_VAR} environment variable")
    path = _config_path()
    value = _config_file_backend(path)
    if value:
        return _choice_from(value, f"config file {path}")
    return BackendChoice(AUTO, "default")


def _choice_from(value: str, source: str) -> BackendChoice:
    """A name from the environment or a file: an unknown one says where it was read."""
    try:
        return BackendChoice(normalised_backend(value), source)
    except UnknownBackendError as exc:
        raise UnknownBackendError(f"{exc} It was read from the {source}.") from None


# Read the config file now rather than inside the first (possibly traced) call.
with contextlib.suppress(InvalidArgumentError):
    _config_file_backend(_config_path())
