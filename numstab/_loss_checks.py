"""The argument checks of the cross-entropy functions (losses, fused_cross_entropy): each
raises an ``InvalidArgumentError`` naming the argument and what was wrong."""

from __future__ import annotations

from typing import Any

from numstab import _validate as v
from numstab._dispatch import HOST, framework_of, to_backend
from numstab.backends import load_backend
from numstab.backends._base import Array, Backend
from numstab.errors import InvalidArgumentError


def class_count(be: Backend, x: Array, name: str, axis: int, shape: tuple) -> int:
    """The static, non-zero length of the class axis (moved last in ``x``)."""
    count = be.shape(x)[-1]
    if count is None:
        raise InvalidArgumentError(
            f"Expected a static number of classes on axis {axis}. Received: {name}.shape={shape}"
        )
    if count == 0:
        raise InvalidArgumentError(
            f"Expected at least one class on axis {axis}. Received: {name}.shape={shape}"
        )
    return count


def check_label_shape(
    label_shape: tuple, expected: tuple, logits_shape: tuple, what: str, dtype: str = ""
) -> None:
    if not v.shapes_match(label_shape, expected):
        hint = ""
        if dtype and v.shapes_match(label_shape, logits_shape[:-1]):  # float class ids?
            hint = f", labels.dtype={dtype} (class ids must have an integer dtype)"
        raise InvalidArgumentError(
            f"Expected {what} {expected} for logits of shape {logits_shape}. "
            f"Received: labels.shape={label_shape}{hint}"
        )


def raise_out_of_range(
    be: Backend, labels: Array, num_classes: int, ignore_index: int | None
) -> None:
    import numpy as np  # only on this error path: importing numstab does not import numpy

    host = be.to_numpy(labels)
    bad = (host < 0) | (host >= num_classes)
    allowed = f"[0, {num_classes})"
    if ignore_index is not None:
        if host.dtype.kind in "iu" and _fits(host.dtype.name, ignore_index):
            bad &= host != ignore_index  # else no label can equal it
        allowed += f" or equal to ignore_index={ignore_index}"
    positions = np.argwhere(bad)
    first = tuple(int(i) for i in positions[0])
    index = ", ".join(map(str, first))
    raise InvalidArgumentError(
        f"Expected labels in {allowed}. "
        f"Received: labels[{index}]={host[first]} ({len(positions)} label(s) out of range)"
    )


#: (min, max) of each integer dtype: a plain table, not a cache (torch.compile warns on every
#: compile about a functools.lru_cache-wrapped function)
_INT_BOUNDS = {f"int{n}": (-(2 ** (n - 1)), 2 ** (n - 1) - 1) for n in (8, 16, 32, 64)}
_INT_BOUNDS.update({f"uint{n}": (0, 2**n - 1) for n in (8, 16, 32, 64)})


def int_bounds(dtype: str) -> tuple[int, int]:
    """(min, max) of the integer dtype named ``dtype``."""
    bounds = _INT_BOUNDS.get(dtype)
    if bounds is None:  # an integer dtype of another name (none known): NumPy's bounds
        import numpy as np

        info = np.iinfo(dtype)
        bounds = int(info.min), int(info.max)
    return bounds


def _fits(dtype: str, value: int) -> bool:
    """Whether the integer dtype ``dtype`` holds ``value``."""
    low, high = int_bounds(dtype)
    return low <= value <= high


def to_labels(be: Backend, labels: Any, like: Any = None, ignore_index: int | None = None) -> Array:
    """``labels`` as an array of ``be`` (``to_backend``). Host integer ids go through
    ``class_ids``' rule first, on the host: JAX without x64 converts int64 to int32 by
    wrapping around."""
    labels = required("labels", labels)
    if be.index_dtype == "int32" and framework_of(labels) == HOST:
        kind = getattr(getattr(labels, "dtype", None), "kind", None)
        if kind in ("i", "u") and labels.dtype.name != "int32":
            labels = class_ids(load_backend("numpy"), labels, "int32", ignore_index)
    return to_backend(be, labels, like=like, name="labels")


def class_ids(
    be: Backend, labels: Array, index_dtype: str | None = None, ignore_index: int | None = None
) -> Array:
    """Integer ``labels`` as ``index_dtype`` (the backend's by default). Where that is int32
    (JAX), a wider label (int64, uint32, uint64) saturates to int32's bounds instead of
    wrapping around: a corrupt id 2**32 + 7 stays out of range (it became the valid class 7).
    Where a bound is ``ignore_index``, ids past it saturate one step inside it (2**40 became
    ``ignore_index=2**31 - 1``: a silently ignored row), still out of range of any vocabulary
    a row can hold; an id equal to it stays itself. Where the index dtype is int64 only
    uint64 is wider; ids >= 2**63 wrap to negative ones, out of range too (torch has no
    comparison or clip for uint64)."""
    index_dtype = index_dtype or be.index_dtype
    dtype = be.dtype_name(labels)
    if dtype == index_dtype:
        return labels
    low, high = int_bounds(dtype)
    index_low, index_high = int_bounds(index_dtype)
    if index_dtype == "int32" and (low < index_low or high > index_high):
        clipped = be.clip(labels, max(low, index_low), min(high, index_high))
        if high > index_high == ignore_index:  # a real ignore_index there stays itself
            clipped = be.where(labels > index_high, index_high - 1, clipped)
        if low < index_low == ignore_index:
            clipped = be.where(labels < index_low, index_low + 1, clipped)
        labels = clipped
    return be.cast(labels, index_dtype)


def matchable_ignore_index(be: Backend, ignore_index: int) -> int | None:
    """``ignore_index`` when a label of ``be.index_dtype`` can equal it, else None: nothing is
    ignored, and the comparison is left out. (A Python int outside the dtype overflows when
    compared with a tensor: JAX's int32, torch's and TensorFlow's int64 arguments, under
    jit / torch.compile / tf.function too.)"""
    return ignore_index if _fits(be.index_dtype, ignore_index) else None


def required(name: str, x: Any) -> Any:
    if x is None:
        raise InvalidArgumentError(f"Expected {name} to be an array. Received: {name}=None")
    return x
