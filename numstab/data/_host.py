"""NumPy float arrays: which samples hold NaN or inf, exactly, reading each value once.

``count_nonzero(isfinite(x))`` writes a boolean temporary as large as ``x`` and reads it
back. A per-sample sum, ``np.einsum("ij->i", rows)`` (NumPy's own vectorised loop: no BLAS,
whose thread pool measured up to 30x slower between other work on a 2-core machine, and no
floating-point error flags), reads ``x`` once and writes one value per row. A sum is finite
only when every term is: NaN and inf propagate through addition (inf - inf is NaN), and no
IEEE addition turns them finite. So a finite row sum proves its row finite, and a
non-finite one marks a *suspect* row (a NaN/inf, or finite values whose sum overflows), which
alone is checked exactly with ``isfinite``. Both answers here are exact: overflow only costs
time, never a false "clean". ``screen`` hands its suspects on to the counting, so a dirty
batch is read once too.

The sums pay off for C-contiguous float32/float64 arrays of at least ``SUM_MIN_SIZE`` values
in rows (the values after the batch axis) of at least ``SUM_MIN_ROW``: ``einsum`` has a
fixed cost of ~4 us and a per-row one. Measured with timeit on a 2-core AMD EPYC (numpy 2.4,
2026-12-03), float32 rows of 12288 values: 2.7 vs 5.1 us at 12288 values, break-even at
~60000, 662 vs 313 us at 4.2M; rows of 32 values: ``isfinite`` faster at every size up to 1M.
One whole-batch sum (``np.add.reduce``, pairwise) is no faster: 627 vs 251 us for the
per-row ``einsum`` on a 256 x 3 x 64 x 64 float32 batch (median of 30, 2026-12-03).
Smaller arrays, float16 (its sums overflow at 65504), other layouts and dtypes take the
plain ``isfinite`` route.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

SUM_MIN_SIZE = 1 << 16
SUM_MIN_ROW = 256
_SUMMED = (np.dtype(np.float32), np.dtype(np.float64))

Counts = tuple[np.ndarray, np.ndarray]


def _rows(a: np.ndarray, axis: int) -> np.ndarray | None:
    """A 2-D view of ``a`` whose row ``r`` holds values of sample ``r % a.shape[axis]``
    only (C order: the rows are the values after ``axis``), or None where per-row sums do
    not pay off (see the module docstring). ``axis < a.ndim``."""
    if a.size < SUM_MIN_SIZE or a.dtype not in _SUMMED or not a.flags.c_contiguous:
        return None
    width = math.prod(a.shape[axis + 1 :])
    return a.reshape(-1, width) if width >= SUM_MIN_ROW else None


def _suspects(rows: np.ndarray) -> np.ndarray:
    """Indices of the rows whose sum is not finite: every row holding a NaN or inf, and
    finite rows whose sum overflows."""
    return np.flatnonzero(~np.isfinite(np.einsum("ij->i", rows)))


def all_finite(a: np.ndarray) -> bool:
    """True iff every value of the float array ``a`` is finite (exact; any shape)."""
    return np.count_nonzero(np.isfinite(a)) == a.size


class Found:
    """The non-finite values of one float array of ``n`` samples, as ``find`` located them:
    ``samples[k]``, the sample holding the k-th (in C order), ``nan[k]`` whether it is a NaN.
    ``counts()``: the dense per-sample ``Counts`` (two ``bincount``), computed once, only
    when asked (the short way of a dirty batch works from the sparse form)."""

    __slots__ = ("_counts", "n", "nan", "samples")

    def __init__(self, samples: np.ndarray, nan: np.ndarray, n: int) -> None:
        self.samples, self.nan, self.n, self._counts = samples, nan, n, None

    def counts(self) -> Counts:
        if self._counts is None:
            samples, n = self.samples, self.n
            bad = np.bincount(samples, minlength=n).astype(np.int32)
            self._counts = bad, np.bincount(samples[self.nan], minlength=n).astype(np.int32)
        return self._counts


def find(a: np.ndarray, axis: int) -> Found | None:
    """None iff every value of the float array ``a`` is finite (exact); else where its
    non-finite values are, along ``axis < a.ndim``, located from what the check found (the
    ``isfinite`` mask, or on the summed route the suspect rows), so ``a`` is read once either
    way. Suspects that are all finite (sums that overflow) find nothing, and a batch of only
    those is clean."""
    if a.size < SUM_MIN_SIZE or (rows := _rows(a, axis)) is None:  # small: no call more
        finite = np.isfinite(a)
        if np.count_nonzero(finite) == a.size:
            return None
        return mask_found(a, axis, finite)
    owner = _suspects(rows)
    if owner.size == 0:
        return None
    found = _locate(rows[owner], 0, a.shape[axis], owner=owner)
    return found if found.samples.size else None


def mask_found(a: np.ndarray, axis: int, finite: np.ndarray) -> Found:
    """``find``'s answer for ``a`` from its ``isfinite`` mask ``finite`` (not all true)."""
    return _locate(a, axis, a.shape[axis], bad=~finite)


