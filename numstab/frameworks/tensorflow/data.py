"""tf.data-native firewall functions: graph mode, no ``tf.py_function``.

``TFDataGuard`` gives three functions for a ``tf.data.Dataset`` and keeps counts in
``tf.Variable``s, updated inside the dataset's graph:

- ``is_finite``: a ``Dataset.filter`` predicate for per-sample (unbatched) elements;
- ``drop_nonfinite``: a ``Dataset.map`` function for batched elements: removes the samples
  with a NaN/inf in any floating field from every field (``tf.boolean_mask`` along
  ``batch_axis``; batch sizes vary);
- ``replace_nonfinite``: a ``Dataset.map`` function: NaN/inf become ``replace_value``.

They keep counts only, not indices (enumerate the dataset first to keep an index field, or
use ``numstab.data.protect(dataset)``, which iterates eagerly and records global indices).
Elements may be tensors, tuples or dicts (``map`` unpacks tuples into arguments).

``host_view`` is the firewall's in-place read of an eager tensor in host memory.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from numstab import _validate as v
from numstab.backends import load_backend
from numstab.data._fields import check_batch_axis, nonfinite_counts, split_batch

_TF = load_backend("tensorflow")


def _element(args: tuple) -> Any:
    return args[0] if len(args) == 1 else args


class TFDataGuard:
    """Counters (int64 ``tf.Variable``): ``samples_seen``, ``samples_flagged`` (non-finite
    samples filtered out or dropped, or replaced), ``values_replaced``. Create it eagerly
    (outside any tf.function), then pass its methods to ``filter`` / ``map``."""

    def __init__(self, replace_value: float = 0.0, batch_axis: int = 0) -> None:
        self.replace_value = v.check_number("replace_value", replace_value, low=-float("inf"))
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
        """Scalar bool: every value of every floating field of one sample is finite."""
        parts = split_batch(_element(element), batch_axis=0)
        flags = [tf.reduce_all(tf.math.is_finite(f.value)) for f in parts.float_fields]
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
        parts = split_batch(_element(element), self.batch_axis)
        batched = [f for f in parts.fields if f.batched and f.backend is not None]
        n = tf.shape(batched[0].value)[self.batch_axis]
        bad = tf.zeros([n], dtype=tf.bool)
        for f in parts.float_fields:
            if f.batched:
                bad = bad | (nonfinite_counts(_TF, f.value, self.batch_axis) > 0)
            else:
                bad = bad | tf.logical_not(tf.reduce_all(tf.math.is_finite(f.value)))
        return bad

    def drop_nonfinite(self, *element: Any) -> Any:
        """The batch without its non-finite samples."""
        bad = self.bad_samples(*element)
        keep = tf.logical_not(bad)
        parts = split_batch(_element(element), self.batch_axis)
        cut = [k for k, f in enumerate(parts.fields) if f.batched and f.backend is not None]
        arrays = [parts.fields[k].value for k in cut]
        axis = self.batch_axis
        with tf.control_dependencies(self._count(bad)):
            # a clean batch (the common case) skips the gather of tf.boolean_mask
            kept = tf.cond(
                tf.reduce_any(bad),
                lambda: [tf.boolean_mask(x, keep, axis=axis) for x in arrays],
                lambda: [tf.identity(x) for x in arrays],
            )
        values = [f.value for f in parts.fields]
        for k, x in zip(cut, kept, strict=True):
            values[k] = x
        return parts.rebuild(values)

    def replace_nonfinite(self, *element: Any) -> Any:
        """The element with every NaN/inf of its floating fields set to ``replace_value``."""
        parts = split_batch(_element(element), self.batch_axis)
        values, replaced = [], tf.constant(0, tf.int64)
        for f in parts.fields:
            x = f.value
            if f.kind == "float":
                finite = tf.math.is_finite(x)
                replaced += tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int64))
                x = tf.where(finite, x, tf.cast(self.replace_value, x.dtype))
            values.append(x)
        has_batch = any(f.batched for f in parts.fields)
        counters = [self.values_replaced.assign_add(replaced)]
        if has_batch and any(f.kind == "float" for f in parts.fields):
            counters += self._count(self.bad_samples(*element))
        with tf.control_dependencies(counters):
            return parts.rebuild([tf.identity(x) if tf.is_tensor(x) else x for x in values])

    def _count(self, bad: tf.Tensor) -> list:
        return [
            self.samples_seen.assign_add(tf.cast(tf.size(bad), tf.int64)),
            self.samples_flagged.assign_add(tf.reduce_sum(tf.cast(bad, tf.int64))),
        ]


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
