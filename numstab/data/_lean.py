"""The short way through a dirty batch: the same records, stats and output as the general
path of ``Firewall.process``, in a few NumPy calls.

It takes a batch the fast path found dirty (``_fast.SUSPECT``) under ``"drop"`` or
``"replace"``, with no outlier filter and no quarantine, when every floating field has a batch
axis and is readable in host memory (``_fields._readable``: NumPy arrays, CPU torch tensors,
host TensorFlow eager tensors). Each floating field is read once, by ``_host.find`` (or its
non-finite values come located from the fast path's own read), and the flagged samples and
their records come from those values alone (``_host.Found``, sparse: no per-sample count
vector, no BatchReport, no second pass). A drop gathers the kept samples once per field
(NumPy ``take``, torch ``index_select``) with one index shared by every field. Anything else
answers ``UNHANDLED`` before touching the stats, and the general path decides.

Per dirty 256 x 32 float32 + int64 dict batch it costs ~10 us hot against ~8 for the
benchmark's drop floor (the read, the kept rows, two ``take``), where the general path takes
~135 (``docs/performance.md`` §4; the steps that got it there are in this file's history).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from numstab import frameworks
from numstab.backends import load_backend
from numstab.backends._base import numpy_dtype_name
from numstab.data._fields import Batch, _readable, compress, replaced
from numstab.data._host import Found, find
from numstab.data.stats import new_record

if TYPE_CHECKING:
    from numstab.data.firewall import Firewall

#: ``handle``'s answer when the batch needs the general path (nothing was changed)
UNHANDLED = object()
#: up to this many non-finite values in a batch, records are built from the sparse positions
#: (a Python loop per value); above it from dense per-sample counts (a whole-NaN batch)
SPARSE_MAX = 32


def handle_flat(fw: Firewall, batch: Any, counted: list) -> Any:
    """``handle`` for a batch that is a dict, list or tuple of arrays (or one array), every
    one with a batch axis: NumPy arrays, straight from the fast path's read (``counted`` holds
    every dirty one, ``_fast.clean_batch_size``), or tensors a loaded framework's
    ``data.flat_leaf`` takes (CPU torch; drop only), read once here. Counts the batch as
    seen; ``UNHANDLED`` (stats untouched) for any other batch."""
    cls, axis = type(batch), fw.batch_axis
    if cls is dict:
        leaves = list(batch.values())
    elif cls is list or cls is tuple:
        leaves = batch
    elif cls is np.ndarray:
        leaves = (batch,)
    else:
        return UNHANDLED
    found = _flat_found(leaves, axis, counted, fw.policy == "replace")
    if found is None:
        return UNHANDLED
    at, takes = found
    keys = list(batch) if cls is dict else None
    dirty = []  # (label, Found); a loop, not a comprehension: one dirty leaf, mostly
    for k, f in at:
        label = "<batch>" if cls is np.ndarray else f"[{k if keys is None else keys[k]!r}]"
        dirty.append((label, f))
    fw.check_replaceable(
        (label, numpy_dtype_name(leaves[k].dtype))
        for (k, _), (label, _) in zip(at, dirty, strict=True)
    )
    stats, n = fw.stats, leaves[0].shape[axis]
    first_index, number = stats.samples_seen, fw._batch_in_epoch
    stats.samples_seen += n
    stats.batches_seen += 1
    if not dirty:  # every suspect was a finite sum that overflowed
        stats.samples_passed += n
        return batch
    flagged, bad_values = _record(fw, dirty, first_index, number)
    if fw.policy == "replace":  # NumPy leaves only (``_flat_found``)
        be, values = load_backend("numpy"), list(leaves)
        for k, _ in at:
            x = values[k]
            values[k] = be.where(be.isfinite(x), x, fw.replace_value)
        stats.replaced_values += bad_values
        kept = n
    else:
        idx = _kept(n, flagged)
        if takes is None:  # NumPy leaves only
            values = [x.take(idx, axis=axis) for x in leaves]
        else:
            values, index = [], {}
            for x, gather in zip(leaves, takes, strict=True):
                if gather is None:
                    values.append(x.take(idx, axis=axis))
                    continue
                if gather not in index:  # one conversion of the index per framework
                    index[gather] = gather.index(idx)
                values.append(gather.take(x, index[gather], axis))
        kept = n - len(flagged)
    stats.samples_passed += kept
    if kept == 0 and not fw.keep_empty:
        stats.batches_skipped += 1
        return None
    if cls is dict:
        return dict(zip(keys, values, strict=True))
    return cls(values) if cls is not np.ndarray else values[0]


def _flat_found(
    leaves: Any, axis: int, counted: list, numpy_only: bool
) -> tuple[list, list | None] | None:
    """``(dirty, takes)``: ``(k, Found)`` for each leaf ``k`` holding a NaN or inf, in order,
    and per leaf its gather (None: NumPy's ``take``; else ``index(positions)`` once, then
    ``take(x, index, axis)``), ``takes`` itself None when every leaf is NumPy. None when a
    leaf is neither a batched NumPy array nor taken by a loaded framework's
    ``data.flat_leaf`` (or, with ``numpy_only``, not NumPy)."""
    # ``counted`` lists the dirty NumPy children in order (one entry per child, even for one
    # array held twice), so each is matched to the next child that is that very array; the
    # fast path read every NumPy child, so the others are clean or exact
    pending = iter(counted)
    leaf, found = next(pending, (None, None))
    dirty, takes, hooks = [], None, None
    for k, x in enumerate(leaves):
        if type(x) is np.ndarray:
            if x.ndim <= axis:
                return None
            if x is leaf:
                dirty.append((k, found))
                leaf, found = next(pending, (None, None))
            continue
        if numpy_only:
            return None
        hooks = hooks or frameworks.loaded("data", "flat_leaf")
        for hook in hooks:
            got = hook(x, axis)
            if got is not None:
                break
        else:
            return None
        view, take = got
        if view is not None and (tensor_found := find(view, axis)) is not None:
            dirty.append((k, tensor_found))
        if takes is None:
            takes = [None] * len(leaves)
        takes[k] = take
    return dirty, takes


def _kept(n: int, flagged: list) -> np.ndarray:
    """The positions of the ``n`` samples not in ``flagged``, in order. The all-true mask
    starts as a copy of a cached one (``np.ones`` is a Python function: 1.3-1.6 against
    0.5 us for the whole of this at 256 with one flagged, timeit, 2026-12-04). A few
    flagged are set one by one: converting the list to an index array costs more (1.4 vs
    2.0 us for one)."""
    keep = _ALL_KEPT.get(n)
    if keep is None:
        if len(_ALL_KEPT) >= _ALL_KEPT_MAX:  # a stream of ever-changing batch sizes
            _ALL_KEPT.clear()
        keep = _ALL_KEPT[n] = np.ones(n, dtype=bool)
    keep = keep.copy()
    if len(flagged) > 8:
        keep[flagged] = False
    else:
        for i in flagged:
            keep[i] = False
    return keep.nonzero()[0]


#: all-true masks by batch size, copied by ``_kept`` (never written in place)
_ALL_KEPT: dict[int, np.ndarray] = {}
_ALL_KEPT_MAX = 16


def dirty_found(parts: Batch, batch_axis: int, counted: list) -> list | None:
    """``(field, Found)`` of every floating field holding a NaN or inf, in flatten order
    (``counted``: the fast path's ``(leaf, Found)``, reused by identity); None when some
    floating field has no batch axis or is not readable in host memory (the general path
    counts those)."""
    dirty = []
    for field in parts.fields:
        if field.kind != "float":
            continue
        if not field.batched:
            return None
        found = next((f for leaf, f in counted if leaf is field.value), None)
        if found is None:
            view = None if field.composite is not None else _readable(field.value)
            if view is None:  # (a ragged or sparse field: the general path counts it)
                return None
            found = find(view, batch_axis)
            if found is None:  # finite (or only sums that overflow)
                continue
        dirty.append((field, found))
    return dirty


def handle(fw: Firewall, batch: Any, parts: Batch, counted: list) -> Any:
    """The batch after ``fw``'s policy (``"drop"`` or ``"replace"``), with its flagged samples
    recorded as the general path records them, counted as seen once ``replace_value`` was
    checked (``Firewall.count_batch``: a rejected batch leaves the stats as they were);
    ``UNHANDLED`` (stats untouched) when ``dirty_found`` cannot count it."""
    dirty = dirty_found(parts, fw.batch_axis, counted)
    if dirty is None:
        return UNHANDLED
    stats, n = fw.stats, parts.size
    fw.check_replaceable((f.label, f.dtype) for f, _ in dirty)
    first_index, number = fw.count_batch(n)
    if not dirty:  # every suspect was a finite sum that overflowed
        stats.samples_passed += n
        return batch
    flagged, bad_values = _record(fw, [(f.label, found) for f, found in dirty], first_index, number)
    if fw.policy == "replace":
        bad_ids = {id(f) for f, _ in dirty}
        values = [
            replaced(f, fw.replace_value) if id(f) in bad_ids else f.value for f in parts.fields
        ]
        stats.replaced_values += bad_values
        stats.samples_passed += n
        return parts.rebuild(values)
    kept = n - len(flagged)
    stats.samples_passed += kept
    if kept == 0 and not fw.keep_empty:
        stats.batches_skipped += 1
        return None
    keep = np.ones(n, dtype=bool)
    keep[flagged] = False
    return parts.rebuild([compress(f, f.value, keep, fw.batch_axis) for f in parts.fields])


def _record(
    fw: Firewall, dirty: list[tuple[str, Found]], first_index: int, number: int
) -> tuple[list[int], int]:
    """A SampleRecord per flagged sample and the NaN/inf totals, as ``Firewall._record``
    writes them, from ``dirty``: ``(label, Found)`` per dirty field in flatten order. Returns
    the flagged positions, in increasing order, and the number of non-finite values.

    One non-finite value in the batch (the common dirty batch) takes a few lines of its own:
    in the loader's loop a dirty batch runs cold, where each Python step costs several times
    its hot time (median 57-63 against 12 us hot per dirty 256 x 32 batch, 2026-12-04)."""
    stats = fw.stats
    action = "dropped" if fw.policy == "drop" else "replaced"
    if len(dirty) == 1 and dirty[0][1].size == 1:
        label, found = dirty[0]
        ((i, is_nan),) = found.sparse()
        nan = 1 if is_nan else 0
        record = new_record(
            first_index + i, fw._epoch, number, i, "nonfinite", action, (label,), nan, 1 - nan
        )
        stats.records.append(record)
        stats.nan_values += nan
        stats.inf_values += 1 - nan
        return [i], 1
    per_sample = _per_sample(dirty)
    append, epoch = stats.records.append, fw._epoch
    nan_values = bad_values = 0
    flagged = sorted(per_sample)
    for i in flagged:
        fields, nan, bad = per_sample[i]
        where = (first_index + i, epoch, number, i)
        append(new_record(*where, "nonfinite", action, tuple(fields), nan, bad - nan))
        nan_values += nan
        bad_values += bad
    stats.nan_values += nan_values
    stats.inf_values += bad_values - nan_values
    return flagged, bad_values


def _per_sample(dirty: list[tuple[str, Found]]) -> dict[int, list]:
    """``{position: [labels, NaN values, non-finite values]}`` of every flagged sample, the
    labels in flatten order: from the sparse positions for a few values, else (a batch full
    of NaN) from the dense counts."""
    sparse = sum(f.size for _, f in dirty) <= SPARSE_MAX
    per_sample: dict[int, list] = {}
    for label, found in dirty:
        for i, nan, bad in _sparse_entries(found) if sparse else _dense_entries(found):
            entry = per_sample.get(i)
            if entry is None:
                per_sample[i] = [[label], nan, bad]
                continue
            if entry[0][-1] != label:
                entry[0].append(label)
            entry[1] += nan
            entry[2] += bad
    return per_sample


def _sparse_entries(found: Found) -> list:
    """``(sample, NaN values, non-finite values)`` per non-finite value (1 value each)."""
    return [(i, int(is_nan), 1) for i, is_nan in found.sparse()]


def _dense_entries(found: Found) -> Any:
    """``(sample, NaN values, non-finite values)`` per sample holding any."""
    bad, nan = found.counts()
    at = bad.nonzero()[0]
    return zip(at.tolist(), nan[at].tolist(), bad[at].tolist(), strict=True)
