"""Argument checks shared by every public function: one place for the error texts.

Messages follow one style: "Expected <what>. Received: <name>=<value>".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from numstab.errors import InvalidArgumentError

#: the floating dtypes numstab computes in (and NumPy's wider longdouble), for messages
FLOAT_DTYPES = "float16, bfloat16, float32 or float64"
#: 8-bit and narrower floats (float8_e4m3fn, float8_e5m2, float6_*, float4_*): storage
#: formats, some without inf (e4m3fn) or NaN (float6, float4), with few kernels in torch or
#: TensorFlow. Functions that compute refuse them; those that only read finiteness take them
#: (``numstab._finite_reads``).
_NARROW = ("float8_", "float6_", "float4_")  # "float64" is not narrow


def is_floating(dtype: str) -> bool:
    """float16, bfloat16, float32, float64 (and wider): not the 8-bit and narrower floats."""
    return dtype.startswith(("float", "bfloat")) and not dtype.startswith(_NARROW)


def is_narrow_float(dtype: str) -> bool:
    return dtype.startswith(_NARROW)


def is_complex(dtype: str) -> bool:
    return dtype.startswith("complex")


def is_integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def compute_dtype(dtype: str) -> str:
    """float64 stays float64; every other float computes in float32 (fp16/bf16 are upcast)."""
    return "float64" if dtype == "float64" else "float32"


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise InvalidArgumentError(
            f"Expected {name} to be one of {options}. Received: {name}={value!r}"
        )


def check_number(
    name: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number (NumPy scalars included) in [low, high] (``low_open`` /
    ``high_open`` leave out an end); an infinite ``high`` means no upper bound."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(
            f"Expected {name} to be a real number. Received: {name}={value!r}"
        )
    try:
        value = float(value)
    except OverflowError:  # an int past float64: its sign kept for the message
        value = math.inf if value > 0 else -math.inf
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    # comparisons, not math.isfinite: torch.compile passes a float it made dynamic (a second
    # value of max_norm) as a SymFloat, which comparisons guard on and isfinite cannot take
    if not -math.inf < value < math.inf or too_low or too_high:
        left = "(" if low_open or low == -math.inf else "["  # -inf is never accepted
        right = ")" if high_open or high == math.inf else "]"
        raise InvalidArgumentError(
            f"Expected {name} in {left}{low:g}, {high:g}{right}. Received: {name}={value!r}"
        )
    return value


class _Traced:
    """The marker ``host_scalar`` returns for a 0-d array whose value cannot be read."""

    def __repr__(self) -> str:
        return "TRACED"


TRACED = _Traced()
_STATIC_HINT = (
    "it selects the algorithm or a shape, so it cannot be traced; with "
    "optax.inject_hyperparams, which makes numeric hyperparameters arrays, pass it in "
    "static_args=({name!r},)"
)


def host_scalar(value: Any) -> Any:
    """A 0-d integer or floating array of any framework (``optax.inject_hyperparams`` makes
    every numeric hyperparameter one) as a Python int or float where its value can be read,
    ``TRACED`` where it cannot (under ``jax.jit``, ``tf.function``, ``torch.vmap``); anything
    else, Python numbers included, as it is."""
    kind = _number_kind(value)
    if kind is None or tuple(getattr(value, "shape", (1,))) != ():
        return value
    try:
        return int(value) if kind == "i" else float(value)
    except (TypeError, RuntimeError, AttributeError):  # a JAX or TF tracer (TypeError),
        # torch.vmap's tensor (RuntimeError), a tf.Variable read inside tf.function (its
        # symbolic value has no .numpy(): AttributeError)
        return TRACED


def _number_kind(value: Any) -> str | None:
    """Integer ("i") or floating ("f"), for an array's dtype: NumPy's or JAX's by ``kind``,
    torch's or TensorFlow's by name (``torch.int32``, ``float32``); None for anything else
    (bool, complex, no dtype)."""
    dtype = getattr(value, "dtype", None)
    return None if dtype is None else _dtype_kind(dtype)


def _dtype_kind(dtype: Any) -> str | None:
    """``_number_kind`` of an array of this dtype. ml_dtypes' (bfloat16, float8: NumPy's and
    JAX's) have kind "V": named instead (a bf16 ``inject_hyperparams`` value was refused as
    not a real number)."""
    kind = getattr(dtype, "kind", None)
    if kind is not None and kind != "V":
        return {"i": "i", "u": "i", "f": "f"}.get(kind)
    name = str(getattr(dtype, "name", dtype)).removeprefix("torch.")
    if name.startswith(("float", "bfloat", "half")):
        return "f"
    return "i" if name.startswith(("int", "uint")) else None


def check_number_or_traced(
    name: str, value: Any, *, low: float, high: float = math.inf, low_open: bool = False
) -> Any:
    """``check_number`` for a hyperparameter used only in array math: a readable 0-d array
    is read and checked (a float back); a traced one (``TRACED``) is returned unchecked."""
    read = host_scalar(value)
    if read is TRACED:
        return value
    return check_number(name, read, low=low, high=high, low_open=low_open)


def check_static(name: str, value: Any) -> Any:
    """``value`` for a setting that must be known while tracing (it picks code or a shape):
    a readable 0-d array is read (a Python number back); a traced one raises, naming
    ``static_args``. Other values come back as they are, for the caller's own check."""
    read = host_scalar(value)
    if read is TRACED:
        raise InvalidArgumentError(
            f"Expected {name} to be a Python value: {_STATIC_HINT.format(name=name)}. "
            f"Received: {name}=a traced array of dtype {value.dtype}"
        )
    return read


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (NumPy's too): a truthy string or number is not one."""
    if not isinstance(value, bool) and type(value).__name__ != "bool":  # np.bool, no import
        raise InvalidArgumentError(f"Expected {name} to be a bool. Received: {name}={value!r}")
    return bool(value)


def check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"Expected {name} to be an int. Received: {name}={value!r}")
    return int(value)


