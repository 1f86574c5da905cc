"""Dynamic loss scaling: one immutable config, a state of three arrays, pure functions.

    state = scaler.init(like=loss)          # scale, growth tracker, hysteresis left
    scaled = scaler.scale(loss, state)      # backward on this
    grads, finite = scaler.unscale(grads, state)
    state = scaler.update(state, finite)    # skip the optimizer step yourself when not finite

The update, in plain Python (docs/semantics.md has the full contract):

    (at init: tracker = -growth_delay_after_overflow, hysteresis_left = hysteresis)
    if finite:
        tracker += 1
        if consecutive_hysteresis: hysteresis_left = hysteresis
        if tracker == growth_interval:
            tracker = 0
            hysteresis_left = hysteresis
            if isfinite(scale * growth_factor) and scale * growth_factor <= max_scale:
                scale *= growth_factor
    else:
        tracker = -growth_delay_after_overflow
        hysteresis_left = max(hysteresis_left - 1, 0)
        if hysteresis_left == 0:       # stays 0, so every further overflow backs off,
            scale = max(scale * backoff_factor, low)                   # until growth refills it

with [low, high] the float32 values in [min_scale, max_scale] and in float32's normal range
[2**-126, float32 max] (``scale_bounds``): the scale never reaches 0, a subnormal or inf.

The update is branch-free (``where``), so it runs under jax.jit, tf.function and torch.compile
without a host sync.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, NamedTuple

from numstab import _validate as v
from numstab._dispatch import resolve_backend, state_on_backend, to_backend
from numstab._layouts import dense_only
from numstab.backends._base import Backend, native_op
from numstab.clipping import scale_leaves
from numstab.errors import InvalidArgumentError
from numstab.tree import flatten, unflatten

Array = Any
FLOAT32_TINY = 2.0**-126  # the smallest normal float32: the backoff floor without min_scale
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1  # the int fields are stored as int32: past it they wrapped or raised


class LossScaleState(NamedTuple):
    """The scaler's state: arrays of the backend (a pytree for JAX, a nest for TF)."""

    scale: Array  # float32, 0-d
    growth_tracker: Array  # int32, 0-d: consecutive finite steps since the last change
    hysteresis_left: Array  # int32, 0-d: non-finite steps still absorbed before a backoff


# name -> keyword arguments of LossScaler reproducing that library's defaults
PRESETS: dict[str, dict[str, Any]] = {
    # torch.amp.GradScaler: no floor, grows only to finite values
    "torch": {"init_scale": 2.0**16, "growth_interval": 2000},
    # Keras 3 LossScaleOptimizer: no floor (it would also grow to inf; numstab never does)
    "keras": {"init_scale": 2.0**15, "growth_interval": 2000},
    # tf-keras LossScaleOptimizer: backoff floored at 1
    "tf_keras": {"init_scale": 2.0**15, "growth_interval": 2000, "min_scale": 1.0},
    # jmp.DynamicLossScale(loss_scale=2**15): period 2000, factor 2, min_loss_scale 1
    "jmp": {"init_scale": 2.0**15, "growth_interval": 2000, "min_scale": 1.0},
    # DeepSpeed fp16 config defaults: initial_scale_power 16, window 1000, hysteresis 2
    "deepspeed": {
        "init_scale": 2.0**16,
        "growth_interval": 1000,
        "hysteresis": 2,
        "min_scale": 1.0,
        "growth_delay_after_overflow": 1,  # grows on the (window + 1)-th finite step
    },
    # Megatron-LM: --initial-loss-scale 2**32, --loss-scale-window 1000, --hysteresis 2
    "megatron": {"init_scale": 2.0**32, "growth_interval": 1000, "hysteresis": 2, "min_scale": 1.0},
}


