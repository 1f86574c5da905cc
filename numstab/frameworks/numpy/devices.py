"""NumPy runs on the host CPU."""

from __future__ import annotations


def devices() -> list[str]:
    return ["cpu"]
