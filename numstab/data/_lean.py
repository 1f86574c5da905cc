"""The short way through a dirty batch: the same records, stats and output as the general
path of ``Firewall.process``, in a few NumPy calls.

It takes a batch the fast path found dirty (``_fast.SUSPECT``) under ``"drop"`` or
``"replace"``, with no outlier filter and no quarantine, when every floating field has a batch
axis and is readable in host memory (``_fields._readable``: NumPy arrays, CPU torch tensors,
host TensorFlow eager tensors). Each floating field is read once, by ``_host.screen`` (or its
counts come from the fast path's own read), and the flagged samples are found from those
per-sample counts alone: no BatchReport, no per-field dataclasses, no second pass. Anything
else answers ``UNHANDLED`` before touching the stats, and the general path decides.
Measured on a dirty 256 x 32 float32 + int64 dict batch (2-core shared machine, load ~4,
2026-12-04): ~135 us through the general path, ~35 us this way in the benchmark's loop
(~20 us hot); see ``_fast``'s docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from numstab.backends import load_backend
from numstab.data._fields import Batch, _readable, compress
from numstab.data._host import screen
from numstab.data.stats import SampleRecord

if TYPE_CHECKING:
    from numstab.data.firewall import Firewall

#: ``handle``'s answer when the batch needs the general path (nothing was changed)
UNHANDLED = object()


def dirty_counts(parts: Batch, batch_axis: int) -> list | None:
    """``(field, non-finite counts, NaN counts)`` of every floating field holding a NaN or
    inf, in flatten order; None when some floating field has no batch axis or is not
    readable in host memory (the general path counts those)."""
    dirty = []
    for field in parts.fields:
        if field.kind != "float":
            continue
        if not field.batched:
            return None
        counts = field.counts
        if counts is None:
            view = _readable(field.value)
            if view is None:
                return None
            counts = screen(view, batch_axis)
            if counts is None:  # finite (or only sums that overflow)
                continue
            field.counts = counts
        if counts[0].any():
            dirty.append((field, counts[0], counts[1]))
    return dirty


def handle_flat(fw: Firewall, batch: Any, counted: list) -> Any:
    """``handle`` for a batch that is a dict, list or tuple of NumPy arrays (or one array),
    every one with a batch axis, straight from the fast path's read: ``counted`` holds every
    dirty array (``_fast.clean_batch_size``), so no field is split or read again. Counts the
    batch as seen; ``UNHANDLED`` (stats untouched) for any other batch."""
    cls, axis = type(batch), fw.batch_axis
    if cls is dict:
        leaves = list(batch.values())
    elif cls is list or cls is tuple:
        leaves = batch
    elif cls is np.ndarray:
        leaves = (batch,)
    else:
        return UNHANDLED
    if not counted or not all(type(x) is np.ndarray and x.ndim > axis for x in leaves):
        return UNHANDLED
    # ``counted`` lists the dirty children in order (one entry per child, even for one array
    # held twice), so each is matched to the next child that is that very array
    names = list(batch) if cls is dict else range(len(leaves))
    dirty, pending = [], iter(counted)
    leaf, (bad, nan) = next(pending)
    for name, x in zip(names, leaves, strict=True):
        if x is leaf:
            path = "<batch>" if cls is np.ndarray else f"[{name!r}]"
            dirty.append((path, bad, nan))
            leaf, (bad, nan) = next(pending, (None, (None, None)))
    stats, n = fw.stats, leaves[0].shape[axis]
    first_index, number = stats.samples_seen, fw._batch_in_epoch
    stats.samples_seen += n
    stats.batches_seen += 1
    fw._batch_in_epoch += 1
    keep, bad_values = _record(fw, dirty, first_index, number)
    if fw.policy == "replace":
        be, bad_ids = load_backend("numpy"), {id(leaf) for leaf, _ in counted}
        values = [
            be.where(be.isfinite(x), x, fw.replace_value) if id(x) in bad_ids else x for x in leaves
        ]
        stats.replaced_values += bad_values
        kept = n
    else:
        values = [x.compress(keep, axis=axis) for x in leaves]
        kept = int(np.count_nonzero(keep))
    stats.samples_passed += kept
    if kept == 0 and not fw.keep_empty:
        stats.batches_skipped += 1
        return None
    if cls is dict:
        return dict(zip(batch, values, strict=True))
    return cls(values) if cls is not np.ndarray else values[0]


def handle(fw: Firewall, batch: Any, parts: Batch, first_index: int, number: int) -> Any:
    """The batch after ``fw``'s policy (``"drop"`` or ``"replace"``), with its flagged samples
    recorded as the general path records them; ``UNHANDLED`` (stats untouched) when
    ``dirty_counts`` cannot count it. ``first_index``/``number``: the batch's first global
    sample index and its number in the epoch (the caller has counted the batch as seen)."""
    dirty = dirty_counts(parts, fw.batch_axis)
    if dirty is None:
        return UNHANDLED
    stats, n = fw.stats, parts.size
    if not dirty:  # every suspect was a finite sum that overflowed
        stats.samples_passed += n
        return batch
    labelled = [(f.label, bad, nan) for f, bad, nan in dirty]
    keep, bad_values = _record(fw, labelled, first_index, number)
    if fw.policy == "replace":
        bad_ids = {id(f) for f, _, _ in dirty}
        values = [
            _replaced(f, fw.replace_value) if id(f) in bad_ids else f.value for f in parts.fields
        ]
        stats.replaced_values += bad_values
        stats.samples_passed += n
        return parts.rebuild(values)
    kept = int(np.count_nonzero(keep))
    stats.samples_passed += kept
    if kept == 0 and not fw.keep_empty:
        stats.batches_skipped += 1
        return None
    return parts.rebuild([compress(f, f.value, keep, fw.batch_axis) for f in parts.fields])


def _record(fw: Firewall, dirty: list, first_index: int, number: int) -> tuple[Any, int]:
    """A SampleRecord per flagged sample and the NaN/inf totals, as ``Firewall._record``
    writes them, from ``dirty``: ``(label, non-finite counts, NaN counts)`` per dirty field
    in flatten order. Returns the mask of the samples kept by a drop, and the number of
    non-finite values."""
    total = dirty[0][1]
    for _, bad, _ in dirty[1:]:
        total = total + bad
    flagged = total.nonzero()[0]
    # the counts at the flagged samples only (every other count is 0), as Python ints
    per_field = [(label, bad[flagged].tolist(), nan[flagged].tolist()) for label, bad, nan in dirty]
    stats = fw.stats
    action = "dropped" if fw.policy == "drop" else "replaced"
    records, epoch = stats.records, fw._epoch
    nan_values = bad_values = 0
    for j, i in enumerate(flagged.tolist()):
        fields, nan, bad = [], 0, 0
        for label, bads, nans in per_field:
            if bads[j]:
                fields.append(label)
                bad += bads[j]
                nan += nans[j]
        where = (first_index + i, epoch, number, i)
        records.append(SampleRecord(*where, "nonfinite", action, tuple(fields), nan, bad - nan))
        nan_values += nan
        bad_values += bad
    stats.nan_values += nan_values
    stats.inf_values += bad_values - nan_values
    return total == 0, bad_values


def _replaced(field: Any, value: float) -> Any:
    be, x = field.backend, field.value
    return be.where(be.isfinite(x), x, value)
