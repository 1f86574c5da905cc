"""TensorFlow graph primitives of the fused linear cross-entropy (docs/semantics.md §11.1):
the in-place weight-gradient update and the chunk loop. Both run inside ``tf.function`` only
(not eagerly, not under XLA); the backend falls back to the generic versions elsewhere."""

from __future__ import annotations

import functools

import tensorflow as tf

#: Rows of the weight gradient updated per block in ``matmul_accumulate`` (about this many bytes).
#: 8 MiB blocks took ~5% less CPU for the blocked update alone (385 against 407 ms per 256-row
#: chunk) but nothing measurable in a whole step, and cost 5 MiB of peak (1.091 of the floor)
_ACCUMULATE_BLOCK_BYTES = 4 * 2**20
#: At most this many blocks per iteration of ``matmul_accumulate``'s loop (unrolled in the
#: graph, two in flight): 1.155x a fresh-buffer product per 256-row chunk against 1.18-1.49x
#: with one block per iteration (``benchmarks/tf_fused_parts.py``); bounded, the graph stays
#: small at any vocabulary
_BLOCKS_PER_ITERATION = 16


@functools.cache
def cpu_only() -> bool:
    """No GPU visible to TensorFlow (checked once): the CPU kernels' layout preferences apply."""
    return not tf.config.list_logical_devices("GPU")