def _unscaled(be: Backend, leaves: list, scale: Array) -> list:
    """``leaves / scale``: times ``1 / scale`` (in float32: exact for the powers of two that
    scales are in practice), or ``Backend.unscale_leaves`` where the backend flushes
    subnormals (past 2**126 that reciprocal is one: TensorFlow and XLA gave zero gradients)."""
    if not be.flushes_subnormals:
        return scale_leaves(be, leaves, 1.0 / scale)
    present = [g for g in leaves if g is not None]
    unscaled = iter(native_op(be, "unscale_leaves")(present, scale) if present else [])
    return [None if g is None else next(unscaled) for g in leaves]


@dataclasses.dataclass(frozen=True)
class LossScaler:
    """Dynamic loss scaling; the defaults reproduce ``torch.amp.GradScaler`` exactly.

    ``hysteresis``: non-finite steps absorbed before a backoff (DeepSpeed / Megatron ``2``),
    refilled at every growth, or at every finite step with ``consecutive_hysteresis=True``
    (DeepSpeed's option). ``growth_delay_after_overflow``: extra finite steps required before
    the first growth after an overflow and at the start (DeepSpeed: 1; its first growth
    comes on the ``growth_interval + 1``-th finite step). ``dynamic=False`` keeps the scale
    fixed at ``init_scale``.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    consecutive_hysteresis: bool = False
    growth_delay_after_overflow: int = 0
    dynamic: bool = True

    def __post_init__(self) -> None:
        v.check_number("init_scale", self.init_scale, low=FLOAT32_TINY, high=FLOAT32_MAX)
        for name in ("consecutive_hysteresis", "dynamic"):
            v.check_bool(name, getattr(self, name))
        if self.dynamic:
            v.check_number("growth_factor", self.growth_factor, low=1.0, low_open=True)
            v.check_number(
                "backoff_factor",
                self.backoff_factor,
                low=0.0,
                high=1.0,
                low_open=True,
                high_open=True,
            )
        for name, low in (
            ("growth_interval", 1),
            ("hysteresis", 1),
            ("growth_delay_after_overflow", 0),
        ):
            if not low <= v.check_int(name, getattr(self, name)) <= INT32_MAX:
                raise InvalidArgumentError(
                    f"Expected {name} >= {low} and <= 2**31 - 1 (stored as int32). "
                    f"Received: {name}={getattr(self, name)}"
                )
        for name in ("min_scale", "max_scale"):
            if getattr(self, name) is not None:
                v.check_number(name, getattr(self, name), low=0.0, low_open=True)
        if (
            self.min_scale is not None
            and self.max_scale is not None
            and (self.min_scale > self.max_scale)
        ):
            raise InvalidArgumentError(
                f"Expected min_scale <= max_scale. Received: min_scale={self.min_scale}, "
                f"max_scale={self.max_scale}"
            )
        low, high = self.min_scale or 0.0, self.max_scale or math.inf
        if not low <= self.init_scale <= high:
            raise InvalidArgumentError(
                f"Expected min_scale <= init_scale <= max_scale. Received: init_scale="
                f"{self.init_scale}, min_scale={self.min_scale}, max_scale={self.max_scale}"
            )
        if self.scale_bounds[0] > self.scale_bounds[1]:
            raise InvalidArgumentError(
                f"Expected a float32 value between min_scale and max_scale. Received: "
                f"min_scale={self.min_scale}, max_scale={self.max_scale}"
            )

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LossScaler:
        """The defaults of another library: 'torch', 'keras', 'tf_keras', 'jmp', 'deepspeed',
        'megatron'. Keyword overrides replace single fields."""
        if name not in PRESETS:
            v.check_choice("name", name, tuple(PRESETS))
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def for_dtype(cls, dtype: Any, **overrides: Any) -> LossScaler:
        """float16 gets the dynamic scaler; bfloat16 and float32/64 a no-op (scale 1, fixed):
        their range needs no scaling, and non-finite steps are still reported."""
        if isinstance(dtype, type):  # np.float16, jnp.bfloat16
            name = dtype.__name__
        else:  # "float16", np.dtype, tf.float16 (.name), torch.float16 ("torch.float16")
            name = getattr(dtype, "name", None) or str(dtype).rsplit(".", 1)[-1]
        if name in ("float16", "half"):
            return cls(**overrides)
        if name in ("bfloat16", "float32", "float64", "float", "double"):
            return cls(**{"init_scale": 1.0, "dynamic": False, **overrides})
        raise InvalidArgumentError(
            f"Expected a floating compute dtype (float16, bfloat16, float32, float64). "
            f"Received: dtype={dtype!r}"
        )

    # -- the functional core -----------------------------------------------------------------
    @property
    def scale_bounds(self) -> tuple[float, float]:
        """(low, high): the float32 values the scale stays within. low is the smallest
        float32 >= max(min_scale, 2**-126), high the largest <= min(max_scale, float32 max):
        a min_scale below float32's normal range would let the backoff reach subnormals and
        then 0 (every later step non-finite); one that float32 rounds down would sit under
        min_scale."""
        low = _float32_rounded(max(self.min_scale or 0.0, FLOAT32_TINY), up=True)
        high = _float32_rounded(min(self.max_scale or math.inf, FLOAT32_MAX), up=False)
        return low, high

    def init(self, *, backend: str | None = None, like: Array | None = None) -> LossScaleState:
        """A fresh state as arrays of the backend, on the device of ``like`` when given."""
        be = resolve_backend(like, backend=backend)
        low, high = self.scale_bounds
        return LossScaleState(
            scale=be.asarray(min(max(self.init_scale, low), high), dtype="float32", like=like),
            growth_tracker=be.asarray(-self.growth_delay_after_overflow, dtype="int32", like=like),
            hysteresis_left=be.asarray(self.hysteresis, dtype="int32", like=like),
        )

    def scale(self, loss: Array, state: LossScaleState, *, backend: str | None = None) -> Array:
        """``loss * scale``, multiplied in float32 and returned in the loss's dtype."""
        if loss is None:
            raise InvalidArgumentError("Expected loss to be an array. Received: loss=None")
        state = _state(state)
        be = resolve_backend(loss, state.scale, backend=backend)
        state = state_on_backend(be, state, loss)
        loss = to_backend(be, loss, like=state.scale, name="loss")
        dtype = be.dtype_name(loss)
        v.check_floating("loss", dtype)
        if dtype in ("float32", "float64"):
            return loss * be.cast(state.scale, dtype)
        return be.cast(be.cast(loss, "float32") * state.scale, dtype)

    @dense_only
    def unscale(
        self, grads: Any, state: LossScaleState, *, backend: str | None = None
    ) -> tuple[Any, Array]:
        """(grads * (1 / scale), finite): every leaf unscaled in float32 and returned in its
        dtype, and one 0-d boolean over every leaf, taken on the unscaled values."""
        leaves, treedef = flatten(grads)
        present = [g for g in leaves if g is not None]
        state = _state(state)
        be = resolve_backend(state.scale, *present, backend=backend)
        state = state_on_backend(be, state, *present)
        leaves = [to_backend(be, g, like=state.scale, name="grads") for g in leaves]
        for i, g in enumerate(g for g in leaves if g is not None):
            if not v.is_floating(be.dtype_name(g)):
                raise InvalidArgumentError(
                    f"Expected floating-point gradients in grads ({v.FLOAT_DTYPES}). "
                    f"Received: leaf {i} with dtype={be.dtype_name(g)}"
                )
        unscaled = _unscaled(be, leaves, state.scale)
        numeric = be.nonempty([g for g in unscaled if g is not None])
        finite = native_op(be, "all_finite")(numeric) if numeric else be.asarray(True)
        return unflatten(treedef, unscaled), finite

    def update(
        self, state: LossScaleState, finite: Array | bool, *, backend: str | None = None
    ) -> LossScaleState:
        """The next state after a step whose gradients were (not) all finite. Branch-free.

        The scale stays within ``scale_bounds``: without ``min_scale`` (or with one below
        float32's normal range) the backoff stops at float32's smallest normal number (as
        flax does), since a scale of 0 would make every later step non-finite forever.
        """
        state = _state(state)
        be = resolve_backend(state.scale, finite, backend=backend)
        state = state_on_backend(be, state, finite)
        finite = _finite_flag(be, finite, like=state.scale)
        if not self.dynamic:
            return state
        scale, tracker, hysteresis_left = state
        full = self.hysteresis
        # finite step
        tracker_up = tracker + 1
        grow_now = tracker_up >= self.growth_interval
        low, high = self.scale_bounds
        with be.float_errors_ignored():  # a growth past float32 is inf, and refused below
            grown = scale * self.growth_factor
        scale_ok = be.where(grow_now & (grown <= high), grown, scale)  # inf > high: no growth
        tracker_ok = be.where(grow_now, 0, tracker_up)
        if self.consecutive_hysteresis:
            hysteresis_ok = be.where(finite, full, hysteresis_left)  # refilled every good step
        else:
            hysteresis_ok = be.where(grow_now, full, hysteresis_left)
        # non-finite step
        hysteresis_bad = be.maximum(hysteresis_left - 1, 0)
        backed_off = be.maximum(scale * self.backoff_factor, low)
        scale_bad = be.where(hysteresis_bad <= 0, backed_off, scale)
        return LossScaleState(
            scale=be.where(finite, scale_ok, scale_bad),
            growth_tracker=be.where(finite, tracker_ok, -self.growth_delay_after_overflow),
            hysteresis_left=be.where(finite, hysteresis_ok, hysteresis_bad),
        )

    # -- serialisation -----------------------------------------------------------------------
    def state_dict(self, state: LossScaleState, *, backend: str | None = None) -> dict[str, Any]:
        """Plain Python numbers, every config field and every state field (a host sync)."""
        state = _state(state)
        be = resolve_backend(state.scale, backend=backend)
        values = {f: be.to_numpy(getattr(state, f)).item() for f in LossScaleState._fields}
        return {"config": dataclasses.asdict(self), "state": values}

    @classmethod
    def from_state_dict(
        cls, data: dict[str, Any], *, backend: str | None = None, like: Array | None = None
    ) -> tuple[LossScaler, LossScaleState]:
        """Inverse of ``state_dict``: the scaler and its state as arrays of the backend."""
        try:
            scaler = cls(**data["config"])
            values = data["state"]
            scale = _stored_scale(scaler, values["scale"])
            ints = {f: _stored_int(f, values[f]) for f in ("growth_tracker", "hysteresis_left")}
        except (KeyError, TypeError) as exc:
            raise InvalidArgumentError(
                f"Expected state_dict to be a numstab loss-scaler state dict "
                f"(LossScaler.state_dict()). Received: a mapping missing or mistyping {exc!r}"
            ) from exc
        if not 0 <= ints["hysteresis_left"] <= scaler.hysteresis:  # no update makes it
            raise InvalidArgumentError(
                f"Expected state_dict's hysteresis_left within [0, hysteresis={scaler.hysteresis}]"
                f". Received: hysteresis_left={values['hysteresis_left']}"
            )
        # a tracker at or past growth_interval - 1 grows on the next finite step either way;
        # clamped, its increment cannot wrap past int32 (2**31 - 1 + 1 grew never again)
        ints["growth_tracker"] = min(ints["growth_tracker"], scaler.growth_interval - 1)
        be = resolve_backend(like, backend=backend)
        state = LossScaleState(
            scale=be.asarray(scale, dtype="float32", like=like),
            **{f: be.asarray(n, dtype="int32", like=like) for f, n in ints.items()},
        )
        return scaler, state


