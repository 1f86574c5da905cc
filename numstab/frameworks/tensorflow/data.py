"""tf.data-native firewall functions: graph mode, no ``tf.py_function``.

``TFDataGuard`` gives three functions for a ``tf.data.Dataset`` and keeps counts in
``tf.Variable``s, updated inside the dataset's graph:

- ``is_finite``: a ``Dataset.filter`` predicate for per-sample (unbatched) elements;
- ``drop_nonfinite``: a ``Dataset.map`` function for batched elements: removes the samples
  with a NaN/inf in any floating field from every field (``tf.gather`` of the kept positions
  along ``batch_axis``; batch sizes vary);
- ``replace_nonfinite``: a ``Dataset.map`` function: NaN/inf become ``replace_value``.

They keep counts only, not indices (enumerate the dataset first to keep an index field, or
use ``numstab.data.protect(dataset)``, which iterates eagerly and records global indices).
Elements may be tensors, tuples or dicts (``map`` unpacks tuples into arguments).

``datasets`` (the ``data.datasets`` hook) refuses an unbatched ``tf.data.Dataset`` when
``protect`` is called, from its ``element_spec``, and gives ``GuardedIterable.as_tf_dataset``.

Ragged and sparse fields (``composite``, the ``data.composite`` hook of
``numstab.data._fields``) are read through their stored values, per sample by segment sums,
here and in the eager firewall alike (docs/semantics.md §17.1).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from numstab.data._fields import (
    check_batch_axis,
    check_replace_value,
    check_replacement,
    split_batch,
)
from numstab.errors import InvalidArgumentError
from numstab.frameworks.tensorflow.backend import is_finite
from numstab.tree import leaves_with_paths


def _element(args: tuple) -> Any:
    return args[0] if len(args) == 1 else args


class TFDataGuard:
    """Counters (int64 ``tf.Variable``): ``samples_seen``, ``samples_flagged`` (non-finite
    samples filtered out or dropped, or replaced), ``values_replaced``. Create it eagerly
    (outside any tf.function), then pass its methods to ``filter`` / ``map``."""

    def __init__(self, replace_value: float = 0.0, batch_axis: int = 0) -> None:
        self.replace_value = check_replace_value(replace_value)
        self.batch_axis = check_batch_axis(batch_axis)
        self.samples_seen = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.samples_flagged = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.values_replaced = tf.Variable(0, dtype=tf.int64, trainable=False)

    def stats(self) -> dict[str, int]:
        return {
            "samples_seen": int(self.samples_seen.numpy()),
            "samples_flagged": int(self.samples_flagged.numpy()),
            "values_replaced": int(self.values_replaced.numpy()),
        }

    def is_finite(self, *element: Any) -> tf.Tensor:
        """Scalar bool: every value of every floating field of one sample is finite. Each
        field is read whole: a sample's fields need not agree on any axis (``x`` of shape
        ``(4,)`` with ``y`` of shape ``(1,)``), so none is read as a batch axis."""
        fields = [f for leaf in tf.nest.flatten(_element(element)) for f in _fields_of(leaf)]
        flags = [tf.reduce_all(is_finite(f.stored)) for f in fields if f.kind == "float"]
        ok = tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)
        with tf.control_dependencies(
            [
                self.samples_seen.assign_add(1),
                self.samples_flagged.assign_add(tf.cast(tf.logical_not(ok), tf.int64)),
            ]
        ):
            return tf.identity(ok)

    def bad_samples(self, *element: Any) -> tf.Tensor:
        """Bool vector over the batch axis: the sample holds a NaN/inf in some floating field
        (a non-finite field without a batch axis marks every sample)."""
        return self._bad(split_batch(_element(element), self.batch_axis))

    def _bad(self, parts: Any) -> tf.Tensor:
        """``bad_samples`` of a split element: per batched floating field one ``any`` of
        ``~isfinite`` over its other axes (3 ops), or'ed together; a ragged or sparse one
        counts its stored values per sample (``composite.counts``)."""
        axis = self.batch_axis
        bad = None
        for f in parts.float_fields:
            finite = is_finite(f.stored)
            if f.batched and f.composite is not None:
                flags = f.composite.count(f.value, axis, tf.logical_not(finite)) > 0
            elif f.batched:
                other = [a for a in range(len(f.value.shape)) if a != axis]
                flags = tf.reduce_any(tf.logical_not(finite), axis=other)
            else:
                flags = tf.logical_not(tf.reduce_all(finite))
            bad = flags if bad is None else tf.logical_or(bad, flags)
        if bad is not None and bad.shape.rank == 1:
            return bad
        batched = next(f for f in parts.fields if f.batched and f.backend is not None)
        if batched.composite is not None:
            n = batched.composite.sample_of(batched.value, axis)[1]
        else:
            n = tf.shape(batched.value)[axis]
        return tf.fill([n], False if bad is None else bad)

    def drop_nonfinite(self, *element: Any) -> Any:
        """The batch without its non-finite samples: every batched field gathered at the
        kept positions. No ``tf.cond`` for a clean batch: its ``If`` cost more per call in
        tf.data's executor (~12 us) than gathering a whole clean batch."""
        parts = split_batch(_element(element), self.batch_axis)
        bad = self._bad(parts)
        kept = tf.reshape(tf.where(tf.logical_not(bad)), [-1])
        values = [f.value for f in parts.fields]
        with tf.control_dependencies(self._count(bad)):
            for k, f in enumerate(parts.fields):
                if f.batched and f.composite is not None:
                    values[k] = f.composite.gather(f.value, kept, self.batch_axis)
                elif f.batched and f.backend is not None:
                    values[k] = tf.gather(f.value, kept, axis=self.batch_axis)
        return parts.rebuild(values)

    def replace_nonfinite(self, *element: Any) -> Any:
        """The element with every NaN/inf of its floating fields set to ``replace_value``."""
        parts = split_batch(_element(element), self.batch_axis)
        values, replaced = [], tf.constant(0, tf.int64)
        for f in parts.fields:
            x = f.value
            if f.kind == "float":
                check_replacement(f.label, f.dtype, self.replace_value)  # at trace time
                finite = is_finite(f.stored)
                replaced += tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int64))
                if f.composite is not None:
                    x = f.composite.replace(x, self.replace_value)
                else:
                    x = tf.where(finite, x, tf.cast(self.replace_value, x.dtype))
            values.append(x)
        has_batch = any(f.batched for f in parts.fields)
        counters = [self.values_replaced.assign_add(replaced)]
        if has_batch and any(f.kind == "float" for f in parts.fields):
            counters += self._count(self._bad(parts))
        with tf.control_dependencies(counters):
            return parts.rebuild([_identity(x) for x in values])

    def _count(self, bad: tf.Tensor) -> list:
        return [
            self.samples_seen.assign_add(tf.size(bad, out_type=tf.int64)),
            self.samples_flagged.assign_add(tf.math.count_nonzero(bad, dtype=tf.int64)),
        ]


