"""Find the backend of a call from its configuration and its array arguments.

Detection never imports a framework: a framework that is not in ``sys.modules`` cannot have
produced the arrays passed in. Results are cached per Python type.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from numstab import _validate as v
from numstab._config import AUTO, backend_choice, configured_backend
from numstab.backends import load_backend
from numstab.errors import BackendMismatchError, InvalidArgumentError, MixedBackendsError
from numstab.frameworks import FRAMEWORKS, imported_class, loaded

if TYPE_CHECKING:
    from numstab.backends._base import Backend

HOST = "host"  # NumPy arrays, Python scalars and sequences: they adopt the call's backend
_type_cache: dict[type, str] = {}
#: types whose values stand for an array of a framework (Keras 3 variables: their ``.value``,
#: a tensor of the Keras backend); filled with ``_type_cache``
_wrapper_types: set[type] = set()


def _framework_of_type(cls: type) -> str:
    # the registry's array types (JAX tracers are not jax.Array instances, and tf.Variable is
    # not a tf.Tensor, so both are listed)
    for framework in FRAMEWORKS.values():
        for module_name, attr in framework.array_types:
            array_type = imported_class(module_name, attr)
            if array_type is not None and issubclass(cls, array_type):
                return framework.name
    for wrapped in loaded("tree", "wrapper_framework"):  # Keras 3 variables, once imported
        name = wrapped(cls)
        if name is not None:
            _wrapper_types.add(cls)
            return name if name in FRAMEWORKS and name != "numpy" else HOST
    return HOST


def framework_of_type(cls: type) -> str:
    """``framework_of`` for an instance of ``cls``."""
    framework = _type_cache.get(cls)
    if framework is None:
        # Cached for host types too: a framework imported later cannot claim a class that
        # existed before it (its array classes are created by its own import).
        framework = _type_cache[cls] = _framework_of_type(cls)
    return framework


def is_wrapper_type(cls: type) -> bool:
    """Whether instances of ``cls`` stand for their ``.value`` (a Keras 3 variable)."""
    framework_of_type(cls)
    return cls in _wrapper_types


def framework_of(x: Any) -> str:
    """'torch', 'tensorflow', 'jax', or 'host' for NumPy arrays, scalars and anything else. A
    Keras 3 variable is its Keras backend's (``keras.backend.backend()``)."""
    cls = type(x)
    framework = _type_cache.get(cls)
    if framework is None:
        framework = framework_of_type(cls)
    return framework


def detect(*arrays: Any) -> str | None:
    """The one framework of the given arrays, None if all are host data; raise if mixed."""
    found = None
    for x in arrays:
        if x is None:
            continue
        framework = framework_of(x)
        if framework == HOST:
            continue
        if found is None:
            found = framework
        elif framework != found:
            raise MixedBackendsError(
                f"Expected arrays of one framework in one call. Received: {found} and "
                f"{framework} arrays. Convert them to one framework first."
            )
    return found


def to_backend(be: Backend, x: Any, like: Any = None, name: str = "array") -> Any:
    """Host data (NumPy, scalars, lists) becomes an array of ``be`` (on the device of
    ``like``); framework arrays and None pass as they are, a Keras 3 variable as its
    ``.value`` (its backend tensor). Host data that is not numeric (strings, objects) raises
    InvalidArgumentError naming ``name``.

    One rule for host data on every backend: it is read as NumPy reads it (``host_array``:
    Python floats are float64, ints int64), then becomes ``be``'s array of that dtype. torch
    and TensorFlow made Python floats float32 (1e300 became inf) where NumPy kept float64.
    Where the framework has no such dtype (JAX without ``jax_enable_x64``: no float64 or
    int64) JAX's own conversion applies; what must be exact there reads host data on the
    host (``find_nonfinite``, ``scalar_array``)."""
    if x is None:
        return x
    framework = framework_of(x)
    if type(x) in _wrapper_types:
        x = x.value
    if framework != HOST:
        return x
    if _holds_framework_arrays(x):
        check_numeric_host(x, name)
        return be.asarray(x, like=like)
    return be.asarray(host_array(x, name), like=like)