def check_floating(name: str, dtype: str) -> None:
    if not is_floating(dtype):
        raise InvalidArgumentError(
            f"Expected {name} of a floating dtype ({FLOAT_DTYPES}). Received: {name}.dtype={dtype}"
        )


def normalize_axis(axis: Any, rank: int, name: str = "axis") -> int:
    axis = check_int(name, axis)
    if not -rank <= axis < rank:
        raise InvalidArgumentError(
            f"Expected {name} in [{-rank}, {rank}) for an array of rank {rank}. "
            f"Received: {name}={axis}"
        )
    return axis % rank


def is_static_shape(shape: tuple) -> bool:
    """Every dimension a plain int: not None (unknown while tracing, TensorFlow) nor symbolic
    (``jax.export.symbolic_shape``), whose comparisons may be inconclusive."""
    return all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in shape)


def shapes_match(actual: tuple, expected: tuple) -> bool:
    """Equal shapes, where None (unknown while tracing) matches any size."""
    return len(actual) == len(expected) and all(
        a is None or e is None or a == e for a, e in zip(actual, expected, strict=True)
    )


def check_state(state: Any, kind: type, maker: str) -> Any:
    """``state`` if it is a ``kind`` (a state NamedTuple), else InvalidArgumentError naming
    the function that makes one."""
    if not isinstance(state, kind):
        raise InvalidArgumentError(
            f"Expected state to be a {kind.__name__} (from {maker}). Received: state of "
            f"type {type(state).__name__}"
        )
    return state


#: what a state field's kind ("f" floating, "i" integer) is called in messages
_KIND_WORDS = {"f": "floating", "i": "integer"}


