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
import functools
import inspect
import os
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, TypeVar

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
_F = TypeVar("_F", bound=Callable[..., Any])


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
    raw AttributeError on its second ``with``). The name is checked at ``__enter__``.

    The tokens are kept per context (``_entered``), not on the object, so one object may be
    entered at once by several threads and asyncio tasks, and a decorated function may run in
    several at once. As a decorator it also covers ``async def`` functions, generators and
    async generators: the backend is selected around each step of their body, and the
    caller's own selection applies between steps."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> str:
        name = normalised_backend(self.name)
        token = _context_backend.set(name)
        _entered.set((*_entered.get(), (self, token)))
        return name

    def __exit__(self, *exc: object) -> None:
        stack = _entered.get()
        for i in range(len(stack) - 1, -1, -1):  # the innermost entry of this object
            if stack[i][0] is self:
                with contextlib.suppress(ValueError):  # a token of another context
                    _context_backend.reset(stack[i][1])
                    _entered.set(stack[:i] + stack[i + 1 :])
                    return
                break
        raise RuntimeError(
            f"use_backend({self.name!r}) was exited in a thread or asyncio task that did not "
            "enter it."
        )

    def __call__(self, func: _F) -> _F:
        """Decorate ``func`` so that its body runs under this backend; for coroutine,
        generator and async generator functions, around each step of the body."""
        if inspect.isasyncgenfunction(func):
            wrapper: Callable[..., Any] = _async_generator_wrapper(self, func)
        elif inspect.iscoroutinefunction(func):
            wrapper = _coroutine_wrapper(self, func)
        elif inspect.isgeneratorfunction(func):
            wrapper = _generator_wrapper(self, func)
        else:
            return super().__call__(func)
        return functools.wraps(func)(wrapper)  # type: ignore[return-value]


# (use_backend object, token) for each ``with`` open in this context, innermost last
_entered: contextvars.ContextVar[tuple[tuple[use_backend, contextvars.Token], ...]] = (
    contextvars.ContextVar("numstab_use_backend_entered", default=())
)


class _Scope:
    """The backend selection of one decorated generator or coroutine body, kept apart from its
    caller's across the body's steps: the body starts under the decorated name, and its own
    ``use_backend`` blocks last across its ``yield``/``await`` without leaking to the caller."""

    __slots__ = ("name", "stack")

    def __init__(self, cm: use_backend) -> None:
        """Checks the name: call it when the body starts, before the body is created."""
        self.name: str | None = normalised_backend(cm.name)
        self.stack: tuple[tuple[use_backend, contextvars.Token], ...] = ()

    def run(self, step: Callable[..., Any], *args: Any) -> Any:
        """``step(*args)`` under this body's selection; the caller's is restored after."""
        outer_name, outer_stack = _context_backend.set(self.name), _entered.set(self.stack)
        try:
            return step(*args)
        finally:
            self.name, self.stack = _context_backend.get(), _entered.get()
            _context_backend.reset(outer_name)
            _entered.reset(outer_stack)


def _stepped(scope: _Scope, it: Any) -> Generator[Any, Any, Any]:
    """``yield from it`` with each step (send, throw, close) of ``it``, a generator or an
    awaitable's iterator, run in ``scope``; returns what ``it`` returns."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            out = scope.run(it.send, value) if error is None else scope.run(it.throw, error)
        except StopIteration as stop:
            return stop.value
        try:
            value, error = (yield out), None
        except GeneratorExit:
            scope.run(it.close)
            raise
        except BaseException as exc:  # thrown in by the caller: pass it on
            value, error = None, exc


class _Stepped:
    """An awaitable running another awaitable's steps in ``scope``."""

    __slots__ = ("awaitable", "scope")

    def __init__(self, scope: _Scope, awaitable: Any) -> None:
        self.scope, self.awaitable = scope, awaitable

    def __await__(self) -> Generator[Any, Any, Any]:
        return _stepped(self.scope, self.awaitable.__await__())


def _generator_wrapper(cm: use_backend, func: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        scope = _Scope(cm)
        return (yield from _stepped(scope, func(*args, **kwargs)))

    return wrapper


def _coroutine_wrapper(cm: use_backend, func: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        scope = _Scope(cm)
        return await _Stepped(scope, func(*args, **kwargs))

    return wrapper


def _async_generator_wrapper(cm: use_backend, func: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        scope = _Scope(cm)
        agen = func(*args, **kwargs)
        value: Any = None
        error: BaseException | None = None
        while True:
            step = agen.asend(value) if error is None else agen.athrow(error)
            try:
                out = await _Stepped(scope, step)
            except StopAsyncIteration:
                return
            try:
                value, error = (yield out), None
            except GeneratorExit:
                await _Stepped(scope, agen.aclose())
                raise
            except BaseException as exc:  # thrown in by the caller: pass it on
                value, error = None, exc

    return wrapper


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
    except (OSError, ValueError) as exc:  # ValueError: invalid TOML, or not UTF-8
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
    if env and not env.isspace():  # empty or blank: unset
        return _choice_from(env, f"{ENV_VAR} environment variable")
    path = _config_path()
    value = _config_file_backend(path)
    if value and not value.isspace():
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
