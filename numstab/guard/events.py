"""The guard's action log: one JSON object per line, to a file and/or a callback.

Every event has ``"event"`` (``"skip"``, ``"rollback"``, ``"snapshot"``, ``"skip_batch"``,
``"give_up"``), ``"step"`` and ``"time"`` (Unix seconds), plus the numbers behind it
(``"reasons"``, ``"loss"``, ``"grad_norm"``, z-scores, ``"lr_factor"``, ...). Non-finite
floats are written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, so every line
is strict JSON (``json.loads`` of any line works in every language).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

from numstab.errors import InvalidArgumentError


def _plain(value: Any) -> Any:
    """JSON-safe: floats (non-finite as strings), ints, bools, str, lists, dicts, None."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(x) for x in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()  # NumPy / framework scalars
        if isinstance(value, bool):
            return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    return str(value)


class EventLog:
    """Appends events to ``path`` (one JSON line each, flushed) and passes them to
    ``callback``; the last ``keep`` events stay in ``events`` (all when ``keep`` is None)."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        callback: Callable[[dict[str, Any]], Any] | None = None,
        keep: int | None = 10_000,
    ) -> None:
        if callback is not None and not (callable(callback) and _hashable(callback)):
            raise InvalidArgumentError(
                "Expected log_callback to be a hashable callable or None (a TrainingGuard is "
                f"hashed as a static jit argument). Received: log_callback={callback!r}"
            )
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"Expected log_path to be a path or None. Received: log_path={path!r}"
            )
        self.path = None if path is None else os.fspath(path)
        self.callback = callback
        self.keep = keep
        self.events: list[dict[str, Any]] = []

    def emit(self, event: str, step: int, **numbers: Any) -> dict[str, Any]:
        record = _plain({"event": event, "step": int(step), "time": time.time(), **numbers})
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.callback is not None:
            self.callback(record)
        self.events.append(record)
        if self.keep is not None and len(self.events) > self.keep:
            del self.events[: len(self.events) - self.keep]
        return record


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of a JSON-lines log file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