def _stored_scale(scaler: LossScaler, value: Any) -> float:
    """A state dict's scale as float32 will store it, within ``scaler.scale_bounds`` (where
    every update keeps it): past float32 it became inf (every gradient unscaled to 0 with
    finite=True), below it 0; a negative scale flipped the gradients' sign, NaN skipped every
    step, one outside [min_scale, max_scale] broke the config's bounds."""
    try:
        stored = _float32(float(value))
    except OverflowError:  # finite, but rounds past float32's largest value
        stored = math.inf
    except (TypeError, ValueError):  # None, "abc"
        stored = math.nan
    low, high = scaler.scale_bounds
    if not low <= stored <= high:  # False for NaN
        raise InvalidArgumentError(
            f"Expected state_dict's scale to be a positive finite number, as float32 within the "
            f"scaler's bounds [{low!r}, {high!r}] (min_scale, max_scale, float32's normal range). "
            f"Received: scale={value!r} (stored as float32: {stored!r})"
        )
    return stored


def _stored_int(name: str, value: Any) -> int:
    """A state dict's int32 field: an integral value (1.7 was truncated) within int32."""
    try:
        n = int(value)
        exact = bool(n == value) and not isinstance(value, (bool, str))
    except (TypeError, ValueError, OverflowError):  # None, "x", NaN, inf
        exact = False
    if not exact or not -INT32_MAX - 1 <= n <= INT32_MAX:
        raise InvalidArgumentError(
            f"Expected state_dict's {name} to be an integer within int32 [-2**31, 2**31 - 1]. "
            f"Received: {name}={value!r}"
        )
    return n


