"""``check_batch``: which fields and samples of a batch hold NaN or inf, and how many.

Also ``nonfinite_per_sample``, the graph-safe core: one reduction per field, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from numstab._dispatch import resolve_backend, to_backend
from numstab.data._fields import (
    Batch,
    Field,
    check_batch_axis,
    nonfinite_counts,
    sample_counts,
    sample_nonfinite,
    split_batch,
    surely_finite,
)

Array = Any


@dataclass(frozen=True)
class FieldReport:
    """One floating field. ``bad_samples``: indices along the batch axis of the samples with
    a NaN or inf (every sample when a field without a batch axis is non-finite)."""

    path: str
    dtype: str
    shape: tuple
    nan_count: int
    inf_count: int
    bad_samples: tuple[int, ...]
    #: per-sample (non-finite, NaN) counts as NumPy vectors; None when clean or unbatched
    per_sample: tuple[np.ndarray, np.ndarray] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def ok(self) -> bool:
        return self.nan_count == 0 and self.inf_count == 0


@dataclass(frozen=True)
class BatchReport:
    """Per-field counts of non-finite values in one batch.

    ``fields``: every floating field in flatten order (clean ones too); ``skipped``: paths of
    the integer, bool and string fields, finite by definition, and of non-array leaves.
    """

    batch_size: int | None
    fields: tuple[FieldReport, ...]
    skipped: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.fields)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def nan_count(self) -> int:
        return sum(f.nan_count for f in self.fields)

    @property
    def inf_count(self) -> int:
        return sum(f.inf_count for f in self.fields)

    @property
    def bad_fields(self) -> tuple[FieldReport, ...]:
        return tuple(f for f in self.fields if not f.ok)

    @property
    def bad_samples(self) -> tuple[int, ...]:
        """Sorted indices of the samples with a non-finite value in any field."""
        return tuple(sorted({i for f in self.fields for i in f.bad_samples}))

    def __str__(self) -> str:
        if self.ok:
            return f"batch of {self.batch_size}: all {len(self.fields)} floating field(s) finite"
        lines = [
            f"batch of {self.batch_size}: {len(self.bad_samples)} sample(s) with non-finite "
            f"values ({self.nan_count} NaN, {self.inf_count} inf)"
        ]
        for f in self.bad_fields:
            shown = ", ".join(map(str, f.bad_samples[:10])) + (
                ", ..." if len(f.bad_samples) > 10 else ""
            )
            lines.append(
                f"  {f.path or '<batch>'} ({f.dtype}{list(f.shape)}): {f.nan_count} NaN, "
                f"{f.inf_count} inf in samples [{shown}]"
            )
        return "\n".join(lines)


def check_batch(batch: Any, *, batch_axis: int = 0, backend: str | None = None) -> BatchReport:
    """Count NaN and inf per floating field and per sample of a nested batch (eager).

    Each field is checked in its own framework (NumPy arrays with NumPy, never converted),
    so fields of two frameworks are accepted, as by ``Firewall.process``. ``backend=`` only
    asserts the framework (BackendMismatchError / MixedBackendsError as in
    docs/semantics.md §1.3). A clean batch costs one fused sum per field and one host sync.
    """
    batch_axis = check_batch_axis(batch_axis)
    parts = split_batch(batch, batch_axis)
    if backend is not None:
        resolve_backend(*[f.stored for f in parts.fields if f.backend is not None], backend=backend)
    return report_of(parts, batch_axis)


def report_of(parts: Batch, batch_axis: int, clean: bool | None = None) -> BatchReport:
    """The BatchReport of a split batch; ``clean=True`` skips the counting."""
    floats = parts.float_fields
    if clean is None:
        clean = surely_finite(floats, batch_axis)
    skipped = tuple(f.label for f in parts.fields if f.kind != "float")
    reports = tuple(_field_report(f, parts.size, batch_axis, clean) for f in floats)
    return BatchReport(parts.size, reports, skipped)


def _field_report(field: Field, size: int | None, batch_axis: int, clean: bool) -> FieldReport:
    be, x = field.backend, field.value
    shape = tuple(be.shape(x))
    if clean:
        return FieldReport(field.path, field.dtype, shape, 0, 0, ())
    axis = batch_axis if field.batched else None
    if axis is None:  # no batch axis: count the whole leaf, blame every sample
        values = be.to_numpy(field.stored)
        bad = int(np.sum(~np.isfinite(values)))
        nan = int(np.sum(np.isnan(values)))
        samples = tuple(range(size)) if bad and size else ()
        return FieldReport(field.path, field.dtype, shape, nan, bad - nan, samples)
    bad, nan = sample_nonfinite(field, axis)
    total, nans = int(bad.sum()), int(nan.sum())
    samples = tuple(np.flatnonzero(bad).tolist())
    return FieldReport(field.path, field.dtype, shape, nans, total - nans, samples, (bad, nan))


def nonfinite_per_sample(batch: Any, *, batch_axis: int = 0, backend: str | None = None) -> Array:
    """An int32 vector: the number of NaN/inf values of each sample over every floating
    field with a batch axis (``sum(~isfinite(x))`` over the other axes, one reduction per
    field), plus those of the floating fields without one (a 0-d array), which count
    against every sample as in ``check_batch``. Graph-safe: runs under jax.jit,
    tf.function, torch.compile and in tf.data functions. Host leaves are converted to the
    batch's framework (docs/semantics.md §1.3); integer and bool fields are skipped; ragged
    and sparse fields count their stored values. Needs at least one batched field.
    """
    from numstab.errors import InvalidArgumentError

    batch_axis = check_batch_axis(batch_axis)
    parts = split_batch(batch, batch_axis)
    arrays = [f.stored for f in parts.fields if f.backend is not None]
    be = resolve_backend(*arrays, backend=backend)
    like = next((x for x in arrays if hasattr(x, "device")), None)
    batched = [f for f in parts.fields if f.batched and f.backend is not None]
    if not batched:
        raise InvalidArgumentError(
            f"Expected a batch with at least one array field of rank > batch_axis="
            f"{batch_axis}. Received: {len(parts.fields)} field(s), none batched"
        )
    total = static = None
    for f in parts.fields:
        if f.kind != "float" or f.backend is None:
            continue
        x = f.value if f.composite is not None else to_backend(be, f.value, like=like, name="batch")
        if f.batched:
            counts = _batched_counts(be, f, x, batch_axis)
            total = counts if total is None else total + counts
        else:  # no batch axis: its non-finite values count against every sample
            stored = x if f.composite is None else f.stored
            count = be.count(~be.isfinite(stored), None, "int32")
            static = count if static is None else static + count
    if total is None:  # only integer / bool batched fields: zeros, on the batch's device
        f = batched[0]
        x = f.value if f.composite is not None else to_backend(be, f.value, like=like, name="batch")
        total = _batched_counts(be, f, x, batch_axis, zeros=True)
    return total if static is None else total + static


def _batched_counts(be: Any, f: Field, x: Array, batch_axis: int, zeros: bool = False) -> Array:
    """Non-finite values per sample of the batched field ``f`` (value ``x``), int32; with
    ``zeros``, a vector of zeros as long (``x != x`` of an integer field). A ragged or sparse
    field counts its stored values (``Field.composite``)."""
    if f.composite is not None:
        values = f.composite.values(x)
        mask = values != values if zeros else ~be.isfinite(values)
        return f.composite.count(x, batch_axis, mask)
    if zeros:
        return sample_counts(be, x, batch_axis, x != x)
    return nonfinite_counts(be, x, batch_axis)
