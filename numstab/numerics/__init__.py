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
import threading
from typing import Any

from numstab._config import AUTO, configured_backend, normalised_backend
from numstab._dispatch import HOST, check_numeric_host, detect, framework_of
from numstab._validate import check_bool, check_choice
from numstab.backends import load_backend
from numstab.errors import InvalidArgumentError, NonFiniteError, NumstabError
from numstab.frameworks import FRAMEWORKS, loaded, module
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


def _arm_module(framework: str):
    """The framework's check-numerics code (``numstab/frameworks/<name>/numerics.py``)."""
    return module(framework, "numerics")


#: a maskable record (a parameter gradient) that no loss scaler has settled yet
_FRESH = object()
#: a clean rank's "first offending slot" when ranks agree (slots are small ints)
_NO_SLOT = 2**62


class Recorder:
    """The sentinel's bookkeeping: one slot per (layer or watched name, phase), summaries kept
    on the device until ``read``, which brings them all to the host in one go.

    Summaries are read early, every ``FLUSH_EVERY`` records, to bound memory; that is one host
    sync per ``FLUSH_EVERY`` records, never one per op.

    Loss scaling (§14.6): a ``maskable`` record (a parameter gradient) stays *fresh* until a
    loss scaler ``settle``s its slot with a ``handled`` summary, a device value that reads
    non-finite when the scaler found this step non-finite and skipped it (the overflow was
    handled). A record that reads bad counts unless its ``handled`` reads non-finite; a fresh
    one counts at ``check()`` / exit (no scaler saw it). An early read keeps fresh bad records
    on hold (their flags, one per slot) until they are settled or the final read.
    """

    FLUSH_EVERY = 2048

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._slots: dict[Any, int] = {}
        self.meta: list[dict[str, Any]] = []
        self._pending: dict[str, list] = {}  # (slot, summary) or [slot, summary, mark]
        self._fresh: dict[str, dict[int, list]] = {}  # framework -> slot -> fresh records
        self._held: dict[str, dict[int, list[bool]]] = {}  # read bad while fresh
        self._settled: dict[str, list] = {}  # (slot, flags, handled) of held records
        self._count = 0
        self.bad: dict[int, list[bool]] = {}  # slot -> [has_nan, has_inf] seen so far
        self._lock = threading.Lock()

    def has(self, key: Any) -> bool:
        return key in self._slots

    def slot(self, key: Any, **meta: Any) -> int:
        index = self._slots.get(key)
        if index is None:
            index = self._slots[key] = len(self.meta)
            self.meta.append(meta)
        return index

    def add(self, framework: str, slot: int, summary: Any, maskable: bool = False) -> None:
        if maskable:
            with self._lock:  # hooks may run in threads: the record and its index together
                record = [slot, summary, _FRESH]
                self._pending.setdefault(framework, []).append(record)
                self._fresh.setdefault(framework, {}).setdefault(slot, []).append(record)
        else:
            records = self._pending.get(framework)
            if records is None:
                records = self._pending.setdefault(framework, [])
            records.append((slot, summary))  # atomic under the GIL: hooks may run in threads
        self._count += 1
        if self._count >= self.FLUSH_EVERY:
            self.read(final=False)

    def settle(self, framework: str, slots: Any, handled: Any) -> None:
        """Mark the fresh records of ``slots`` (and those on hold) with ``handled``: a summary
        (as ``add`` takes) that reads non-finite when the loss scaler skipped the step."""
        with self._lock:
            fresh = self._fresh.get(framework, {})
            held = self._held.get(framework, {})
            for slot in slots:
                for record in fresh.pop(slot, ()):
                    record[2] = handled
                flags = held.pop(slot, None)
                if flags is not None:
                    self._settled.setdefault(framework, []).append((slot, flags, handled))

    def read(self, final: bool = True) -> None:
        """Bring every pending summary to the host (one transfer per dtype and framework).
        ``final``: fresh records count as they read (no scaler will settle them now)."""
        with self._lock:
            pending, self._pending, self._count = self._pending, {}, 0
            settled, self._settled, self._fresh = self._settled, {}, {}
        for framework in pending.keys() | settled.keys():
            self._read(framework, pending.get(framework, []), settled.get(framework, []), final)
        if final:
            for held in self._held.values():
                for slot, flags in held.items():
                    self._mark(slot, *flags)
            self._held = {}

    def _read(self, framework: str, records: list, settled: list, final: bool) -> None:
        marks = [r[2] for r in records if len(r) == 3 and r[2] is not _FRESH]
        handled = {id(h): h for h in marks + [h for _, _, h in settled]}
        summaries = [r[1] for r in records] + list(handled.values())
        flags = _arm_module(framework).read_summaries(summaries)
        skipped = {key: any(f) for key, f in zip(handled, flags[len(records) :], strict=True)}
        for record, (has_nan, has_inf) in zip(records, flags[: len(records)], strict=True):
            if not self.settings.bad(has_nan, has_inf):
                continue
            mark = record[2] if len(record) == 3 else None
            if mark is _FRESH and not final:
                held = self._held.setdefault(framework, {}).setdefault(record[0], [False, False])
                held[0] |= has_nan
                held[1] |= has_inf
            elif mark is None or mark is _FRESH or not skipped[id(mark)]:
                self._mark(record[0], has_nan, has_inf)
        for slot, (has_nan, has_inf), mark in settled:
            if not skipped[id(mark)]:
                self._mark(slot, has_nan, has_inf)

    def _mark(self, slot: int, has_nan: bool, has_inf: bool) -> None:
        seen = self.bad.setdefault(slot, [False, False])
        seen[0] |= has_nan
        seen[1] |= has_inf

    def error(self, agree: Any = None) -> NonFiniteError | None:
        """The error for what was read (``None`` if clean). ``agree(value)``: the maximum of
        an int over the data-parallel processes (a collective): the smallest offending slot
        of any rank is agreed on as ``-max(-slot)``, so that every rank raises alike."""
        self.read()
        first = min(self.bad) if self.bad else None
        if agree is not None:
            found = -agree(-(_NO_SLOT if first is None else first))
            first = None if found == _NO_SLOT else found
        if first is None:
            return None
        if not self.bad:
            return self._remote_error(first)
        slots = sorted(self.bad)  # slots are numbered in first-execution order
        first = self.meta[slots[0]]
        for slot in slots:
            name = self.meta[slot].get("resolve")
            if name is not None:
                self.meta[slot]["name"] = name()
        names = tuple(self.meta[s]["name"] for s in slots)
        has_nan, has_inf = self.bad[slots[0]]
        what = " and ".join(n for n, on in (("NaN", has_nan), ("inf", has_inf)) if on)
        phase = first.get("phase")
        listed = ", ".join(
            f"{self.meta[s]['name']} ({self.meta[s].get('phase') or 'watched'})" for s in slots[:8]
        )
        more = f" and {len(slots) - 8} more" if len(slots) > 8 else ""
        return NonFiniteError(
            f"check_numerics(mode={self.settings.mode!r}) found {what} first in {first['name']}"
            + (f" ({phase} pass)" if phase else "")
            + f". Non-finite values were seen in: {listed}{more}. Rerun the step under "
            "check_numerics() (mode='op') to find the op.",
            framework=first["framework"],
            op=first["name"],
            op_kind=None,
            phase=phase,
            where=first.get("where"),
            paths=names,
        )

    def _remote_error(self, slot: int) -> NonFiniteError:
        """Another rank's records held NaN or inf, this one's did not: raise alike, naming
        the slot of that number here (ranks running one model number their slots alike)."""
        meta = self.meta[slot] if slot < len(self.meta) else {}
        name = meta["resolve"]() if "resolve" in meta else meta.get("name", f"record {slot}")
        phase = meta.get("phase")
        return NonFiniteError(
            f"check_numerics(mode={self.settings.mode!r}): another rank found NaN or inf, "
            f"first in {name}" + (f" ({phase} pass)" if phase else "") + "; this rank's "
            "records were finite. Rerun the step under check_numerics() (mode='op') on that "
            "rank to find the op.",
            framework=meta.get("framework"),
            op=name,
            phase=phase,
            where=meta.get("where"),
            paths=(name,),
        )

    def clear(self) -> None:
        with self._lock:
            self._pending, self._fresh, self._settled, self._count = {}, {}, {}, 0
        self._held, self.bad = {}, {}


