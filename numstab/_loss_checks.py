"""The argument checks of the cross-entropy functions (losses, fused_cross_entropy): each
raises an ``InvalidArgumentError`` naming the argument and what was wrong."""

from __future__ import annotations

import functools
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


@functools.cache
def _int_bounds(dtype: str) -> tuple[int, int]:
    import numpy as np

    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _fits(dtype: str, value: int) -> bool:
    """Whether the integer dtype ``dtype`` holds ``value``."""
    low, high = _int_bounds(dtype)
    return low <= value <= high


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