def host_array(x: Any, name: str) -> Any:
    """Host data as NumPy reads it (``np.asarray``: Python floats float64, ints int64, a
    NumPy array as it is); InvalidArgumentError naming ``name`` unless it holds numbers or
    booleans (strings, objects, ragged lists, ints past uint64)."""
    import numpy as np

    if type(x).__module__ == "numpy":
        check_numeric_host(x, name)
        return x
    try:
        array = np.asarray(x)
    except (TypeError, ValueError, OverflowError):  # ragged lists and the like
        array = None
    if array is None or not _numeric_dtype(array.dtype):
        _raise_not_numbers(x, name)
    return array


def _holds_framework_arrays(x: Any) -> bool:
    """A list or tuple with a framework array in it (stacked by ``Backend.asarray``, as
    torch cannot through NumPy for a GPU tensor)."""
    return isinstance(x, (list, tuple)) and any(framework_of(e) != HOST for e in x)


def scalar_array(be: Backend, name: str, x: Any, like: Any = None) -> Any:
    """``x`` as a 0-d array of ``be``: a real number, or an array of a floating or integer
    dtype with one element (shape ``(1,)`` or ``(1, 1)`` is reshaped). Anything else raises
    ``InvalidArgumentError`` naming ``name``: a vector would broadcast against what it meets
    (NumPy, JAX, TensorFlow) or raise torch's "scalar tensor expected", and a bool is no
    number.

    Host integers (Python ints, NumPy integer arrays) become float32 through float64, on
    the host, on every backend: JAX without x64 wrapped an int64 loss of 2**40 to 0, and
    the framework's conversion of a Python int past int64 raised its own error. An int
    past float64's range raises InvalidArgumentError. Host floats keep NumPy's dtype
    (a Python float is float64; float32 on JAX without x64)."""
    if isinstance(x, bool) or not (isinstance(x, numbers.Real) or hasattr(x, "dtype")):
        raise InvalidArgumentError(
            f"Expected {name} to be a scalar number or a one-element array. Received: {name}={x!r}"
        )
    x = same_framework(be, name, x)
    if framework_of(x) == HOST:
        x = _host_number(name, x)
    x = to_backend(be, x, like=like, name=name)
    dtype, shape = be.dtype_name(x), be.shape(x)
    if not (v.is_floating(dtype) or v.is_integer(dtype)):
        raise InvalidArgumentError(
            f"Expected {name} of a floating ({v.FLOAT_DTYPES}) or integer dtype. "
            f"Received: {name}.dtype={dtype}"
        )
    if any(n != 1 for n in shape):
        raise InvalidArgumentError(
            f"Expected {name} to be a scalar (one element). Received: {name}.shape={shape}"
        )
    return be.reshape(x, ()) if shape else x


def _host_number(name: str, x: Any) -> Any:
    """Host data for ``scalar_array`` as a NumPy array, integers as float32 through float64
    (exact up to 2**24, rounded to nearest beyond; no wrap)."""
    import numpy as np

    python_int = isinstance(x, numbers.Integral) and not hasattr(x, "dtype")
    if python_int:
        x = v.float64_of(name, x)
    x = host_array(x, name)
    if python_int or x.dtype.kind in "iu":
        with np.errstate(over="ignore"):  # past float32's range: inf
            x = x.astype(np.float64).astype(np.float32)
    return x


_NUMERIC_KINDS = frozenset("biufc")  # bool, int, uint, float, complex