def _fields_of(leaf: Any) -> list:
    """The field of one leaf of a per-sample element (``split_batch`` of that leaf alone:
    no other field to agree with); a ragged or sparse tensor is a leaf of ``tf.nest``."""
    return split_batch(leaf, batch_axis=0).fields


def _identity(x: Any) -> Any:
    """``tf.identity`` of a tensor (under the caller's control dependencies), a ragged or
    sparse tensor's stored values included; anything else as it is."""
    if isinstance(x, tf.RaggedTensor):
        return x.with_flat_values(tf.identity(x.flat_values))
    if isinstance(x, tf.SparseTensor):
        return x.with_values(tf.identity(x.values))
    return tf.identity(x) if tf.is_tensor(x) else x


class _Composite:
    """Ragged and sparse fields of a batch (``numstab.data._fields``'s ``data.composite``
    hook): read through their stored values, ``flat_values`` / ``values``, each of which
    belongs to one sample. A ragged tensor's samples are its rows (``batch_axis`` 0 only:
    its other axes have no fixed size); a sparse tensor's are ``indices[:, batch_axis]``
    (any axis), whose implicit zeros are finite. Graph-safe, eager too."""

    types = (tf.RaggedTensor, tf.SparseTensor)
    framework = "tensorflow"

    @staticmethod
    def values(x: Any) -> tf.Tensor:
        """The stored values: every value that can be non-finite."""
        return x.flat_values if type(x) is tf.RaggedTensor else x.values

    @staticmethod
    def fixed_size(x: Any) -> bool:
        """Whether ``x``'s samples have one size (a sparse tensor's, saved dense), unlike a
        ragged tensor's rows."""
        return type(x) is not tf.RaggedTensor

    @staticmethod
    def splits_at(x: Any, batch_axis: int) -> bool:
        """Whether ``x``'s samples can lie along ``batch_axis``: any axis of a sparse tensor,
        a ragged tensor's rows only."""
        return batch_axis == 0 or _Composite.fixed_size(x)

    def check_axis(self, x: Any, batch_axis: int, label: str) -> None:
        """``InvalidArgumentError`` for a ragged tensor split along any axis but its rows."""
        if not self.splits_at(x, batch_axis):
            raise InvalidArgumentError(
                f"Expected batch_axis=0 for the ragged field {label}: its samples are its "
                f"rows, and its other axes have no fixed size. Received: "
                f"batch_axis={batch_axis}"
            )

    @staticmethod
    def sample_of(x: Any, batch_axis: int) -> tuple[tf.Tensor, tf.Tensor]:
        """(the sample of each stored value, as int64; the number of samples)."""
        if type(x) is tf.SparseTensor:
            return x.indices[:, batch_axis], x.dense_shape[batch_axis]
        rowids = x.nested_value_rowids()  # outermost first
        sample = rowids[-1]
        for outer in reversed(rowids[:-1]):
            sample = tf.gather(outer, sample)
        return sample, x.nrows()

    def count(self, x: Any, batch_axis: int, mask: tf.Tensor) -> tf.Tensor:
        """The true entries of ``mask`` (shaped like the stored values) per sample, int32."""
        sample, n = self.sample_of(x, batch_axis)
        per_value = tf.cast(mask, tf.int32)
        if per_value.shape.rank != 1:  # a ragged tensor's uniform inner axes
            per_value = tf.reduce_sum(per_value, axis=tf.range(1, tf.rank(per_value)))
        return tf.math.unsorted_segment_sum(per_value, sample, n)

    def counts(self, x: Any, batch_axis: int) -> tuple[tf.Tensor, tf.Tensor]:
        """Per-sample (non-finite, NaN) counts, int32 vectors."""
        values = self.values(x)
        return (
            self.count(x, batch_axis, tf.logical_not(is_finite(values))),
            self.count(x, batch_axis, tf.math.not_equal(values, values)),
        )

    @staticmethod
    def replace(x: Any, value: float) -> Any:
        """``x`` with its non-finite stored values set to ``value``, layout kept."""
        values = _Composite.values(x)
        new = tf.where(is_finite(values), values, tf.cast(value, values.dtype))
        return x.with_flat_values(new) if type(x) is tf.RaggedTensor else x.with_values(new)

    @staticmethod
    def gather(x: Any, kept: Any, batch_axis: int) -> Any:
        """The samples at the increasing positions ``kept`` (a ragged tensor's rows by
        ``tf.gather``; a sparse tensor's entries of those samples, re-indexed in order)."""
        if type(x) is tf.RaggedTensor:
            return tf.gather(x, kept)
        kept = tf.cast(kept, tf.int64)
        sample, n = _Composite.sample_of(x, batch_axis)
        new_position = tf.tensor_scatter_nd_update(
            tf.fill([n], tf.constant(-1, tf.int64)),
            kept[:, None],
            tf.range(tf.size(kept, out_type=tf.int64)),
        )
        moved = tf.gather(new_position, sample)
        entries = tf.reshape(tf.where(moved >= 0), [-1])
        rank = tf.shape(x.dense_shape, out_type=tf.int64)[0]
        column = tf.equal(tf.range(rank), batch_axis)  # the batch axis' entries
        indices = tf.where(column, moved[:, None], x.indices)
        shape = tf.where(column, tf.size(kept, out_type=tf.int64), x.dense_shape)
        return tf.SparseTensor(tf.gather(indices, entries), tf.gather(x.values, entries), shape)


