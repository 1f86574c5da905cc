"""Learning-rate schedules: one formula for Python ints and every backend's arrays.

    schedule = warmup_cosine_schedule(3e-4, warmup_steps=100, total_steps=10_000, min_lr=3e-5)
    schedule(0)                              # 0.0, a Python float
    schedule(jnp.asarray(50))                # a float32 jax array, traceable under jax.jit
    sched = schedule.for_torch(opt)              # a torch LambdaLR (build opt with lr=base_lr)
    tx = optax.adam(schedule.for_optax())        # an optax schedule
    keras.optimizers.Adam(schedule.for_keras())  # a Keras 3 LearningRateSchedule

Values equal ``optax.warmup_cosine_decay_schedule(init_value=warmup_start_lr,
peak_value=base_lr, warmup_steps=warmup_steps, decay_steps=total_steps, end_value=min_lr)``
(see docs/semantics.md §12 for the formula and the edge cases).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from numstab import _validate as v
from numstab._dispatch import resolve_backend, to_backend
from numstab.backends import canonical_name
from numstab.errors import InvalidArgumentError

Array = Any

#: the largest ``warmup_steps`` / ``total_steps``: float64 holds every int up to it exactly
MAX_STEPS = 2**53


class WarmupCosineSchedule:
    """Linear warmup from ``warmup_start_lr`` to ``base_lr`` over ``warmup_steps``, then a
    cosine decay to ``min_lr`` at ``total_steps`` (which includes the warmup), then ``min_lr``.

    For a step ``t``, with ``W = warmup_steps`` and ``D = total_steps - warmup_steps``::

        t < W:   warmup_start_lr + (base_lr - warmup_start_lr) * max(t, 0) / W
        t >= W:  min_lr + (base_lr - min_lr) * 0.5 * (1 + cos(pi * min(t - W, D) / D))

    A Python int step gives a Python float (computed in float64). An array step (any
    backend, integer or floating dtype) gives an array of the same shape in float32
    (float64 for a float64 step), with no host sync: it traces under jax.jit, tf.function
    and torch.compile. Negative Python int steps raise; negative array steps give
    ``warmup_start_lr``, as optax does.
    """

    def __init__(
        self,
        base_lr: float,
        *,
        warmup_steps: int,
        total_steps: int,
        min_lr: float = 0.0,
        warmup_start_lr: float = 0.0,
    ) -> None:
        self.base_lr = v.check_number("base_lr", base_lr, low=0.0)
        self.warmup_steps = v.check_int("warmup_steps", warmup_steps)
        self.total_steps = v.check_int("total_steps", total_steps)
        if self.warmup_steps < 0:
            raise InvalidArgumentError(
                f"Expected warmup_steps >= 0. Received: warmup_steps={warmup_steps!r}"
            )
        for name, steps in (("warmup_steps", self.warmup_steps), ("total_steps", total_steps)):
            if steps > MAX_STEPS:  # past it, math.pi * count / decay raised OverflowError
                raise InvalidArgumentError(
                    f"Expected {name} <= 2**53 (float64 holds every step exactly). "
                    f"Received: {name}={steps!r}"
                )
        if self.total_steps <= self.warmup_steps:
            raise InvalidArgumentError(
                "Expected total_steps > warmup_steps (total_steps includes the warmup; the "
                f"cosine decay needs at least one step). Received: total_steps={total_steps!r}, "
                f"warmup_steps={warmup_steps!r}"
            )
        self.min_lr = v.check_number("min_lr", min_lr, low=0.0, high=self.base_lr)
        self.warmup_start_lr = v.check_number(
            "warmup_start_lr", warmup_start_lr, low=0.0, high=self.base_lr
        )

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments: ``WarmupCosineSchedule(**config)`` rebuilds it."""
        return {
            "base_lr": self.base_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "min_lr": self.min_lr,
            "warmup_start_lr": self.warmup_start_lr,
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={val!r}" for k, val in self.get_config().items())
        return f"warmup_cosine_schedule({args})"

    # -- evaluation ----------------------------------------------------------------------------
    def __call__(self, step: int | Array, *, backend: str | None = None) -> float | Array:
        number = _host_step(step)
        if number is None:
            return self._array_value(step, backend)
        if backend is not None:
            canonical_name(backend)  # an unknown name raises here too
        return self._python_value(number)

    def _python_value(self, step: int) -> float:
        warmup, decay = self.warmup_steps, self.total_steps - self.warmup_steps
        if step >= self.total_steps:  # min_lr itself (optax's order gives it to one rounding)
            return self.min_lr
        if step < warmup:
            frac = 1.0 - step / warmup
            return (self.warmup_start_lr - self.base_lr) * frac + self.base_lr
        count = min(step - warmup, decay)
        cosine = 0.5 * (1.0 + math.cos(math.pi * count / decay))
        return self.base_lr * ((1.0 - self._alpha) * cosine + self._alpha)

    @property
    def _alpha(self) -> float:
        """min_lr as a fraction of base_lr (optax's ``alpha``; 0 when base_lr is 0)."""
        return 0.0 if self.base_lr == 0.0 else self.min_lr / self.base_lr

    def _array_value(self, step: Array, backend: str | None) -> Array:
        be = resolve_backend(step, backend=backend)
        step = to_backend(be, step, name="step")  # host data (NumPy) as be's array
        dtype = be.dtype_name(step)
        if not (v.is_integer(dtype) or v.is_floating(dtype)):
            raise InvalidArgumentError(
                f"Expected step of an integer or floating dtype. Received: step.dtype={dtype}"
            )
        t = be.cast(step, v.compute_dtype(dtype))
        warmup, decay = self.warmup_steps, float(self.total_steps - self.warmup_steps)
        # the same operations, in the same order, as optax's polynomial and cosine schedules
        count = be.clip(t - float(warmup), 0.0, decay)
        cosine = 0.5 * (1.0 + be.cos(math.pi * count / decay))
        decayed = self.base_lr * ((1.0 - self._alpha) * cosine + self._alpha)
        if warmup == 0:
            return be.where(t < 0.0, self.warmup_start_lr, decayed)
        frac = 1.0 - be.clip(t, 0.0, float(warmup)) / float(warmup)
        warm = (self.warmup_start_lr - self.base_lr) * frac + self.base_lr
        return be.where(t < float(warmup), warm, decayed)

    # -- framework adapters --------------------------------------------------------------------
    def for_torch(self, optimizer: Any, last_epoch: int = -1) -> Any:
        """A ``torch.optim.lr_scheduler.LambdaLR`` giving each parameter group
        ``initial_lr * schedule(step) / base_lr``: exactly ``schedule(step)`` when the
        optimizer was built with ``lr=base_lr``, and per-group ratios are kept otherwise.
        Call ``scheduler.step()`` once per optimizer step, as usual."""
        from numstab import frameworks

        return frameworks.module("torch", "schedules").lambda_lr(self, optimizer, last_epoch)

    def for_optax(self) -> Any:
        """An optax schedule (``count -> lr``), evaluated on the jax backend."""
        from numstab import frameworks

        return frameworks.module("jax", "schedules").optax_schedule(self)

    def for_keras(self) -> Any:
        """A Keras 3 ``LearningRateSchedule`` (serialisable, any Keras backend)."""
        from numstab import frameworks

        return frameworks.module("keras", "schedules").WarmupCosineDecay(**self.get_config())

    # the earlier names of the three adapters
    torch_scheduler = for_torch
    optax = for_optax
    keras = for_keras


def _host_step(step: Any) -> int | None:
    """``step`` as a Python int when it is one (NumPy's too), checked >= 0; None for an
    integer or floating array (computed on); anything else (a bool, a float, a string, None)
    raises."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        if step < 0:
            raise InvalidArgumentError(f"Expected step >= 0. Received: step={step}")
        return int(step)
    if isinstance(step, (bool, numbers.Real)) or not hasattr(step, "dtype"):
        raise InvalidArgumentError(
            f"Expected step to be an int or an integer/floating array. Received: step={step!r}"
        )
    return None


def warmup_cosine_schedule(
    base_lr: float,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr: float = 0.0,
    warmup_start_lr: float = 0.0,
) -> WarmupCosineSchedule:
    """Linear warmup then cosine decay, a callable ``step -> lr`` (see WarmupCosineSchedule).

    Bad arguments raise InvalidArgumentError: a negative or non-finite learning rate,
    ``min_lr`` or ``warmup_start_lr`` above ``base_lr``, ``warmup_steps < 0``,
    ``total_steps <= warmup_steps``, non-int step counts.
    """
    return WarmupCosineSchedule(
        base_lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        min_lr=min_lr,
        warmup_start_lr=warmup_start_lr,
    )