def _field_kind_and_shape(x: Any) -> tuple[str | None, tuple | None]:
    """(kind, static shape) of a state field: a Python int or float is a 0-d number, an
    array (any framework's, or a wrapper exposing ``dtype`` and ``shape``) its dtype's kind
    and its shape; (None, None) for anything else (None, str, bool). A shape of unknown rank
    (TensorFlow while tracing) is None, which matches any expected shape."""
    dtype = getattr(x, "dtype", None)  # arrays first: the state check runs every step
    if dtype is None:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return None, None
        return ("f" if isinstance(x, float) else "i"), ()
    shape = getattr(x, "shape", None)
    if shape is None:
        return None, None
    # no cache keyed by dtypes: torch.compile cannot hash a TensorFlow DType in one
    kind = _torch_kind(dtype) or _dtype_kind(dtype)
    try:
        return kind, tuple(shape)
    except (TypeError, ValueError):  # a TensorShape of unknown rank
        return kind, None


def _torch_kind(dtype: Any) -> str | None:
    """ "f" or "i" for a torch floating or signed integer dtype, from its flags (faster than
    its name); None for anything else."""
    floating = getattr(dtype, "is_floating_point", None)
    if floating is None or dtype.is_complex:
        return None
    return "f" if floating else ("i" if dtype.is_signed else None)


def check_state_fields(
    state: Any, kind: type, maker: str, fields: tuple[tuple[str, str, tuple], ...]
) -> Any:
    """``check_state``, then each field's kind and static shape: ``fields`` holds, for every
    field in order, (name, "f" floating or "i" integer, expected shape). Reads shapes and
    dtypes, never values (no host sync; static under ``jax.jit``). A field of another shape
    was broadcast silently against the others (NumPy, JAX, TensorFlow) or raised torch's
    "scalar tensor expected"; ``None`` or a string raised Python's ``TypeError``."""
    check_state(state, kind, maker)
    for x, (name, want, shape) in zip(state, fields, strict=True):
        got, got_shape = _field_kind_and_shape(x)
        if got == want and (
            got_shape == shape or got_shape is None or shapes_match(got_shape, shape)
        ):
            continue
        what = f"an {_KIND_WORDS[want]}" if want == "i" else f"a {_KIND_WORDS[want]}"
        if got == want:
            received = f"state.{name}.shape={got_shape}"
        elif got_shape is None and not hasattr(x, "dtype"):
            received = f"state.{name}={short_repr(x)}"
        else:
            received = f"state.{name} with dtype={x.dtype}, shape={got_shape}"
        raise InvalidArgumentError(
            f"Expected state.{name} to be {what} array of shape {shape} (a {kind.__name__} "
            f"from {maker}). Received: {received}"
        )
    if any(isinstance(x, (int, float)) for x in state):
        return kind(*(_number_field(x, name) for x, (name, *_) in zip(state, fields, strict=True)))
    return state


def _number_field(x: Any, name: str) -> Any:
    """A Python-number state field as the 0-d NumPy array a state holds (float32, int32),
    so that every backend gets the same dtypes (before, float64 and int64 on NumPy, torch and
    TensorFlow, float32 and int32 on JAX); a value past those types raises."""
    if not isinstance(x, (int, float)):
        return x
    import numpy as np  # lazily: importing numstab imports no numpy

    is_float = isinstance(x, float)
    info = np.finfo(np.float32) if is_float else np.iinfo(np.int32)
    if math.isfinite(x) and not info.min <= x <= info.max:
        raise InvalidArgumentError(
            f"Expected state.{name} in {'float32' if is_float else 'int32'}'s range "
            f"[{info.min}, {info.max}]. Received: state.{name}={x!r}"
        )
    return np.asarray(x, np.float32 if is_float else np.int32)


def float64_of(name: str, x: Any) -> float:
    """``float(x)``; a number past float64's range (an int of 1025 bits or more) raises
    ``InvalidArgumentError`` naming ``name`` instead of Python's ``OverflowError``."""
    try:
        return float(x)
    except OverflowError:
        size = f"an int of {x.bit_length()} bits" if isinstance(x, int) else type(x).__name__
        raise InvalidArgumentError(
            f"Expected {name} to be a number within float64's range. Received: {name}={size}"
        ) from None


def short_repr(x: Any, limit: int = 60) -> str:
    """``repr(x)``, cut to ``limit`` characters (ending in ``...``) for an error message."""
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."
