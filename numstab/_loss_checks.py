"""The argument checks of the cross-entropy functions (losses, fused_cross_entropy): each
raises an ``InvalidArgumentError`` naming the argument and what was wrong."""

from __future__ import annotations

from typing import Any

from numstab import _validate as v
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
        if host.dtype.kind in "iu" and _holds(np.iinfo(host.dtype), ignore_index):
            bad &= host != ignore_index  # else no label can equal it
        allowed += f" or equal to ignore_index={ignore_index}"
    positions = np.argwhere(bad)
    first = tuple(int(i) for i in positions[0])
    index = ", ".join(map(str, first))
    raise InvalidArgumentError(
        f"Expected labels in {allowed}. "
        f"Received: labels[{index}]={host[first]} ({len(positions)} label(s) out of range)"
    )


def _holds(info: Any, value: int) -> bool:
    return int(info.min) <= value <= int(info.max)


#: the bounds of ``Backend.index_dtype``, the dtype every label is cast to
_INDEX_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def matchable_ignore_index(be: Backend, ignore_index: int) -> int | None:
    """``ignore_index`` when a label of ``be.index_dtype`` can equal it, else None: nothing is
    ignored, and the comparison is left out. (A Python int outside the dtype overflows when
    compared with a tensor: JAX's int32, torch's and TensorFlow's int64 arguments, under
    jit / torch.compile / tf.function too.)"""
    low, high = _INDEX_BOUNDS[be.index_dtype]
    return ignore_index if low <= ignore_index <= high else None


def required(name: str, x: Any) -> Any:
    if x is None:
        raise InvalidArgumentError(f"Expected {name} to be an array. Received: {name}=None")
    return x
