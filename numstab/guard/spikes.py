"""Rolling z-score spike detection over a window of past values, as arrays (jit-friendly).

OLMo-core's ``SkipStepOptimizer`` (allenai/OLMo-core ``src/olmo_core/optim/
skip_step_optimizer.py`` at a14de85) skips a step when

    len(history) >= max(20, W // 2)   and   x - mean(prev) > sigma * std(prev)

where ``history`` holds the last W + 1 values including the current one ``x``, ``prev`` the
up to W values before it, ``std`` is the unbiased (n - 1) standard deviation, W = 128 and
sigma = 6. :meth:`SpikeDetector.olmo_core` is exactly that rule, with one deliberate
difference: non-finite values never enter the window (in OLMo-core one NaN in the history
makes the mean NaN, and every comparison then skips for the next W steps).

Everything is written over backend primitives with ``where``: no host sync, and the same code
runs on NumPy, torch, TensorFlow and under ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from numstab import _validate as v
from numstab.backends._base import Backend
from numstab.errors import InvalidArgumentError

Array = Any
_INT32_MAX = 2**31 - 1


class WindowState(NamedTuple):
    """A ring buffer of past values: a pytree of arrays.

    ``values`` is float32 ``[window]``; ``count`` (int32, <= window) is how many slots hold
    a value; ``position`` (int32) is the slot the next value goes to.
    """

    values: Array
    count: Array
    position: Array


@dataclasses.dataclass(frozen=True)
class SpikeDetector:
    """Flags ``x`` as a spike when ``x - mean > sigma * std`` over the last ``window`` values.

    Args:
      window: how many past values the mean and std are taken over (2 <= W < 2**31).
      sigma: the threshold in standard deviations (finite, > 0).
      warmup: detection starts once ``count + 1 >= warmup``, counting the current value as
        OLMo-core does; default ``max(20, window // 2)``. At least 3 (two past values).
      two_sided: also flag drops (``|x - mean| > sigma * std``), as OLMo-core before 2025.
      record_spikes: spikes still enter the window (OLMo-core), so a lasting level shift is
        learned within ``window`` steps; False keeps only accepted values.

    Edge cases: with a constant history (std 0) any ``x > mean`` is a spike, as in OLMo-core.
    A non-finite ``x`` is never a "spike" here (the guard reports it as non-finite) and never
    enters the window.
    """

    window: int = 128
    sigma: float = 6.0
    warmup: int | None = None
    two_sided: bool = False
    record_spikes: bool = True

    def __post_init__(self) -> None:
        window = v.check_int("window", self.window)
        if not 2 <= window <= _INT32_MAX:  # count and position are int32 (and jit-friendly)
            raise InvalidArgumentError(
                f"Expected window in [2, 2**31 - 1]. Received: window={window}"
            )
        # at most float32's largest: the windows are float32, where 1e39 became inf and
        # sigma * std NaN at std = 0 (no spike ever, where any x > mean is one)
        v.check_number("sigma", self.sigma, low=0.0, high=3.4028234663852886e38, low_open=True)
        if self.warmup is not None:
            warmup = v.check_int("warmup", self.warmup)
            if not 3 <= warmup <= window + 1:
                raise InvalidArgumentError(
                    f"Expected warmup in [3, window + 1 = {window + 1}]. Received: warmup={warmup}"
                )
        for name in ("two_sided", "record_spikes"):
            v.check_bool(name, getattr(self, name))

    @classmethod
    def olmo_core(cls) -> SpikeDetector:
        """OLMo-core's rule: W = 128, 6 sigma, one-sided, active from the 64th value."""
        return cls(window=128, sigma=6.0, warmup=64, two_sided=False, record_spikes=True)

    @property
    def effective_warmup(self) -> int:
        """``warmup``, else ``max(20, window // 2)`` (OLMo-core's) capped at ``window + 1``,
        the most values the count reaches: below ``window = 19`` OLMo-core's default is
        never reached, and the detector would never detect."""
        if self.warmup is not None:
            return self.warmup
        return min(max(20, self.window // 2), self.window + 1)

    def init(self, be: Backend, like: Array | None = None) -> WindowState:
        """An empty window on backend ``be`` (on the device of ``like``)."""
        import numpy as np  # host data only; converted by the backend

        return WindowState(
            values=be.asarray(np.zeros(self.window, np.float32), like=like),
            count=be.asarray(np.int32(0), like=like),
            position=be.asarray(np.int32(0), like=like),
        )

    def score(self, be: Backend, state: WindowState, x: Array) -> tuple[Array, Array]:
        """``(z, spike)`` for the float32 value ``x`` against the window (no update).

        ``z = (x - mean) / std`` (``|.|`` when two-sided); ``+inf`` when std is 0 and
        ``x > mean``; 0 before the warmup. ``spike`` is a 0-d bool.
        """
        n = be.cast(state.count, "float32")
        valid = be.arange(self.window, like=state.values) < state.count
        mean = be.sum(be.where(valid, state.values, 0.0)) / be.maximum(n, 1.0)
        centered = be.where(valid, state.values - mean, 0.0)
        std = be.sqrt(be.sum(centered * centered) / be.maximum(n - 1.0, 1.0))
        diff = x - mean
        if self.two_sided:
            diff = be.abs(diff)
        active = (state.count + 1 >= self.effective_warmup) & be.isfinite(x)
        spike = active & (diff > self.sigma * std)
        safe_std = be.where(std > 0.0, std, 1.0)
        inf = be.asarray(float("inf"), "float32", like=diff)
        z = be.where(std > 0.0, diff / safe_std, be.where(diff > 0.0, inf, 0.0))
        return be.where(active, z, 0.0), spike

    def push(self, be: Backend, state: WindowState, x: Array, accept: Array) -> WindowState:
        """The window with ``x`` appended where ``accept`` (0-d bool) and ``x`` is finite."""
        take = accept & be.isfinite(x)
        slot = be.arange(self.window, like=state.values) == state.position
        step = be.cast(take, "int32")
        values = be.where(slot & take, be.cast(x, "float32"), state.values)
        count = state.count + step
        count = be.where(count > self.window, self.window, count)
        position = (state.position + step) % self.window
        return WindowState(values, be.cast(count, "int32"), be.cast(position, "int32"))