def screen(a: np.ndarray, axis: int) -> Counts | None:
    """``find``, as dense per-sample ``sample_counts`` (None iff ``a`` is all finite)."""
    found = find(a, axis)
    return None if found is None else found.counts()


def sample_counts(a: np.ndarray, axis: int) -> Counts:
    """Per-sample (non-finite, NaN) counts along ``axis < a.ndim``, as int32 vectors: the
    values of ``_fields.nonfinite_counts`` and ``_fields.nan_counts``. Only the non-finite
    values are located (``flatnonzero``) and attributed to their samples (``bincount``): no
    reduction over every sample, whose per-row loops cost ~10 us even at 256 x 32."""
    rows = _rows(a, axis)
    if rows is None:
        return _locate(a, axis, a.shape[axis]).counts()
    owner = _suspects(rows)  # the summed route: the suspect rows only
    return _locate(rows[owner], 0, a.shape[axis], owner=owner).counts()


def _locate(
    part: np.ndarray,
    axis: int,
    n: int,
    owner: np.ndarray | None = None,
    bad: np.ndarray | None = None,
) -> Found:
    """The non-finite values of ``n`` samples in ``part``: the whole array, samples along
    ``axis``; or, with ``owner``, the rows ``owner`` of ``_rows`` (``axis`` 0: row ``i`` of
    ``part`` is row ``owner[i]``, of sample ``owner[i] % n``). ``bad``: the mask
    ``~isfinite(part)`` when the caller has it."""
    if bad is None:
        bad = ~np.isfinite(part)
    # the non-finite values' positions in C order of the logical shape (``ravel`` copies only
    # a non-C-contiguous mask), read back through ``flat`` in that same order: no
    # ``unravel_index`` (~3 us), no ``flatnonzero`` wrapper (~1.5 us)
    flat = bad.ravel().nonzero()[0]
    shape = part.shape
    samples = flat // max(1, math.prod(shape[axis + 1 :]))
    if owner is not None:
        samples = owner[samples] % n
    elif axis:
        samples %= shape[axis]
    return Found(samples, np.isnan(part.flat[flat]), n)


# -- TensorFlow eager tensors in host memory --------------------------------------------------
def tf_view(node: Any) -> np.ndarray | None:
    """A zero-copy NumPy view of a float16/32/64 TensorFlow eager tensor held in host memory,
    else None. ``np.asarray`` reads the tensor's buffer in place (``EagerTensor.__array__``;
    ``.numpy()`` would copy it). Tensors on a GPU or another device, variables, bfloat16 and
    graph tensors keep their backend's path (a sum on their device, no copy to the host)."""
    eager, floats, _ = tf_types()
    if type(node) is not eager or node._datatype_enum() not in floats:
        return None
    if _on_host(node.backing_device):  # where its memory is, whichever device made it
        return np.asarray(node)
    return None


def _on_host(device: str) -> bool:
    """True for a TensorFlow device name of the host CPU (``.../device:CPU:0``)."""
    return ":CPU:" in device


@functools.cache
def tf_types() -> tuple[type, frozenset, frozenset]:
    """EagerTensor, and the dtype enums read in place or never read (TensorFlow's data code)."""
    from numstab import frameworks

    return frameworks.module("tensorflow", "data").eager_types()