class CheckNumerics(contextlib.ContextDecorator):
    """The object ``check_numerics`` returns: a context manager and a decorator.

    Inside the ``with`` block, ``watch(tree, name)`` adds values to the sentinel and
    ``check()`` is an explicit check point.
    """

    def __init__(self, settings: Settings, backend: str | None, sync_ranks: bool = True) -> None:
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
        agree = [arm.agree for arm in self._arms if hasattr(arm, "agree") and self.sync_ranks]
        self._agree = agree[0] if agree and self.settings.mode == "sentinel" else None
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
            if isinstance(exc, NonFiniteError):
                return False
            for arm in arms:
                converted = arm.convert(exc)
                if converted is not None:
                    raise converted from exc
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
    sync_ranks: bool = True,
) -> CheckNumerics:
    """Raise ``NonFiniteError`` where NaN (``nan=True``) or inf (``inf=True``) appear, in the
    forward pass and, with ``backward=True``, in gradients.

    ``backend=None`` follows the configured backend (``use_backend``, ``set_backend``, ...);
    under ``"auto"`` it arms every deep-learning framework already imported, plus NumPy.
    ``mode="op"`` checks every op; ``mode="sentinel"`` keeps per-layer summaries on the
    device and reads them at ``check()`` / exit; ``sync_ranks``: with ``torch.distributed``
    initialised (world > 1) its ``check()`` and exit agree across the ranks (a collective
    every rank must reach; False for a context on some ranks only).
    """
    settings = Settings(
        nan=check_bool("nan", nan),
        inf=check_bool("inf", inf),
        backward=check_bool("backward", backward),
        mode=_check_mode(mode),
    )
    return CheckNumerics(
        settings, normalised_backend(backend), check_bool("sync_ranks", sync_ranks)
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