#: ``numstab.data._fields``'s hook for ragged and sparse fields
composite = _Composite()


class _Datasets:
    """``protect`` over a ``tf.data.Dataset`` (``numstab.data.firewall``'s ``data.datasets``
    hook): its ``element_spec`` read before the first batch, and the guarded stream handed
    back to Keras as a dataset."""

    @staticmethod
    def check_batched(source: Any, batch_axis: int) -> None:
        """``InvalidArgumentError`` for a dataset whose elements read as single samples:
        (batch_axis 0) a rank-0 field beside ranked ones when no batching op comes after the
        last ``unbatch`` upstream (``_batched_upstream``: ``batch``, ``padded_batch``,
        ``ragged_batch``, ``rebatch``, ``bucket_by_sequence_length``), or fields whose static
        sizes on the batch axis differ. Its first axis would be read as the samples, and a
        drop would delete features (a timestep of a sequence) while the rank-0 label stays."""
        if not isinstance(source, tf.data.Dataset):
            return
        specs = [(p or "<batch>", s) for p, s in leaves_with_paths(source.element_spec)]
        ranks = {p: s.shape.rank for p, s in specs if hasattr(s, "shape")}
        scalars = [p for p, r in ranks.items() if r == 0]
        ranked = [p for p, r in ranks.items() if r is not None and r > batch_axis]
        sizes = {p: s.shape[batch_axis] for p, s in specs if p in ranked}
        known = {p: n for p, n in sizes.items() if n is not None}
        if batch_axis == 0 and scalars and ranked and not _batched_upstream(source):
            found = f"rank-0 field(s) {', '.join(scalars)} beside {', '.join(ranked)}"
        elif len(set(known.values())) > 1:
            found = ", ".join(f"{p} of {n}" for p, n in known.items())
            found = f"fields holding {found} along batch_axis={batch_axis}"
        else:
            return
        raise InvalidArgumentError(
            f"Expected a batched tf.data.Dataset: protect reads axis {batch_axis} of every "
            f"field as its samples, and an unbatched element is one sample. Received: an "
            f"element_spec with {found}. Batch it first (protect(dataset.batch(32))), or "
            f"drop single samples in graph mode: dataset.filter(TFDataGuard().is_finite)"
        )

    @staticmethod
    def as_dataset(guarded: Any, output_signature: Any = None) -> tf.data.Dataset:
        """``guarded`` (a ``GuardedIterable``) as ``tf.data.Dataset.from_generator``; the
        signature by default the source dataset's ``element_spec`` with every batch axis of
        unknown size."""
        if output_signature is None:
            source = guarded.source
            if not isinstance(source, tf.data.Dataset):
                raise InvalidArgumentError(
                    f"Expected output_signature (tf.TensorSpec per field, batch axis None) "
                    f"for a source that is no tf.data.Dataset. Received: "
                    f"output_signature=None over a {type(source).__name__}"
                )
            axis = guarded.firewall.batch_axis
            output_signature = tf.nest.map_structure(
                lambda spec: _unknown_batch(spec, axis), source.element_spec
            )
        return tf.data.Dataset.from_generator(
            lambda: iter(guarded), output_signature=output_signature
        )