def in_xla_context() -> bool:
    """True while tracing for XLA (``jit_compile=True``): TensorStridedSliceUpdate needs
    constant offsets there, so the in-place loops fall back to the plain ones (XLA plans the
    buffers itself)."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # a future layout: assume XLA, the choice that always compiles
        return True
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def _block_rows(vocab: int, width: int, itemsize: int) -> tuple[int, bool]:
    """(rows per block, whether they divide ``vocab``): about ``_ACCUMULATE_BLOCK_BYTES`` of
    rows; a divisor of ``vocab`` down to a quarter of that size (at least 2) when there is one."""
    target = min(max(_ACCUMULATE_BLOCK_BYTES // (itemsize * max(width, 1)), 1), vocab)
    for rows in range(target, max(target // 4, 2) - 1, -1):
        if vocab % rows == 0:
            return rows, True
    return target, False


def matmul_accumulate(acc: tf.Tensor, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """``acc + a.T @ b`` in ``acc``'s dtype (16-bit operands: exact products, float32 sums), in
    blocks of ``acc``'s rows, each added in place: no second ``acc``-sized product.

    InplaceAdd writes into its input's buffer whoever holds it: Snapshot hands that buffer on
    when ``acc`` is its only reference and copies it otherwise (a first chunk that grappler
    folded into a constant, a tensor read elsewhere). When the block divides the rows, ``acc``
    is viewed as [V / block, block * d] and each block is one row of that view: one
    multithreaded add (InplaceAdd adds row by row, single-threaded: 1024 dispatches a block).
    ``acc`` must be made in the same step (the fused path's running sum): a ``tf.function``
    argument's buffer is the caller's, and Snapshot may hand it on, so the caller's tensor
    would change.
    """
    b = tf.cast(b, acc.dtype)  # a: a block at a time, not a chunk-sized float32 copy
    vocab, width = a.shape[1], b.shape[1]
    block, divides = _block_rows(vocab, width, acc.dtype.size)
    full = vocab // block
    acc = tf.raw_ops.Snapshot(input=acc)
    if divides:
        acc = tf.reshape(acc, (full, block * width))  # a view: the same buffer

    def add_block(acc, start, size, after):
        # not slice + add + TensorStridedSliceUpdate: its strided assignment of the block cost
        # more CPU than the block's matmul (280 against 170 ms per 128-row chunk). The block
        # starts once ``after`` is added: unordered, the unrolled blocks would all compute
        # their products at once, each holding a block (+62 MiB over 16 blocks)
        with tf.control_dependencies([after]):
            part = tf.cast(tf.slice(a, [0, start], [-1, size]), acc.dtype)
        product = tf.linalg.matmul(part, b, transpose_a=True)
        if divides:
            index = tf.reshape(start // block, (1,))
            return tf.raw_ops.InplaceAdd(x=acc, i=index, v=tf.reshape(product, (1, -1)))
        return tf.raw_ops.InplaceAdd(x=acc, i=tf.range(start, start + size), v=product)

    # the largest divisor of ``full`` up to _BLOCKS_PER_ITERATION: whole iterations
    unroll = max(u for u in range(1, min(full, _BLOCKS_PER_ITERATION) + 1) if full % u == 0)

    def body(i, acc):
        # block k's product overlaps block k - 1's add (it waits for block k - 2's): two
        # blocks in flight at most
        added = [acc]
        for k in range(unroll):
            after = added[max(k - 1, 0)]
            added.append(add_block(added[-1], (i * unroll + k) * block, block, after))
        return i + 1, added[-1]

    _, acc = tf.while_loop(
        lambda i, _: i < full // unroll, body, (tf.constant(0), acc), parallel_iterations=1
    )
    if divides:
        return tf.reshape(acc, (vocab, width))
    if full * block < vocab:
        acc = add_block(acc, tf.constant(full * block), vocab - full * block, acc)
    return acc


def scan_chunks(step, carry, inputs, chunk: int, rows: int, sequenced):
    """``Backend.scan_chunks`` in a graph: the first chunk (which fixes the carry's shapes),
    then one ``tf.while_loop`` over the other full chunks, then the short last chunk; outputs
    written in place into preallocated buffers. A small graph (an unrolled loop's tracing and
    optimisation cost as much memory as a chunk's logits several times over) that holds one
    chunk's buffers at a time. ``sequenced(x, after)``: ``x`` once ``after`` is computed."""
    full = rows // chunk

    def run(carry, outputs, start, size):
        part = tuple(None if x is None else _rows(x, start, size) for x in inputs)
        # the chunk starts once the previous one is done: a loop iteration's slice is ready
        # at once, and the executor would run the next chunk's logits alongside
        after = [x for x in (*carry, *outputs) if x is not None]
        if after and part[0] is not None:
            part = (sequenced(part[0], after), *part[1:])
        carry, out = step(carry, part)
        outputs = [
            None if o is None else _update_rows(buf, start, tf.cast(o, buf.dtype))
            for buf, o in zip(outputs, out, strict=True)
        ]
        return carry, outputs

    first = tuple(None if x is None else x[:chunk] for x in inputs)
    carry, out = step(carry, first)  # turns None carries into tensors
    outputs = [None if o is None else tf.zeros((rows, *o.shape[1:]), o.dtype) for o in out]
    outputs = [
        None if buf is None else _update_rows(buf, 0, o)
        for buf, o in zip(outputs, out, strict=True)
    ]
    state = [x for x in (*carry, *outputs) if x is not None]  # loop variables: no None

    def unpack(state):
        values = iter(state)
        carry_i = tuple(None if c is None else next(values) for c in carry)
        return carry_i, [None if o is None else next(values) for o in outputs]

    def body(i, *state):
        carry_i, outputs_i = run(*unpack(state), i * chunk, chunk)
        return (i + 1, *[x for x in (*carry_i, *outputs_i) if x is not None])

    _, *state = tf.while_loop(
        lambda i, *_: i < full, body, (tf.constant(1), *state), parallel_iterations=1
    )
    carry, outputs = unpack(state)
    if full * chunk < rows:
        carry, outputs = run(carry, outputs, tf.constant(full * chunk), rows - full * chunk)
    return carry, tuple(outputs)


def _rows(x: tf.Tensor, start, size: int) -> tf.Tensor:
    """``x[start:start + size]`` for a (possibly traced) ``start``."""
    return tf.slice(x, [start] + [0] * (x.shape.rank - 1), [size] + [-1] * (x.shape.rank - 1))


def _update_rows(x: tf.Tensor, start, value: tf.Tensor) -> tf.Tensor:
    """``x`` with rows ``start:start + len(value)`` replaced by ``value``; reuses ``x``'s buffer
    when nothing else holds it (TensorStridedSliceUpdate forwards its input)."""
    rank = x.shape.rank
    begin = tf.stack([start] + [0] * (rank - 1))
    end = tf.stack([start + value.shape[0], *x.shape[1:]])
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=x, begin=begin, end=end, strides=[1] * rank, value=value
    )
