"""Finiteness, norms and clipping over whole trees of gradients, in float32 at least.

Norms accumulate in float32 for float16/bfloat16 leaves (float64 when any leaf is float64):
a float16 norm overflows at 65504, where torch's per-tensor norm silently zeroes the
gradients and optax's and TF's turn them to NaN. See docs/semantics.md.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

from numstab import _finite_reads
from numstab import _validate as v
from numstab._dispatch import (
    HOST,
    framework_of,
    host_array,
    hyperparameter,
    resolve_backend,
    scalar_array,
    to_backend,
)
from numstab._layouts import dense_only
from numstab.backends._base import Backend
from numstab.backends._native import generic_forced, native_op
from numstab.errors import InvalidArgumentError
from numstab.tree import flatten, unflatten

Tree = Any
Array = Any

#: The largest finite value per dtype: ``max_norm`` beyond it is clamped to it (a norm of that
#: dtype is never larger, so nothing is clipped) instead of becoming inf (NaN, or a raise on TF).
LARGEST_FINITE = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}


def in_range(value: float, dtype: str) -> float:
    """``value`` clamped to ``dtype``'s finite range, ``[-largest, largest]``: a Python bound
    for arrays of that dtype. Past the range, a bound clamps no finite value of the dtype, as
    the bound itself would not, and +-inf clamp to the largest finite value (the bound has no
    value in the dtype: torch and TensorFlow raise converting it, NumPy and JAX make it inf).
    A dtype outside ``LARGEST_FINITE`` (NumPy's float128) keeps ``value`` as it is."""
    largest = LARGEST_FINITE.get(dtype)
    return float(value) if largest is None else min(max(float(value), -largest), largest)


#: The smallest normal value per dtype: a ``max_norm`` below it may round to 0 in the dtype.
SMALLEST_NORMAL = {
    "float16": 6.103515625e-05,
    "bfloat16": 1.1754943508222875e-38,
    "float32": 1.1754943508222875e-38,
    "float64": 2.2250738585072014e-308,
}


class _Leaves(NamedTuple):
    """What ``_float_leaves`` found: the backend, every leaf and the treedef, the non-None
    non-empty floating leaves (``numeric``), their accumulation dtype, and whether one of
    them is complex (their norms are then taken of ``norm_operands``)."""

    be: Backend
    leaves: list
    treedef: Any
    numeric: list
    dtype: str
    complex_leaves: bool


def _float_leaves(
    tree: Tree,
    backend: str | None,
    *extra: Array,
    name: str = "tree",
    fused: bool | None = None,
    read_narrow: bool = False,
    complex_ok: bool = False,
) -> _Leaves:
    """(backend, all leaves, treedef, the non-None non-empty floating leaves, their
    accumulation dtype, and whether one of them is complex).

    One pass per question, none of them a Python call per leaf where it can be avoided: the
    dtype names are asked once per distinct dtype, and ``Backend.nonempty`` drops the empty
    leaves (a backend's ``native_dtypes_and_nonempty`` answers both; ``fused``: as
    ``native_op``'s ``allowed``). Raises InvalidArgumentError naming the first
    (non-None) leaf of a non-floating dtype, counted among the non-None leaves; with
    ``read_narrow`` (functions that only read finiteness) 8-bit floats and complex leaves are
    taken, read as ``numstab._finite_reads`` says, and float6/float4 leaves dropped; with
    ``complex_ok`` (the global norm and what scales by it) complex leaves are taken as they
    are (``norm_operands`` gives what their norms are taken of).
    """
    leaves, treedef = flatten(tree)
    present = _present(leaves)
    # one leaf per Python type: the framework of an array is a function of its type
    kinds = list({type(leaf): leaf for leaf in present}.values())
    be = resolve_backend(*kinds, *extra, backend=backend)
    if any(framework_of(leaf) == HOST for leaf in kinds):
        if read_narrow and be.name != "numpy":  # finiteness: a finite host leaf is, exactly
            leaves = [None if _finite_host_float(x, name) else x for x in leaves]
        like = next((x for x in (*present, *extra) if x is not None and hasattr(x, "device")), None)
        leaves = [to_backend(be, leaf, like=like, name=f"{name} leaves") for leaf in leaves]
        present = _present(leaves)
    dtypes, numeric = native_op(be, "dtypes_and_nonempty", fused)(present)
    has_complex = False
    if not all(map(v.is_floating, dtypes)):
        if complex_ok and all(map(_floating_or_complex, dtypes)):
            has_complex = True
        elif read_narrow and all(map(_finite_reads.is_readable, dtypes)):
            numeric = _finite_reads.readable(be, numeric)
            return _Leaves(be, leaves, treedef, numeric, "float32", False)  # dtype unused
        else:
            raise _not_floating_error(be, present, name, read_narrow, complex_ok)
    if len(numeric) != len(present):  # an empty leaf does not choose the accumulation dtype
        dtypes = be.dtype_names(numeric)
    return _Leaves(be, leaves, treedef, numeric, _accumulation_dtype(dtypes), has_complex)


def _floating_or_complex(dtype: str) -> bool:
    return v.is_floating(dtype) or v.is_complex(dtype)


def norm_operands(be: Backend, leaves: list, norm_type: float) -> list:
    """Real arrays whose ``norm_type``-norms are those of ``leaves``: a complex leaf as its
    (real, imaginary) pairs for the 2-norm (``|z|**2 = re**2 + im**2``; a view in torch), as
    ``|z|`` for any other; a real leaf as it is."""
    out = []
    for x in leaves:
        if v.is_complex(be.dtype_name(x)):
            x = be.real_view(x) if norm_type == 2.0 else be.abs(x)
        out.append(x)
    return out


def _not_floating_error(
    be: Backend, present: list, name: str, read_narrow: bool = False, complex_ok: bool = False
) -> InvalidArgumentError:
    if read_narrow:
        ok, kinds = _finite_reads.is_readable, ", narrower floats or complex"
    elif complex_ok:
        ok, kinds = _floating_or_complex, " or complex"
    else:
        ok, kinds = v.is_floating, ""
    i, dtype = next((i, d) for i, d in enumerate(map(be.dtype_name, present)) if not ok(d))
    kinds = v.FLOAT_DTYPES.replace(" or ", ", ") + kinds if kinds else v.FLOAT_DTYPES
    return InvalidArgumentError(
        f"Expected floating-point leaves in {name} ({kinds}). Received: leaf {i} with dtype={dtype}"
    )


def _accumulation_dtype(dtypes: set[str]) -> str:
    """float64 when any leaf is float64 (or complex128), else float32 (16-bit leaves
    accumulate in float32)."""
    return "float64" if "float64" in dtypes or "complex128" in dtypes else "float32"


def _check_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float: any real > 0 (NaN fails the comparison). One past float64's
    range (``10**400``) is ``math.inf``: every p from ``max_norm_from`` (~7.3e8 in float32)
    gives the max-abs norm to the dtype's rounding. One that float64 rounds to 0 raises."""
    if (
        isinstance(norm_type, numbers.Real)
        and not isinstance(norm_type, bool)
        and norm_type > 0  # False for NaN; a comparison, so torch.compile's SymFloat passes
    ):
        try:
            value = float(norm_type)
        except OverflowError:  # an int or Fraction past float64: the max-abs norm
            return math.inf
        if value > 0.0:
            return value
    raise InvalidArgumentError(
        f"Expected norm_type > 0 (math.inf allowed). Received: norm_type={norm_type!r}"
    )


def _finite_host_float(x: Any, name: str) -> bool:
    """Whether ``x`` is a host array of floats (or complex numbers) that are all finite, read
    in its own dtype on the host: ``all_finite`` leaves such a leaf out rather than convert
    it (JAX without x64 made a float64 1e300 float32 inf); a non-finite one stays non-finite
    through any conversion."""
    if x is None or framework_of(x) != HOST:
        return False
    import numpy as np

    array = host_array(x, f"{name} leaves")
    return array.dtype.kind in "fc" and bool(np.isfinite(array).all())


@dense_only
def all_finite(tree: Tree, *, backend: str | None = None) -> Array:
    """A 0-d boolean array: True when every element of every leaf is finite.

    Stays on the device (no host sync); jit/tf.function/torch.compile friendly.
    """
    fused = not generic_forced()  # read once for both kernels
    be, _, _, leaves, _, _ = _float_leaves(tree, backend, fused=fused, read_narrow=True)
    if not leaves:
        return be.asarray(True)
    return native_op(be, "all_finite", fused)(leaves)


@dense_only
def global_norm(tree: Tree, norm_type: float = 2.0, *, backend: str | None = None) -> Array:
    """``(sum_leaves sum |g|**p) ** (1/p)`` (``max |g|`` for p = inf), in float32 at least.

    A NaN anywhere gives NaN, an inf (and no NaN) gives inf; an empty tree gives 0.
    """
    norm_type = _check_norm_type(norm_type)
    fused = not generic_forced()  # read once for both kernels
    return _tree_norm(_float_leaves(tree, backend, fused=fused, complex_ok=True), norm_type, fused)


def _tree_norm(found: _Leaves, norm_type: float, fused: bool | None = None) -> Array:
    """The ``norm_type``-norm of ``_float_leaves``' leaves (complex ones: of |z|)."""
    leaves = found.numeric
    if found.complex_leaves:
        leaves = norm_operands(found.be, leaves, norm_type)
    return _global_norm(found.be, leaves, float(norm_type), found.dtype, fused)


def _global_norm(
    be: Backend, leaves: list, norm_type: float, dtype: str, fused: bool | None = None
) -> Array:
    """The norm of floating, non-empty ``leaves``, accumulated in ``dtype`` (``_float_leaves``'
    accumulation dtype)."""
    if not leaves:
        return be.asarray(0.0, dtype=dtype)
    with be.float_errors_ignored():
        return native_op(be, "global_norm", fused)(leaves, norm_type, dtype)


@dense_only
def clip_by_global_norm(
    tree: Tree,
    max_norm: float | Array,
    *,
    norm_type: float = 2.0,
    norm: Array | None = None,
    backend: str | None = None,
) -> tuple[Tree, Array]:
    """Scale every leaf by ``max_norm / max(norm, max_norm)``; return (clipped tree, norm).

    Leaves are exactly unchanged when ``norm <= max_norm`` (no epsilon, no 0/0 at zero
    gradients). A non-finite norm leaves every leaf untouched and is returned as is, so the
    caller (loss scaler, training guard) can skip the step. ``norm``: a norm computed
    elsewhere (e.g. combined across devices or ranks) to use instead of this tree's own: a
    number or a one-element array (returned 0-d; an integer one as float32). ``max_norm``: a
    number or a 0-d array, read and checked; a traced one (under jit) is used unchecked.
    """
    max_norm = _checked_max_norm(max_norm)
    norm_type = _check_norm_type(norm_type)
    fused = not generic_forced()  # read once for the four kernels below
    found = _float_leaves(tree, backend, norm, fused=fused, complex_ok=True)
    be, leaves, treedef, numeric = found.be, found.leaves, found.treedef, found.numeric
    if norm is None:
        norm = _tree_norm(found, norm_type, fused)
    else:
        norm = _given_norm(be, norm, like=numeric[0] if numeric else None, host=found.dtype)
    factor = _coefficient(be, norm, max_norm, fused)
    # no None and no empty leaf: the leaves are ``numeric`` (which may carry facts to reuse)
    present = numeric if len(numeric) == len(leaves) else _present(leaves)
    return unflatten(treedef, _scale_present(be, leaves, present, factor, True, fused)), norm


def clip_coefficient(norm: Array, max_norm: float | Array, *, backend: str | None = None) -> Array:
    """``max_norm / max(norm, max_norm)``, and 1 when ``norm`` is not finite: the factor
    clip_by_global_norm multiplies by (for in-place or cross-device clipping)."""
    max_norm = _checked_max_norm(max_norm)
    be = resolve_backend(norm, backend=backend)
    return _coefficient(be, _given_norm(be, norm, host="float32"), max_norm)  # as every backend


def _checked_max_norm(max_norm: Any) -> Any:
    """A positive ``max_norm`` as a float (a 0-d array read, ``inject_hyperparams``), or the
    traced 0-d array it is under ``jit`` / ``tf.function``, unchecked. A number is checked
    without looking for a dtype: Dynamo cannot ask a SymFloat ``hasattr``."""
    if isinstance(max_norm, numbers.Real):
        return v.check_number("max_norm", max_norm, low=0.0, low_open=True)
    return v.check_number_or_traced("max_norm", max_norm, low=0.0, low_open=True)


def _given_norm(be: Backend, norm: Any, like: Any = None, host: str | None = None) -> Array:
    """A caller's norm as a 0-d floating array (``scalar_array``; integers as float32), a
    host number as ``host`` when given (the tree's accumulation dtype: NumPy made it float64,
    torch and TF float32). A negative host number raises; an array's sign is not read (that
    would sync the host)."""
    is_host = isinstance(norm, numbers.Real) and not isinstance(norm, bool)
    if is_host and norm < 0:
        raise InvalidArgumentError(f"Expected norm >= 0. Received: norm={norm!r}")
    if is_host and host is not None:
        return be.asarray(v.float64_of("norm", norm), dtype=host, like=like)
    norm = scalar_array(be, "norm", norm, like)
    return norm if v.is_floating(be.dtype_name(norm)) else be.cast(norm, "float32")


def _coefficient(
    be: Backend, norm: Array, max_norm: float | Array, fused: bool | None = None
) -> Array:
    """``max_norm / max(norm, max_norm)`` where ``norm < inf``, else exactly 1, in the 0-d
    floating ``norm``'s dtype.

    ``max_norm`` becomes an array first, clamped to the dtype's largest finite value (a finite
    norm never exceeds it: nothing is clipped, where inf / inf gave NaN). The division is then
    IEEE's on every backend (torch computes ``scalar / tensor`` as ``reciprocal(tensor) *
    scalar``: one ulp below 1 for ~14% of float32 ``max_norm``), and ``x / x`` is exactly 1,
    so a norm at most ``max_norm`` scales by exactly 1. A NaN norm fails ``norm < inf``: 1.
    A ``max_norm`` below the dtype's smallest normal may round to 0: there the factor also
    needs ``norm > max_norm``, so that 0 / 0 never reaches a zero norm (which keeps 1) and
    every other finite norm scales to 0. ``Backend.clip_factor`` computes it (torch's native
    version in 4 kernels, bit for bit the same). A traced ``max_norm`` (unchecked: zero,
    negative or NaN clip nothing) divides the norm instead.
    """
    dtype = be.dtype_name(norm)
    if not isinstance(max_norm, numbers.Real):  # traced: 1 / max(norm / max_norm, 1)
        return _coefficient(be, norm / hyperparameter(be, max_norm, dtype, norm), 1.0, fused)
    value = in_range(max_norm, dtype)
    tiny = value < SMALLEST_NORMAL.get(dtype, 0.0)  # float128: no Python float is below it
    return native_op(be, "clip_factor", fused)(norm, value, dtype, tiny)


def scale_leaves(be: Backend, leaves: list, factor: Array, *, toward_zero: bool = False) -> list:
    """Every (non-None) leaf times a 0-d float32/64 ``factor``, in the leaf's dtype; 16-bit
    leaves rounded ``toward_zero`` when asked (``Backend.cast_toward_zero``: what clipping asks,
    so that a clipped norm never exceeds max_norm by more than float32's rounding)."""
    return _scale_present(be, leaves, _present(leaves), factor, toward_zero)


def _present(leaves: list) -> list:
    """The non-None ``leaves``, in order."""
    return [leaf for leaf in leaves if leaf is not None]


def _scale_present(
    be: Backend,
    leaves: list,
    present: list,
    factor: Array,
    toward_zero: bool,
    fused: bool | None = None,
) -> list:
    """``scale_leaves`` given ``present``, the non-None ``leaves`` in order."""
    if not present:
        return list(leaves)
    scaled = native_op(be, "scale_leaves", fused)(present, factor, toward_zero)
    if len(present) == len(leaves):
        return list(scaled)
    it = iter(scaled)
    return [None if leaf is None else next(it) for leaf in leaves]


@dense_only
def clip_by_value(
    tree: Tree, min_value: float, max_value: float, *, backend: str | None = None
) -> Tree:
    """Clamp every element to [min_value, max_value]. NaN passes through (as in every
    framework); +-inf become the bounds. A bound past a leaf dtype's finite range is taken
    as that range's end (``in_range``): it clamps nothing finite, and +-inf become the
    dtype's largest finite value."""
    low = v.check_number("min_value", min_value, low=-math.inf)
    high = v.check_number("max_value", max_value, low=-math.inf)
    if low > high:
        raise InvalidArgumentError(
            f"Expected min_value <= max_value. Received: min_value={low}, max_value={high}"
        )
    be, leaves, treedef, _, _, _ = _float_leaves(tree, backend)
    return unflatten(treedef, [None if x is None else _clip(be, x, low, high) for x in leaves])


def _clip(be: Backend, x: Array, low: float, high: float) -> Array:
    """One leaf clamped to the bounds, each first brought into the leaf dtype's range and
    rounded to it once (``rounded_once``)."""
    dtype = be.dtype_name(x)
    return be.clip(
        x, rounded_once(in_range(low, dtype), dtype), rounded_once(in_range(high, dtype), dtype)
    )


#: (significand bits with the implicit one, exponent of the smallest normal) of the 16-bit
#: floats whose Python bounds the frameworks round through float32
_HALF_FORMATS = {"float16": (11, -14), "bfloat16": (8, -126)}


def rounded_once(value: float, dtype: str) -> float:
    """A finite ``value`` within ``dtype``'s range, rounded to the 16-bit ``dtype`` once, to
    nearest even; other dtypes' values as they are. torch, TensorFlow and JAX take a Python
    bound for a 16-bit array through float32 first (two roundings: ``1 + 2**-11 + 2**-40``
    became 1.0 in float16, not 1 + 2**-10), and NumPy's bfloat16 too; the value returned here
    is exact in the dtype, so their conversions keep it."""
    half = _HALF_FORMATS.get(dtype)
    if half is None or value == 0.0:
        return value
    bits, smallest_normal_exponent = half
    exponent = max(math.frexp(value)[1], smallest_normal_exponent + 1)  # subnormals: fixed
    spacing = math.ldexp(1.0, exponent - bits)  # of the dtype's values near ``value``
    return round(value / spacing) * spacing  # exact quotient (a power of 2); round: half even
