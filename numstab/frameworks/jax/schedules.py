"""numstab's schedules as optax schedules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp


def optax_schedule(schedule: Any) -> Callable[[Any], Any]:
    """``count -> lr``, ``schedule`` evaluated on the jax backend (traceable by jit)."""

    def lr(count: Any) -> Any:
        return schedule(jnp.asarray(count), backend="jax")

    return lr
