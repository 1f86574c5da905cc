"""``protect``: per-sample NaN/inf and outlier screening of a stream of batches.

Each batch is split into fields (numstab.data._fields). A clean batch costs one fused sum per
floating field and one host sync, and is handed on unchanged (the same object). Otherwise the
samples with a NaN or inf in any floating field are found (one reduction per field), and an
optional outlier filter screens the finite ones. Then, per sample:

- ``"drop"``: the flagged samples are removed from every batched field (the batch shrinks);
- ``"replace"``: NaN and +-inf values become ``replace_value`` (finite values untouched);
- ``"raise"``: NonFiniteError (OutlierError for outliers) naming the field and the sample's
  global index.

Outliers follow ``outlier_policy`` (default: ``"raise"`` under ``policy="raise"``, else
``"drop"``; a finite sample has no value to replace). Every flagged sample is recorded in
``stats`` (FirewallStats) and, with ``quarantine_dir``, written to a ``.npz`` file first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from numstab import _validate as v
from numstab import frameworks
from numstab.data import _filter_state, _lean, quarantine
from numstab.data._fast import SUSPECT, clean_batch_size
from numstab.data._fields import (
    Batch,
    changed_widths,
    check_batch_axis,
    check_replace_value,
    check_replacement,
    compress,
    outlier_features,
    replaced,
    split_batch,
    surely_finite,
)
from numstab.data.check import report_of
from numstab.data.outliers import OutlierFilter, make_outlier_filter
from numstab.data.stats import FirewallStats, SampleRecord
from numstab.errors import InvalidArgumentError, NonFiniteError, OutlierError

POLICIES = ("drop", "replace", "raise")
OUTLIER_POLICIES = ("drop", "raise")

Features = Sequence[str] | Callable[[Any], Any] | None


class Firewall:
    """The per-batch logic and state of ``protect``; usable on its own: ``process(batch)``.

    Args:
        policy: ``"drop"``, ``"replace"`` or ``"raise"`` for samples with NaN/inf.
        outliers: None, ``"zscore"``, ``"mad"`` (each a 0.05% per-sample false-positive
            budget, whatever d), ``"isolation_forest"`` or an OutlierFilter.
        outlier_policy: ``"drop"`` or ``"raise"``; see the module docstring for the default.
        outlier_fields: the paths (as in BatchReport) whose values form a sample's features,
            or a callable ``batch -> (n, d) array``; default: every floating batched field,
            flattened per sample and concatenated.
        replace_value: the finite value NaN/inf become under ``"replace"``.
        batch_axis: the samples' axis in every batched field (>= 0).
        quarantine_dir: where flagged samples are written (``quarantine`` module).
        keep_empty: hand on a batch whose samples were all dropped (else it is skipped).
    """

    def __init__(
        self,
        policy: str = "drop",
        *,
        outliers: str | OutlierFilter | None = None,
        outlier_policy: str | None = None,
        outlier_fields: Features = None,
        replace_value: float = 0.0,
        batch_axis: int = 0,
        quarantine_dir: str | None = None,
        quarantine_prefix: str = "quarantine",
        keep_empty: bool = False,
    ) -> None:
        v.check_choice("policy", policy, POLICIES)
        if outlier_policy is None:
            outlier_policy = "raise" if policy == "raise" else "drop"
        v.check_choice("outlier_policy", outlier_policy, OUTLIER_POLICIES)
        self.policy, self.outlier_policy = policy, outlier_policy
        self.outliers = make_outlier_filter(outliers)
        self.outlier_fields = _check_outlier_fields(outlier_fields)
        self.replace_value = check_replace_value(replace_value)
        self.batch_axis = check_batch_axis(batch_axis)
        self.quarantine_dir = quarantine.check_destination(quarantine_dir, quarantine_prefix)
        self.quarantine_prefix = quarantine_prefix
        self.keep_empty = v.check_bool("keep_empty", keep_empty)
        self.stats = FirewallStats()
        self._epoch_start = 0  # stats.batches_seen when the epoch began
        self._epoch = 0
        self._replaceable: set[str] = set()  # dtypes replace_value is finite in
        self._tag, self._tag_pid = "", None  # quarantine file-name tag in a torch worker
        self._widths: list | None = None  # (field, features per sample) of the last batch

    def check_replaceable(self, fields: Iterable[tuple[str, str]]) -> None:
        """Under ``"replace"``, ``replace_value`` must be finite in the dtype of each
        ``(label, dtype)`` field about to be replaced into (``InvalidArgumentError``
        otherwise, before the batch's samples are recorded); each dtype is checked once."""
        if self.policy != "replace":
            return
        for label, dtype in fields:
            if dtype not in self._replaceable:
                check_replacement(label, dtype, self.replace_value)
                self._replaceable.add(dtype)

    def state_dict(self) -> dict:
        """The stats, epoch counters and outlier filter's state, for a resumed run to go on
        numbering epochs, batches and global indices (``_filter_state.firewall_state``)."""
        return _filter_state.firewall_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` (checked first; ``InvalidArgumentError`` leaves the
        firewall unchanged). The next ``iter`` of ``protect`` starts epoch ``stats.epochs``."""
        _filter_state.load_firewall_state(self, state)

    @property
    def _batch_in_epoch(self) -> int:
        """The number of the next batch in the epoch (counted, not stored: one increment
        less per batch)."""
        return self.stats.batches_seen - self._epoch_start

    def new_epoch(self) -> None:
        """Start numbering batches from 0 again (``protect`` calls it on every ``iter``)."""
        self._epoch = self.stats.epochs
        self.stats.epochs += 1
        self._epoch_start = self.stats.batches_seen

    def process(self, batch: Any) -> Any:
        """The batch with its flagged samples handled; None when all were dropped (and
        ``keep_empty`` is False). A clean batch comes back as the same object. A batch
        rejected with ``InvalidArgumentError`` leaves ``stats``, the outlier filter, the
        quarantine and the later global indices as they were (every check comes first)."""
        stats = self.stats
        counted: list = []  # counts the fast path computed on a dirty NumPy leaf
        size = clean_batch_size(batch, self.batch_axis, counted) if self.outliers is None else None
        if size is not None and size >= 0:  # the fast path: provably clean
            stats.samples_seen += size
            stats.samples_passed += size
            stats.batches_seen += 1
            return batch
        lean = size == SUSPECT and self.quarantine_dir is None and self.policy != "raise"
        if lean:  # found dirty (so no outlier filter), drop or replace: the short ways
            out = _lean.handle_flat(self, batch, counted)
            if out is not _lean.UNHANDLED:
                return out
        parts = split_batch(batch, self.batch_axis)
        if parts.size is None:
            raise InvalidArgumentError(
                f"Expected a batch with at least one array field of rank > batch_axis="
                f"{self.batch_axis}. Received: {type(batch).__name__} with no batched field"
            )
        if lean:
            out = _lean.handle(self, batch, parts, counted)
            if out is not _lean.UNHANDLED:
                return out
        parts.keep_counts(counted)
        floats = parts.float_fields
        # SUSPECT: the fast path already found a leaf it could not prove finite
        clean = size != SUSPECT and (not floats or surely_finite(floats, self.batch_axis))
        if clean and self.outliers is None:
            self.count_batch(parts.size)
            stats.samples_passed += parts.size
            return batch
        return self._general(batch, parts, clean)

    def count_batch(self, n: int) -> tuple[int, int]:
        """Count a batch of ``n`` samples as seen; returns its first global sample index and
        its number in the epoch. Called once every check of the batch has passed, so a
        rejected batch leaves the stats (and the later indices) as they were."""
        stats = self.stats
        first_index, number = stats.samples_seen, self._batch_in_epoch
        stats.samples_seen += n
        stats.batches_seen += 1
        return first_index, number

    def _general(self, batch: Any, parts: Batch, clean: bool) -> Any:
        """The general path: every check first (counts, ``replace_value``, the outlier
        features, quarantine), then the filter learns, the batch is counted and its flagged
        samples recorded, then the policy."""
        n = parts.size
        report = report_of(parts, self.batch_axis, clean=clean)
        flagged = np.array(report.bad_samples, dtype=np.intp)  # sorted
        bad = np.zeros(n, dtype=bool)
        bad[flagged] = True
        self.check_replaceable((f.path or "<batch>", f.dtype) for f in report.bad_fields)
        learn = None
        if self.outliers:
            outlier, learn = self._outlier_flags(batch, parts, bad)
            flagged = np.flatnonzero(bad | outlier)
        else:
            outlier = np.zeros_like(bad)
        if flagged.size and self.quarantine_dir is not None:
            quarantine.check_fields(parts)
        if learn is not None:
            learn()
        first_index, number = self.count_batch(n)
        if flagged.size == 0:
            self.stats.samples_passed += n
            return batch
        self._record(report, bad, flagged, first_index, number)
        if self.quarantine_dir is not None:
            reasons = ["nonfinite" if bad[i] else "outlier" for i in flagged]
            path = quarantine.write(
                self.quarantine_dir,
                self.quarantine_prefix,
                self._epoch,
                number,
                parts,
                self.batch_axis,
                flagged,
                first_index + flagged,
                reasons,
                self._tag,
            )
            self.stats.quarantine_files.append(path)
        self._maybe_raise(report, bad, outlier, first_index, number)
        return self._apply(batch, parts, report, bad, outlier)

    # -- steps --------------------------------------------------------------------------------
    def _outlier_flags(
        self, batch: Any, parts: Batch, bad: np.ndarray
    ) -> tuple[np.ndarray, Callable[[], None] | None]:
        """``(flags, learn)``: the filter's flags over the finite samples (``bad`` holds the
        non-finite ones) and its learning step, for ``process`` to call once every check
        passed (``OutlierFilter.screen``). A filter that overrides ``__call__`` is called
        (and learns) here: ``learn`` is then None."""
        widths: list = []
        fields, axis = self.outlier_fields, self.batch_axis
        features = outlier_features(batch, parts, fields, axis, len(bad), widths)
        flags = np.zeros(len(bad), dtype=bool)
        good = ~bad
        learn = None
        try:
            if type(self.outliers).__call__ is OutlierFilter.__call__:
                flags[good], learn = self.outliers.screen(features[good])
            else:
                flags[good] = self.outliers(features[good])
        except InvalidArgumentError as exc:
            changed = changed_widths(self._widths, widths)
            if not changed:
                raise
            raise InvalidArgumentError(f"{exc}. Fields that changed: {changed}") from None
        self._widths = widths
        return flags, learn

    def _action(self, is_bad: bool) -> str:
        policy = self.policy if is_bad else self.outlier_policy
        return {"drop": "dropped", "replace": "replaced", "raise": "raised"}[policy]

    def _record(self, report, bad, flagged, first_index, number) -> None:
        stats = self.stats
        bad_fields = report.bad_fields
        per_sample: dict[int, list] = {}
        for f in bad_fields:
            for i in f.bad_samples:
                per_sample.setdefault(i, []).append(f.path or "<batch>")
        for i in flagged.tolist():
            is_bad = i in per_sample
            fields = tuple(per_sample[i]) if is_bad else (self.outliers.name,)
            nan, inf = _value_counts(bad_fields, i) if is_bad else (0, 0)
            reason = "nonfinite" if is_bad else "outlier"
            where = (first_index + i, self._epoch, number, i)
            record = SampleRecord(*where, reason, self._action(is_bad), fields, nan, inf)
            stats.records.append(record)
        stats.nan_values += report.nan_count
        stats.inf_values += report.inf_count

    def _maybe_raise(self, report, bad, outlier, first_index, number) -> None:
        if self.policy == "raise" and bad.any():
            i = int(np.flatnonzero(bad)[0])
            fields = [f for f in report.bad_fields if i in f.bad_samples]
            names = ", ".join(f.path or "<batch>" for f in fields)
            raise NonFiniteError(
                f"Non-finite data: sample {first_index + i} (epoch {self._epoch}, batch "
                f"{number}, position {i}) has NaN/inf in field(s) {names}; "
                f"{int(bad.sum())} sample(s) of this batch are non-finite "
                f"({report.nan_count} NaN, {report.inf_count} inf values)",
                phase="data",
                nan_count=report.nan_count,
                inf_count=report.inf_count,
                paths=tuple(f.path for f in report.bad_fields),
            )
        if self.outlier_policy == "raise" and outlier.any():
            positions = np.flatnonzero(outlier)
            indices = tuple(int(first_index + i) for i in positions)
            raise OutlierError(
                f"Outlier data: sample {indices[0]} (epoch {self._epoch}, batch {number}, "
                f"position {int(positions[0])}) was flagged by the {self.outliers.name!r} "
                f"filter; {len(indices)} outlier(s) in this batch",
                filter=self.outliers.name,
                indices=indices,
            )

    def _apply(self, batch, parts: Batch, report, bad, outlier) -> Any:
        drop = outlier if self.outlier_policy == "drop" else np.zeros_like(outlier)
        values = [f.value for f in parts.fields]
        if self.policy == "drop":
            drop = drop | bad
        elif self.policy == "replace" and bad.any():
            values = self._replaced(parts, report, values)
        dropped = int(np.count_nonzero(drop))  # not .any() / .sum(): ~1 / ~5 us more
        if dropped:
            keep = ~drop
            pairs = zip(parts.fields, values, strict=True)
            values = [compress(f, x, keep, self.batch_axis) for f, x in pairs]
        kept = len(drop) - dropped
        self.stats.samples_passed += kept
        if kept == 0 and not self.keep_empty:
            self.stats.batches_skipped += 1
            return None
        return parts.rebuild(values)

    def _replaced(self, parts: Batch, report, values: list) -> list:
        bad_paths = {f.path for f in report.bad_fields}
        out = list(values)
        for k, field in enumerate(parts.fields):
            if field.kind == "float" and field.path in bad_paths:
                out[k] = replaced(field, self.replace_value)
        self.stats.replaced_values += report.nan_count + report.inf_count
        return out

    # -- torch collate --------------------------------------------------------------------
    def collate_fn(self, collate: Callable[[list], Any] | None = None) -> Callable[[list], Any]:
        """A DataLoader ``collate_fn``: ``collate`` (default: torch's ``default_collate``),
        then ``process``. Only in the main process (``num_workers=0``): a worker's copy of
        the stats would be lost, so inside a worker it raises unless ``quarantine_dir`` is
        set (then the files are the record). A worker's files carry a tag unique to the
        worker process (``quarantine.worker_tag``); their epoch, batch and ``index`` count
        that worker copy's batches and samples from 0 (a worker sees every num_workers-th
        batch, and non-persistent workers start over each epoch): carry an id field for the
        dataset index. All-dropped batches come back empty."""
        torch_data = frameworks.module("torch", "data")
        collate = torch_data.default_collate if collate is None else collate

        def collate_and_guard(samples: list) -> Any:
            worker = torch_data.worker_id()
            if worker is not None:
                if self.quarantine_dir is None:
                    raise InvalidArgumentError(
                        "Expected the firewall's collate_fn in the main process (num_workers="
                        "0), where its stats are kept, or a quarantine_dir to record flagged "
                        "samples from workers. Received: a DataLoader worker without "
                        "quarantine_dir. Prefer numstab.data.protect(loader)."
                    )
                if self._tag_pid != os.getpid():  # this worker process's first batch
                    self._tag, self._tag_pid = quarantine.worker_tag(worker), os.getpid()
            saved, self.keep_empty = self.keep_empty, True
            try:
                return self.process(collate(samples))
            finally:
                self.keep_empty = saved

        return collate_and_guard


def _value_counts(bad_fields: tuple, i: int) -> tuple[int, int]:
    """(NaN, inf) values of sample ``i`` over the batched fields (unbatched ones are counted
    in the batch totals only)."""
    nan = total = 0
    for f in bad_fields:
        if f.per_sample is not None:
            total += int(f.per_sample[0][i])
            nan += int(f.per_sample[1][i])
    return nan, total - nan


def _check_outlier_fields(spec: Features) -> Features:
    if spec is None or callable(spec):
        return spec
    paths = tuple(spec) if isinstance(spec, Iterable) and not isinstance(spec, str) else None
    if paths is None or not all(isinstance(p, str) for p in paths):
        raise InvalidArgumentError(
            f"Expected outlier_fields to be None, a callable batch -> (n, d) array, or a "
            f"sequence of field paths such as [\"['x']\"]. Received: outlier_fields={spec!r}"
        )
    return paths


class GuardedIterable:
    """An iterable over the source's batches after the firewall; ``stats`` as in Firewall.
    Each ``iter()`` is a new epoch over the source (a DataLoader reshuffles as usual).
    ``len()`` is the source's number of batches; fully dropped batches are skipped (a batch
    that came empty from the source is handed on as it came: the firewall dropped nothing)."""

    def __init__(self, source: Iterable, firewall: Firewall) -> None:
        self.source, self.firewall = source, firewall

    @property
    def stats(self) -> FirewallStats:
        return self.firewall.stats

    def __iter__(self) -> Iterator:
        self.firewall.new_epoch()
        for batch in self.source:
            out = self.firewall.process(batch)
            if out is not None:
                yield out

    def __len__(self) -> int:
        """``len(source)``. A source without ``len`` (a generator) raises ``TypeError``, as
        ``len`` does: ``list()`` and other length hints expect exactly that error."""
        try:
            return len(self.source)
        except TypeError:
            raise TypeError(
                f"len() of a protected stream is its source's number of batches. Received: a "
                f"source of type {type(self.source).__name__}, which has no len()"
            ) from None

    def as_tf_dataset(self, output_signature: Any = None) -> Any:
        """This stream as a ``tf.data.Dataset`` (``from_generator``) for Keras' ``fit``;
        each iteration over it is an epoch here. ``output_signature``: by default the source
        dataset's ``element_spec`` with batch axes of unknown size (batches shrink)."""
        return frameworks.module("tensorflow", "data").datasets.as_dataset(self, output_signature)


def protect(
    iterable: Iterable,
    policy: str = "drop",
    outliers: str | OutlierFilter | None = None,
    **options: Any,
) -> GuardedIterable:
    """Wrap a torch DataLoader, a tf.data.Dataset (iterated eagerly) or any iterable of
    batches; see Firewall for ``options`` and the module docstring for the semantics.

    >>> loader = protect(batches, "drop", replace_value=0.0)   # doctest: +SKIP
    >>> for batch in loader: ...                             # doctest: +SKIP
    >>> loader.stats.dropped                                 # global sample indices
    """
    if not hasattr(iterable, "__iter__"):
        raise InvalidArgumentError(
            f"Expected an iterable of batches (DataLoader, tf.data.Dataset, generator). "
            f"Received: iterable of type {type(iterable).__name__}"
        )
    firewall = Firewall(policy, outliers=outliers, **options)
    for datasets in frameworks.loaded("data", "datasets"):  # a tf.data.Dataset: batched?
        datasets.check_batched(iterable, firewall.batch_axis)
    return GuardedIterable(iterable, firewall)


#: the name before 0.2 (it read as the ``numstab.guard`` package): the same function
guard = protect
