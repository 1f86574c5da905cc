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

``host_view`` is the firewall's in-place read of an eager tensor in host memory.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from numstab import _validate as v
from numstab.data._fields import check_batch_axis, check_replacement, split_batch
from numstab.frameworks.tensorflow.backend import is_finite


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
        flags = [tf.reduce_all(is_finite(f.value)) for f in parts.float_fields]
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
        ``~isfinite`` over its other axes (3 ops), or'ed together."""
        axis = self.batch_axis
        bad = None
        for f in parts.float_fields:
            finite = is_finite(f.value)
            if f.batched:
                other = [a for a in range(len(f.value.shape)) if a != axis]
                flags = tf.reduce_any(tf.logical_not(finite), axis=other)
            else:
                flags = tf.logical_not(tf.reduce_all(finite))
            bad = flags if bad is None else tf.logical_or(bad, flags)
        if bad is not None and bad.shape.rank == 1:
            return bad
        batched = next(f for f in parts.fields if f.batched and f.backend is not None)
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
                if f.batched and f.backend is not None:
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
                finite = is_finite(x)
                replaced += tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int64))
                x = tf.where(finite, x, tf.cast(self.replace_value, x.dtype))
            values.append(x)
        has_batch = any(f.batched for f in parts.fields)
        counters = [self.values_replaced.assign_add(replaced)]
        if has_batch and any(f.kind == "float" for f in parts.fields):
            counters += self._count(self._bad(parts))
        with tf.control_dependencies(counters):
            return parts.rebuild([tf.identity(x) if tf.is_tensor(x) else x for x in values])

    def _count(self, bad: tf.Tensor) -> list:
        return [
            self.samples_seen.assign_add(tf.size(bad, out_type=tf.int64)),
            self.samples_flagged.assign_add(tf.math.count_nonzero(bad, dtype=tf.int64)),
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
