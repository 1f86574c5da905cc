"""NumPy float arrays: which samples hold NaN or inf, exactly, reading each value once.

``count_nonzero(isfinite(x))`` writes a boolean temporary as large as ``x`` and reads it
back. A per-sample sum, ``np.einsum("ij->i", rows)`` (NumPy's own vectorised loop: no BLAS,
whose thread pool measured up to 30x slower between other work on a 2-core machine, and no
floating-point error flags), reads ``x`` once and writes one value per row. A sum is finite
only when every term is: NaN and inf propagate through addition (inf - inf is NaN), and no
IEEE addition turns them finite. So a finite row sum proves its row finite, and a
non-finite one marks a *suspect* row (a NaN/inf, or finite values whose sum overflows), which
alone is checked exactly with ``isfinite``. Both answers here are exact: overflow only costs
time, never a false "clean". ``find`` hands its suspects on to the counting (``Found``), so
a dirty batch is read once too.

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
    """Where the non-finite values of one float array of ``n`` samples are, as ``find``
    located them: ``flat``, their positions in C order of ``part`` (the array itself, or the
    suspect rows of its 2-D view ``_rows``). The value at position ``p`` belongs to row
    ``p // width`` of ``part``, mapped through ``owner`` (``part``'s rows in that view) when
    given, and to sample ``row % n``. Read two ways, each only when asked: ``sparse()``, a
    Python pair per value (a few values: no NumPy call but ``tolist``); ``counts()``, the dense
    per-sample ``Counts`` (computed once)."""

    __slots__ = ("_counts", "flat", "n", "owner", "part", "width")

    def __init__(self, flat: Any, part: np.ndarray, width: int, owner: Any, n: int) -> None:
        self.flat, self.part, self.width, self.owner, self.n = flat, part, width, owner, n
        self._counts = None

    @property
    def size(self) -> int:
        """The number of non-finite values."""
        return len(self.flat)

    def sparse(self) -> list[tuple[int, bool]]:
        """``(sample, is NaN)`` of each non-finite value, in C order."""
        part, width, n = self.part, self.width, self.n
        flat = self.flat if type(self.flat) is list else self.flat.tolist()
        owner = None if self.owner is None else self.owner.tolist()
        out = []
        for p in flat:
            row = p // width if owner is None else owner[p // width]
            value = part.item(p)
            out.append((row % n, value != value))
        return out

    def counts(self) -> Counts:
        if self._counts is None:
            flat, n = np.asarray(self.flat, dtype=np.intp), self.n
            samples = flat // self.width
            if self.owner is not None:
                samples = self.owner[samples]
            samples %= n
            nan = np.isnan(self.part.flat[flat])
            bad = np.bincount(samples, minlength=n).astype(np.int32)
            self._counts = bad, np.bincount(samples[nan], minlength=n).astype(np.int32)
        return self._counts


def find(a: np.ndarray, axis: int) -> Found | None:
    """None iff every value of the float array ``a`` is finite (exact); else where its
    non-finite values are, along ``axis < a.ndim``, located from what the check found (the
    ``isfinite`` mask, or on the summed route the suspect rows), so ``a`` is read once either
    way. Suspects that are all finite (sums that overflow) find nothing, and a batch of only
    those is clean."""
    if a.size < SUM_MIN_SIZE or (rows := _rows(a, axis)) is None:  # small: no call more
        finite = np.isfinite(a)
        finite_count = np.count_nonzero(finite)
        if finite_count == a.size:
            return None
        return mask_found(a, axis, finite, a.size - finite_count)
    owner = _suspects(rows)
    if owner.size == 0:
        return None
    part = rows[owner]
    flat = (~np.isfinite(part)).ravel().nonzero()[0]
    return Found(flat, part, part.shape[1], owner, a.shape[axis]) if flat.size else None


def mask_found(a: np.ndarray, axis: int, finite: np.ndarray, count: int = 0) -> Found:
    """``find``'s answer for ``a`` from its ``isfinite`` mask ``finite`` (not all true).
    ``count``: the number of non-finite values, when known; one is located by ``argmin``
    (the first False in C order), with no inverted mask (0.25 against 1.6 us at 256 x 32)."""
    flat = [int(finite.argmin())] if count == 1 else (~finite).ravel().nonzero()[0]
    width = max(1, math.prod(a.shape[axis + 1 :]))
    return Found(flat, a, width, None, a.shape[axis])


def sample_counts(a: np.ndarray, axis: int) -> Counts:
    """Per-sample (non-finite, NaN) counts along ``axis < a.ndim``, as int32 vectors: the
    values of ``_fields.nonfinite_counts`` and ``_fields.nan_counts``. Only the non-finite
    values are located (``flatnonzero``) and attributed to their samples (``bincount``): no
    reduction over every sample, whose per-row loops cost ~10 us even at 256 x 32."""
    rows = _rows(a, axis)
    if rows is None:
        return mask_found(a, axis, np.isfinite(a)).counts()
    owner = _suspects(rows)  # the summed route: the suspect rows only
    part = rows[owner]
    flat = (~np.isfinite(part)).ravel().nonzero()[0]
    return Found(flat, part, part.shape[1], owner, a.shape[axis]).counts()


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
