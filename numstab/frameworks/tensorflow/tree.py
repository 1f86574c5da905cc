"""What ``numstab.tree`` needs from TensorFlow: its sparse gradients (``tf.IndexedSlices``,
an embedding's), ragged tensors and sparse tensors are nodes, not leaves."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

#: array-like types that ``numstab.tree`` must open (they have a dtype, yet are nodes)
sparse_type = (tf.IndexedSlices, tf.RaggedTensor, tf.SparseTensor)


def sparse_children(g: Any, dense: bool) -> tuple[list, Any] | None:
    """``numstab.tree``'s view of a TensorFlow composite: one child, under the node's own
    path, and a rebuild; None for anything else.

    - ``tf.IndexedSlices``: the dense gradient's nonzero rows, ``values`` with repeated
      ``indices`` summed (``tf.unique`` + ``unsorted_segment_sum``): its norm and
      finiteness are the dense gradient's, where TF's own ``clip_by_global_norm`` takes the
      norm of the raw values. The rebuild is an ``IndexedSlices`` over the unique indices,
      so clipping keeps the gradient sparse. With ``dense``: the dense gradient
      (``tf.convert_to_tensor``), rebuilt dense.
    - ``tf.RaggedTensor``: its ``flat_values``, rebuilt with the same row partitions
      (``with_flat_values``). Padding is not data, so ``dense`` changes nothing.
    - ``tf.SparseTensor``: its stored ``values``, rebuilt with the same ``indices`` and
      ``dense_shape`` (``with_values``). Indices are taken as TF's canonical form has them,
      without duplicates (``tf.sparse.to_dense`` refuses a repeated index), so the stored
      values are the nonzero elements; they are not summed. With ``dense``: the dense
      tensor (``tf.sparse.to_dense``), rebuilt sparse from its values at ``indices``.
    """
    cls = type(g)
    if cls is tf.RaggedTensor:
        return [("", g.flat_values)], lambda values: _rebuilt(values, g.with_flat_values)
    if cls is tf.SparseTensor:
        if dense:
            at = lambda new: g.with_values(tf.gather_nd(new, g.indices))
            return [("", tf.sparse.to_dense(g))], lambda values: _rebuilt(values, at)
        return [("", g.values)], lambda values: _rebuilt(values, g.with_values)
    if cls is not tf.IndexedSlices:
        return None
    if dense:
        return [("", tf.convert_to_tensor(g))], lambda values: values[0]
    unique, position = tf.unique(g.indices)
    rows = tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])
    at = lambda new: tf.IndexedSlices(new, unique, g.dense_shape)
    return [("", rows)], lambda values: _rebuilt(values, at)


def _rebuilt(values: list, build: Any) -> Any:
    """``build(new)`` of the one new child, None kept (a function that returned None)."""
    (new,) = values
    return None if new is None else build(new)
