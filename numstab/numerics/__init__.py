"""``check_numerics``: one switch that raises ``NonFiniteError`` where NaN or inf appear.

Two modes (``docs/semantics.md §14`` is the contract):

- ``"op"`` (default): every op output is checked as it is produced, through the framework's
  own machinery (torch anomaly mode plus a dispatch mode, TensorFlow
  ``enable_check_numerics``, JAX ``jax_debug_nans`` / ``jax_debug_infs``, NumPy ``errstate``),
  and the first bad op raises. A debugging mode: slow.
- ``"sentinel"``: cheap enough to leave on. Finiteness summaries of layer outputs and
  gradients (torch modules, automatically) and of whatever is passed to ``watch`` are kept on
  the device and read once, at ``check()`` or when the context exits.

Used as ``with check_numerics(): ...`` or as a decorator. On exit every global switch is back
to exactly what it was, whether the block ended normally or raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

from numstab._config import AUTO, configured_backend, normalised_backend
from numstab._dispatch import HOST, check_numeric_host, detect, framework_of
from numstab._validate import check_bool, check_choice
from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError, NonFiniteError, NumstabError
from numstab.frameworks import FRAMEWORKS, loaded
from numstab.numerics._ops import original_exception
from numstab.numerics._recorder import Recorder
from numstab.numerics._recorder import arm_module as _arm_module
from numstab.numerics.summary import FiniteSummary, finite_summary

__all__ = ["MODES", "CheckNumerics", "FiniteSummary", "check_numerics", "finite_summary"]

#: "op": check every op as it runs (native switches); "sentinel": cheap device-side summaries
MODES = ("op", "sentinel")


@dataclasses.dataclass(frozen=True)
class Settings:
    nan: bool
    inf: bool
    backward: bool
    mode: str

    def bad(self, has_nan: bool, has_inf: bool) -> bool:
        return (self.nan and has_nan) or (self.inf and has_inf)

    def wanted(self) -> str:
        return " or ".join(n for n, on in (("NaN", self.nan), ("inf", self.inf)) if on)


def _frameworks_for(backend: str | None) -> tuple[str, ...]:
    """The frameworks a context arms: the configured backend, or under "auto" every
    deep-learning framework already imported, plus NumPy."""
    name = configured_backend(backend)
    if name != AUTO:
        load_backend(name)  # BackendUnavailableError when it cannot be imported
        return (name,)
    found = [fw.name for fw in FRAMEWORKS.values() if fw.name != "numpy" and fw.imported()]
    return (*found, "numpy")


class CheckNumerics(contextlib.ContextDecorator):
    """The object ``check_numerics`` returns: a context manager and a decorator.

    Inside the ``with`` block, ``watch(tree, name)`` adds values to the sentinel and
    ``check()`` is an explicit check point.
    """

    def __init__(self, settings: Settings, backend: str | None, sync_ranks: Any = None) -> None:
        self.settings, self.backend, self.sync_ranks = settings, backend, sync_ranks
        self._arms: list[Any] = []
        self._recorder: Recorder | None = None
        self._agree: Any = None
        self._active = False

    def _recreate_cm(self) -> CheckNumerics:  # each decorated call gets a fresh context
        return CheckNumerics(self.settings, self.backend, self.sync_ranks)

    def __enter__(self) -> CheckNumerics:
        if self._active:
            raise NumstabError("This check_numerics context is already active; create a new one.")
        frameworks = _frameworks_for(self.backend)
        self._recorder = Recorder(self.settings)
        self._arms = []
        try:
            for framework in frameworks:
                arm = _arm_module(framework).Arm(self.settings, self._recorder)
                arm.enter()
                self._arms.append(arm)
        except BaseException:
            self._restore()
            raise
        # data-parallel ranks read their records together and raise alike (§14.6)
        agree = [arm.agree for arm in self._arms if hasattr(arm, "agree")]
        if agree and self.settings.mode == "sentinel" and self.sync_ranks is not False:
            self._agree = functools.partial(agree[0], auto=self.sync_ranks is None)
        self._active = True
        return self

    def _restore(self) -> None:
        errors = []
        for arm in reversed(self._arms):
            try:
                arm.exit()
            except Exception as exc:  # restore the others before reporting
                errors.append(exc)
        self._arms = []
        if errors:
            raise errors[0]

    def __exit__(self, exc_type, exc, tb) -> bool:
        arms = list(self._arms)
        self._active = False
        self._restore()
        if exc is not None:
            original = _original(exc)
            if isinstance(exc, NonFiniteError):
                return False
            for arm in arms:
                converted = arm.convert(original)
                if converted is not None:
                    raise converted from original
            return False
        error = self._recorder.error(self._agree) if self._recorder is not None else None
        if error is not None:
            raise error
        return False

    def watch(self, tree: Any, name: str = "value") -> Any:
        """Record a finiteness summary of every leaf of ``tree`` (no host sync); returns
        ``tree``. Checked at ``check()`` and at exit. Call it on concrete arrays (outside
        jit / tf.function), e.g. on the loss and gradients a compiled step returns. A
        ``FiniteSummary`` (``finite_summary`` inside a jitted step) is recorded as it is."""
        if not self._active:
            raise NumstabError("watch() needs an active check_numerics context.")
        if not isinstance(name, str):
            raise InvalidArgumentError(f"Expected name to be a string. Received: name={name!r}")
        if isinstance(tree, FiniteSummary):
            framework, summary = _reduced(tree, name)
            self._record(name, framework, [(framework, summary)])
            return tree
        leaves = _leaves(tree)
        if leaves:
            self._record(name, *_summaries(leaves, name))
        return tree

    def _record(self, name: str, framework: str, summaries: list[tuple[str, Any]]) -> None:
        key = ("watch", name)
        if self._recorder.has(key):
            slot = self._recorder.slot(key)
        else:  # the caller's line is looked up once per name
            from numstab.numerics import _where

            slot = self._recorder.slot(
                key, name=name, phase=None, framework=framework, where=_where.from_stack()
            )
        for arm_name, summary in summaries:
            self._recorder.add(arm_name, slot, summary)

    def check(self) -> None:
        """Read every summary recorded so far (one host sync) and raise ``NonFiniteError``
        if any held NaN or inf; the record is cleared either way."""
        if self._recorder is None:
            return
        error = self._recorder.error(self._agree)
        self._recorder.clear()
        if error is not None:
            raise error


def _original(exc: BaseException) -> BaseException:
    """The exception to report when ``exc`` leaves a context: the one a wrapper re-created
    (Keras's layer call raises ``e.__class__(message)`` from None, ``_ops.original_exception``)
    with ``exc``'s whole traceback, so that its message is parsed and its user frame found.
    A re-created ``NonFiniteError`` (every attribute ``None``, the message wrapped in ANSI
    codes) gets the original's attributes and message back in place and propagates as it is
    (its ``__context__`` is the original); anything else is returned as it is."""
    original = original_exception(exc)
    if original is exc:
        return exc
    original.__traceback__ = exc.__traceback__  # the outer frames too (the user's line)
    if isinstance(exc, NonFiniteError) and isinstance(original, NonFiniteError):
        exc.__dict__.update(original.__dict__)
        exc.args = original.args
    return original


def _leaves(tree: Any) -> list:
    """The non-``None`` leaves of ``tree`` (§6), Keras variables as their backend tensors."""
    from numstab.tree import flatten

    leaves = [x for x in flatten(tree)[0] if x is not None]
    for unwrap in loaded("tree", "unwrap"):
        leaves = [unwrap(x) for x in leaves]
    return leaves


def _summaries(leaves: list, name: str) -> tuple[str, list[tuple[str, Any]]]:
    """(the tree's framework, [(arm, summary)]) for ``watch``: the framework's arrays are
    summarised by its arm, on its device (no sync); host leaves (NumPy arrays, Python and
    NumPy scalars) by the NumPy arm, at once and exactly, whatever the framework (as
    ``find_nonfinite`` does, host data that is not numbers raises ``InvalidArgumentError``).
    Everything is checked before anything is recorded."""
    framework = detect(*leaves) or "numpy"  # MixedBackendsError for two frameworks
    host, device = [], []
    for x in leaves:  # one pass: each leaf is a host or a device leaf
        (host if framework_of(x) == HOST else device).append(x)
    for x in host:
        check_numeric_host(x, "tree leaves")
    if device and any(load_backend(framework).is_tracing(x) for x in device):
        raise _traced_error(name, device[0])
    out = []
    if device:
        arm = _arm_module(framework)
        with arm.quiet():  # mode="op": watch's own reductions are not the user's ops
            out.append((framework, arm.summarize(device)))
    if host:
        out.append(("numpy", _arm_module("numpy").summarize(host)))
    return framework, out


def _traced_error(name: str, leaf: Any) -> InvalidArgumentError:
    return InvalidArgumentError(
        "Expected concrete arrays in watch(), not values traced by jit / tf.function / "
        f"torch.compile. Received: {name}={type(leaf).__name__}. Watch what the compiled "
        "function returns; with JAX, return finite_summary(tree) from the jitted function and "
        "watch that."
    )


def _reduced(summary: FiniteSummary, name: str) -> tuple[str, Any]:
    """(framework, summary to record) for a FiniteSummary: a JAX array is recorded as it is;
    host sums (after ``jax.device_get``) are checked at once, as any NumPy value."""
    sums = summary.sums
    framework = detect(sums) if sums is not None else None
    kind = getattr(getattr(sums, "dtype", None), "kind", None)
    if framework not in (None, "jax") or kind not in ("f", "c") or getattr(sums, "ndim", 0) != 1:
        raise InvalidArgumentError(
            "Expected FiniteSummary.sums to be a 1-D floating JAX or NumPy array made by "
            f"finite_summary(). Received: {name}.sums={sums!r}"
        )
    if framework is None:  # fetched to the host already: checked at once, as NumPy values
        return "numpy", _arm_module("numpy").summarize([sums])
    if load_backend(framework).is_tracing(sums):
        raise _traced_error(name, sums)
    return framework, sums


def check_numerics(
    *,
    nan: bool = True,
    inf: bool = True,
    backward: bool = True,
    mode: str = "op",
    backend: str | None = None,
    sync_ranks: bool | None = None,
) -> CheckNumerics:
    """Raise ``NonFiniteError`` where NaN (``nan=True``) or inf (``inf=True``) appear, in the
    forward pass and, with ``backward=True``, in gradients.

    ``backend=None`` follows the configured backend (``use_backend``, ``set_backend``, ...);
    under ``"auto"`` it arms every deep-learning framework already imported, plus NumPy.
    ``mode="op"`` checks every op; ``mode="sentinel"`` keeps per-layer summaries on the
    device and reads them at ``check()`` / exit; ``sync_ranks``: with ``torch.distributed``
    initialised (world > 1) its ``check()`` and exit agree across the ranks (a collective
    every rank must reach): True always, None where a DDP/FSDP module ran, False never.
    """
    settings = Settings(
        nan=check_bool("nan", nan),
        inf=check_bool("inf", inf),
        backward=check_bool("backward", backward),
        mode=_check_mode(mode),
    )
    return CheckNumerics(
        settings,
        normalised_backend(backend),
        None if sync_ranks is None else check_bool("sync_ranks", sync_ranks),
    )


def _check_mode(mode: Any) -> str:
    if not isinstance(mode, str):
        raise InvalidArgumentError(
            "Expected mode to be one of "
            + ", ".join(repr(m) for m in MODES)
            + f". Received: mode={mode!r}"
        )
    check_choice("mode", mode, MODES)
    return mode
