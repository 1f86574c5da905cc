"""What every bench plot shares: matplotlib without a display, and the outcome colours."""

from __future__ import annotations

from typing import Any

OUTCOME_COLORS = {"non-finite": "#b2182b", "worse than chance": "#f4a582"}
STACK_DASH = {"numstab": "-", "native": (0, (4, 2))}


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