#: LossScaleState's fields: kind ("f" floating, "i" integer) and shape (§8: 0-d arrays)
_STATE_FIELDS = (("scale", "f", ()), ("growth_tracker", "i", ()), ("hysteresis_left", "i", ()))


def _state(state: Any) -> LossScaleState:
    """``state`` if a LossScaleState of 0-d fields (a floating scale, integer counters; Python
    numbers become float32 and int32 NumPy arrays), else InvalidArgumentError naming the
    field: a vector state was broadcast silently (NumPy, JAX, TensorFlow) or raised torch's
    "scalar tensor expected". Reads static shapes and dtypes only."""
    return v.check_state_fields(state, LossScaleState, "LossScaler.init", _STATE_FIELDS)


def _finite_flag(be: Any, finite: Any, like: Any) -> Any:
    """``finite`` as a 0-d boolean array of ``be``: a Python or NumPy bool, or a boolean
    array with one element (as ``all_finite`` and ``unscale`` return). Anything else raises:
    a vector of flags or a float would be reduced or cast silently."""
    if isinstance(finite, bool) or type(finite).__name__ == "bool":  # np.bool (no numpy import)
        return be.asarray(bool(finite), like=like)
    if finite is None or isinstance(finite, (str, int, float)) or not hasattr(finite, "dtype"):
        raise InvalidArgumentError(
            f"Expected finite to be a bool or a 0-d boolean array (all_finite(grads)). "
            f"Received: finite={finite!r}"
        )
    finite = to_backend(be, finite, like=like, name="finite")
    dtype, shape = be.dtype_name(finite), be.shape(finite)
    if dtype != "bool" or any(n != 1 for n in shape if n is not None):
        raise InvalidArgumentError(
            f"Expected finite to be a bool or a 0-d boolean array (all_finite(grads)). "
            f"Received: finite with dtype={dtype}, shape={tuple(shape)}"
        )
    return be.reshape(finite, ()) if shape else finite


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32, in plain Python (struct: no framework needed);
    OverflowError past float32's range."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _float32_rounded(x: float, up: bool) -> float:
    """The float32 nearest ``x`` on the side asked (``up``: >= x, else <= x), for x within
    float32's finite range."""
    f = _float32(x)
    if (up and f < x) or (not up and f > x):
        bits = struct.unpack("<I", struct.pack("<f", f))[0]  # a positive float: bits order it
        f = struct.unpack("<f", struct.pack("<I", bits + (1 if up else -1)))[0]
    return f
