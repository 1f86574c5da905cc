"""numstab's schedules as optax schedules."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numstab.errors import InvalidArgumentError


def optax_schedule(schedule: Any) -> Callable[[Any], Any]:
    """``count -> lr``, ``schedule`` evaluated on the jax backend (traceable by jit)."""

    def lr(count: Any) -> Any:
        # optax's counts: any number or array (a negative one gives the warmup's start, as
        # optax's schedules); a string or None raised JAX's own error
        if not isinstance(count, numbers.Real) and not hasattr(count, "dtype"):
            raise InvalidArgumentError(
                f"Expected count to be a number or an array. Received: count={count!r}"
            )
        return schedule(_step_array(count), backend="jax")

    return lr


def _step_array(count: Any) -> Any:
    """``count`` as a jax array. A Python or NumPy int, or a NumPy integer array, past JAX's
    default integer (int32 unless jax_enable_x64) becomes a float32 step, not an
    OverflowError nor a silent wrap (a 0-d int64 array of 2**40 was 0): the schedule computes
    in float32 for int32 steps anyway, and every step past total_steps gives min_lr."""
    bounds = np.iinfo(jax.dtypes.canonicalize_dtype(np.int64))
    if isinstance(count, numbers.Integral) and not isinstance(count, bool):
        if not bounds.min <= int(count) <= bounds.max:
            # clamped first: float() of an int past 1.8e308 overflows too
            return jnp.asarray(float(max(min(int(count), 2**64), -(2**64))), jnp.float32)
    elif (
        isinstance(count, np.ndarray)
        and count.dtype.kind in "iu"
        and count.size
        and (count.min() < bounds.min or count.max() > bounds.max)
    ):
        return jnp.asarray(count.astype(np.float32))
    return jnp.asarray(count)
