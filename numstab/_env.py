"""Environment variables that numstab reads on every call, at the cost of a dict lookup.

``os.environ.get`` costs ~1 us (a ``Mapping`` method, a key encoding, a value decoding), and
a tiny eager loss reads three variables. ``os.environ`` keeps its encoded keys and values in
the dict ``os.environ._data``, which every ``os.environ[...] = ...``, ``del`` and
``monkeypatch.setenv`` updates, so looking the pre-encoded key up there gives exactly
``os.environ.get``'s answer. Where that dict is missing (another Python), ``get`` is
``os.environ.get``.
"""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None)
_FAST = isinstance(_DATA, dict) and hasattr(os.environ, "encodekey")


class EnvVar:
    """One environment variable: ``EnvVar("NAME").get()`` is ``os.environ.get("NAME")``."""

    __slots__ = ("_key", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._key = os.environ.encodekey(name) if _FAST else None

    def get(self) -> str | None:
        if _FAST:
            raw = _DATA.get(self._key)
            return None if raw is None else os.environ.decodevalue(raw)
        return os.environ.get(self.name)
