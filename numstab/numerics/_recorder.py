"""The sentinel's bookkeeping (``check_numerics(mode="sentinel")``, docs/semantics.md §14.6):
one slot per (layer or watched name, phase), summaries kept on the device until read, a loss
scaler's verdict on parameter-gradient records, and the ranks' agreement on the first fault."""

from __future__ import annotations

import threading
from typing import Any

from numstab.errors import NonFiniteError, NumstabError
from numstab.frameworks import module


def arm_module(framework: str):
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

    def __init__(self, settings: Any) -> None:  # the context's Settings
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
            with self._lock:  # (``settle`` may pop from it in another thread)
                held_all, self._held = self._held, {}
            for held in held_all.values():
                for slot, flags in held.items():
                    self._mark(slot, *flags)

    def _read(self, framework: str, records: list, settled: list, final: bool) -> None:
        marks = [r[2] for r in records if len(r) == 3 and r[2] is not _FRESH]
        handled = {id(h): h for h in marks + [h for _, _, h in settled]}
        summaries = [r[1] for r in records] + list(handled.values())
        flags = arm_module(framework).read_summaries(summaries)
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
            if found != _NO_SLOT and not 0 <= found < len(self.meta):  # another collective's
                raise NumstabError(
                    "check_numerics(sync_ranks=...): the ranks' check() met another collective"
                    " (a context only some ranks entered): pass sync_ranks=False there"
                )
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
