"""What ``numstab.tree`` needs from TensorFlow: its sparse gradients (``tf.IndexedSlices``,
an embedding's) are nodes, not leaves."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

#: array-like types that ``numstab.tree`` must open (they have a dtype, yet are nodes)
sparse_type = tf.IndexedSlices


def sparse_children(g: Any, dense: bool) -> tuple[list, Any] | None:
    """``numstab.tree``'s view of a sparse gradient: one child and a rebuild; None for
    anything that is not a ``tf.IndexedSlices``.

    The child is the dense gradient's nonzero rows, ``values`` with repeated ``indices``
    summed (``tf.unique`` + ``unsorted_segment_sum``): its norm and finiteness are the dense
    gradient's, where TF's own ``clip_by_global_norm`` takes the norm of the raw values. The
    rebuild is an ``IndexedSlices`` over the unique indices, so clipping keeps the gradient
    sparse. With ``dense``: the dense gradient (``tf.convert_to_tensor``), rebuilt dense.
    """
    if type(g) is not tf.IndexedSlices:
        return None
    if dense:
        return [("", tf.convert_to_tensor(g))], lambda values: values[0]
    unique, position = tf.unique(g.indices)
    rows = tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])

    def rebuild(values: list) -> Any:
        (new,) = values
        return None if new is None else tf.IndexedSlices(new, unique, g.dense_shape)

    return [("", rows)], rebuild