def check_numeric_host(x: Any, name: str) -> None:
    """Raise InvalidArgumentError unless host data ``x`` holds numbers (or booleans)."""
    if isinstance(x, (bool, int, float, complex)):
        return
    # a NumPy array's or scalar's dtype is what it holds; another object's ``dtype``
    # attribute is not (a jax.experimental.sparse BCOO converts to an object array: its NaN
    # was silently skipped), so it is converted to see
    dtype = getattr(x, "dtype", None) if type(x).__module__ == "numpy" else None
    if dtype is None:
        import numpy as np

        try:
            dtype = np.asarray(x).dtype
        except (TypeError, ValueError):  # ragged lists and the like
            dtype = np.dtype(object)
    if not _numeric_dtype(dtype):
        _raise_not_numbers(x, name)


def _numeric_dtype(dtype: Any) -> bool:
    # ml_dtypes' bfloat16 / float8 are kind "V" to NumPy
    return dtype.kind in _NUMERIC_KINDS or dtype.name.startswith(("bfloat", "float"))


def _raise_not_numbers(x: Any, name: str) -> None:
    raise InvalidArgumentError(
        f"Expected {name} to be an array of numbers. Received: {name} of type "
        f"{type(x).__name__}: {v.short_repr(x)}"
    )


def same_framework(be: Backend, name: str, x: Any) -> Any:
    """``x`` if ``be`` can take it: host data, an array of ``be``'s framework, or, for the
    NumPy backend, any framework's array (read through ``__array__``: a host-mode guard
    reads a torch scaler's found-inf flag so); else BackendMismatchError naming ``name`` (a
    JAX loss in a torch guard raised AttributeError)."""
    found = framework_of(x)
    if found not in (HOST, be.name) and be.name != "numpy":
        raise BackendMismatchError(
            f"Expected {name} of the {be.name} backend (or a number, or NumPy). Received: "
            f"{name} of {found}, {type(x).__name__}"
        )
    return x


def resolve_backend(*arrays: Any, backend: str | None = None) -> Backend:
    """The Backend a call with these arrays runs on, by configuration then detection."""
    name = configured_backend(backend)
    detected = detect(*arrays)
    if name == AUTO:
        return load_backend(detected or "numpy")
    if detected is not None and detected != name:
        choice = backend_choice(backend)
        raise BackendMismatchError(
            f"Backend {choice.name!r} was selected by {choice.source}, but the call "
            f"received {detected} arrays. numstab does not copy arrays across frameworks: "
            f"pass {choice.name} (or NumPy) arrays, or select backend={detected!r}."
        )
    return load_backend(name)


def state_on_backend(be: Backend, state: Any, *arrays: Any) -> Any:
    """``state`` (a NamedTuple of arrays: ``LossScaleState``, ``ZClipState``) as arrays of
    ``be``: a host (NumPy) state, as a bare ``init()`` makes, joins the backend of the arrays
    it meets (on the device of the first of them that is a framework array); any other state
    is returned as it is (a framework's arrays, or wrappers that compute as them: flax NNX's
    ``OptArray`` in an ``nnx.Optimizer``). Field by field: a host field beside framework
    arrays (a counter set from NumPy) joins them (before, torch's "bitwise_and_cpu" error)."""
    if be.name == "numpy":
        return state
    host = [_is_host_field(field) for field in state]
    if not any(host):
        return state
    framework_arrays = (x for x in (*arrays, *state) if x is not None and not _is_host_field(x))
    like = next((a for a in framework_arrays if framework_of(a) != HOST), None)
    return type(state)(
        *(
            to_backend(be, field, like=like, name="state") if on_host else field
            for field, on_host in zip(state, host, strict=True)
        )
    )


def _is_host_field(x: Any) -> bool:
    """A state field held by NumPy (or a Python number)."""
    return (type(x).__module__ == "numpy" or isinstance(x, (int, float))) and (
        framework_of(x) == HOST
    )


def hyperparameter(be: Backend, value: Any, dtype: str, like: Any) -> Any:
    """A hyperparameter for array math: a Python float as it is; a 0-d array
    (``optax.inject_hyperparams``) in ``dtype`` on ``like``'s device, so that an x64 float64
    one does not widen float32 results or state."""
    if isinstance(value, float):
        return value
    return be.cast(to_backend(be, value, like, "hyperparameter"), dtype)