#: tf.data's dataset classes that batch (``bucket_by_sequence_length`` is a group_by_window)
_BATCHING = {"_BatchDataset", "_PaddedBatchDataset", "_RebatchDataset", "_GroupByWindowDataset"}


def _batched_upstream(dataset: Any) -> bool:
    """Whether a batching op comes after the last ``unbatch`` in the chain of datasets that
    ``dataset`` is made from (their private ``_input_dataset`` links; False where the chain
    cannot be read, or starts at a source: ``from_generator`` yields what it yields)."""
    while dataset is not None:
        name = type(dataset).__name__
        if name in _BATCHING:
            return True
        if name == "_UnbatchDataset":
            return False
        dataset = getattr(dataset, "_input_dataset", None)
    return False


def _unknown_batch(spec: Any, axis: int) -> Any:
    """``spec`` with the size of its batch axis unknown (a dense, ragged or sparse field of
    rank > ``axis``), as the firewall's drops leave it; any other spec as it is."""
    shape = getattr(spec, "shape", None)
    if shape is None or shape.rank is None or shape.rank <= axis:
        return spec
    dims = shape.as_list()
    dims[axis] = None
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec(
            dims, spec.dtype, spec.ragged_rank, spec.row_splits_dtype, spec.flat_values_spec
        )
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensorSpec(dims, spec.dtype)
    return tf.TensorSpec(dims, spec.dtype) if isinstance(spec, tf.TensorSpec) else spec


#: ``numstab.data.firewall``'s hook for ``tf.data.Dataset`` sources
datasets = _Datasets()


def eager_types() -> tuple[type, frozenset, frozenset]:
    """EagerTensor, and the dtype enums read in place (float16/32/64) or never read
    (integers, bool). bfloat16, strings, complex: neither, the backend path."""
    try:
        from tensorflow.python.framework.ops import EagerTensor
    except ImportError:  # moved in some release: every tensor keeps the backend path
        return type(None), frozenset(), frozenset()
    floats = (tf.float16, tf.float32, tf.float64)
    exact = (tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32, tf.uint64)
    return (
        EagerTensor,
        frozenset(d.as_datatype_enum for d in floats),
        frozenset(d.as_datatype_enum for d in (*exact, tf.bool)),
    )
