"""The TensorFlow backend: tf.Tensor and tf.Variable, eagerly and inside tf.function."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from numstab.backends._base import Backend
from numstab.errors import InvalidArgumentError
from numstab.frameworks.tensorflow import fused
from numstab.frameworks.tensorflow.fused import cpu_only, in_xla_context


def _exclude_numstab_from_autograph() -> None:
    """tf.function's AutoGraph rewrites the Python of every function it reaches, numstab's
    included, and wraps its exceptions in StagingError. numstab is plain graph-safe code:
    list it beside tensorflow's own modules, which AutoGraph leaves alone. (Runs once, when
    this backend loads: at ``import numstab`` if tensorflow was imported first, else right
    after ``import tensorflow`` (``numstab.backends._on_import``), or at the first numstab
    call on TF tensors where that could not run.)"""
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:  # a future layout: AutoGraph still works, only slower to trace
        return
    config.CONVERSION_RULES = (config_lib.DoNotConvert("numstab"), *config.CONVERSION_RULES)


_exclude_numstab_from_autograph()


_FAST_FLOATS = (tf.float32, tf.float64)
_FAST_INDICES = (tf.int32, tf.int64)


def is_finite(x: tf.Tensor) -> tf.Tensor:
    """``tf.math.is_finite``, which has no complex kernel, also for complex ``x``: an
    element is finite when both of its parts are (NumPy's rule)."""
    if x.dtype.is_complex:
        return tf.math.logical_and(
            tf.math.is_finite(tf.math.real(x)), tf.math.is_finite(tf.math.imag(x))
        )
    return tf.math.is_finite(x)


def _as_operand(value, like):
    """TF ops want tensors of one dtype: a Python scalar takes the dtype of ``like``. A float
    ``like`` gets it rounded once, from its own value (``tf.cast`` of a Python float went
    through float32: it rounded twice, raised past float32's range even for a float64
    ``like``, and cost 13 against 4 us eagerly); an integer one truncates it, as a cast."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return value
    if like.dtype.is_floating:
        return tf.constant(value, dtype=like.dtype)
    return tf.cast(value, like.dtype)


class TensorflowBackend(Backend):
    name = "tensorflow"
    # each chunk rereads the whole weight gradient: 256 rows at vocab 65536 halve that per
    # row (fused / unfused time 1.34 -> 1.19 on an idle CPU; docs 11.1 "Gradient and memory")
    fused_chunk_bytes = 64 * 2**20
    flushes_subnormals = True  # its CPU kernels: 1 / 2**127 is 0

    def asarray(self, x, dtype=None, like=None):
        if isinstance(x, float) and dtype in ("float64", "float16", "bfloat16"):
            # straight to dtype: converting first rounds a Python float to float32
            # (0.1 -> 0.1000000015 in float64)
            return tf.constant(x, dtype=dtype)
        x = tf.convert_to_tensor(x)
        return tf.cast(x, dtype) if dtype else x

    def to_numpy(self, x):
        if isinstance(x, tf.SparseTensor):  # the dense array (quarantine, outlier features)
            x = tf.sparse.to_dense(x)
        elif isinstance(x, tf.RaggedTensor):
            raise InvalidArgumentError(
                f"Expected a tensor with fixed-size samples (quarantine files and outlier "
                f"features are dense arrays). Received: a ragged tensor of shape {x.shape}; "
                f"pass outlier_fields= a callable for outlier features"
            )
        if x.dtype == tf.bfloat16:
            x = tf.cast(x, tf.float32)
        return x.numpy()

    def dtype_name(self, x):
        return x.dtype.name

    def cast(self, x, dtype):
        return tf.cast(x, dtype)

    def shape(self, x):
        return tuple(x.shape.as_list()) if x.shape.rank is not None else ()

    def reshape(self, x, shape):
        if _has_shape(x, shape):  # eager tf.reshape costs ~100 us even when it has no work
            return x
        return tf.reshape(x, shape)

    def moveaxis(self, x, source, destination):
        rank = x.shape.rank
        order = [a for a in range(rank) if a != source % rank]
        order.insert(destination % rank, source % rank)
        return tf.transpose(x, order)

    def size(self, x, dtype):
        if x.shape.is_fully_defined():
            return x.shape.num_elements()
        return tf.cast(tf.size(x), dtype)

    def unflatten_rows(self, rows, like):
        return tf.reshape(rows, tf.shape(like)[:-1])

    def arange(self, n, like=None):
        # TF compares only equal dtypes: an integer ``like`` (labels) sets the dtype
        integer = like is not None and like.dtype.is_integer
        return tf.range(n, dtype=like.dtype if integer else tf.int32)

    def is_tracing(self, x):
        return not tf.executing_eagerly()

    def host_view(self, x):
        eager = tf.executing_eagerly() and isinstance(x, tf.Tensor) and hasattr(x, "numpy")
        return x.numpy() if eager and "CPU" in x.device else None

    def where(self, condition, x, y):
        if not isinstance(x, (tf.Tensor, tf.Variable)):
            x = _as_operand(x, y)
        return tf.where(condition, x, _as_operand(y, x))

    def exp(self, x):
        return tf.exp(x)

    def stop_gradient(self, x):
        return tf.stop_gradient(x)

    def bitcast(self, x, dtype):
        return tf.bitcast(x, dtype)

    def log(self, x):
        return tf.math.log(x)

    def isfinite(self, x):
        return is_finite(x)

    def real_view(self, x):
        return tf.stack([tf.math.real(x), tf.math.imag(x)], axis=-1)

    def abs(self, x):
        return tf.abs(x)

    def sqrt(self, x):
        return tf.sqrt(x)

    def maximum(self, x, y):
        return tf.maximum(x, _as_operand(y, x))

    def clip(self, x, low, high):
        return tf.clip_by_value(x, _as_operand(low, x), _as_operand(high, x))

    def all(self, x):
        axes = _all_axes(x)
        return tf.reduce_all(x) if axes is None else tf.raw_ops.All(input=x, axis=axes)

    def stack(self, arrays):
        return tf.stack(arrays)

    def sum(self, x, axis=None, keepdims=False):
        axes = None if axis is not None or keepdims else _all_axes(x)
        if axes is None:
            return tf.reduce_sum(x, axis=axis, keepdims=keepdims)
        return tf.raw_ops.Sum(input=x, axis=axes)

    def max(self, x, axis=None, keepdims=False):
        axes = None if axis is not None or keepdims else _all_axes(x)
        if axes is None:
            return tf.reduce_max(x, axis=axis, keepdims=keepdims)
        return tf.raw_ops.Max(input=x, axis=axes)

    def any(self, x):
        return bool(tf.reduce_any(x))

    def take_rows(self, x, index):
        # tf.gather(x, index, batch_dims=1)'s op, without its Python wrapper (~45 us eagerly)
        return tf.raw_ops.GatherV2(params=x, indices=index, axis=1, batch_dims=1)

    def gather(self, vector, index):
        return tf.gather(vector, index)

    # fused kernels with the generic semantics
    def native_leaf_norms(self, leaves, ord, dtype):
        if ord != 2.0:
            return super().leaf_norms(leaves, ord, dtype)
        # l2_loss = sum(x**2) / 2 in one fused pass, as tf.clip_by_global_norm does
        return tf.sqrt(2.0 * tf.stack(_half_squares(leaves, dtype)))

    def native_unscale_leaves(self, leaves, scale):
        # one division a leaf: Grappler reassociates the generic's (x * a) * s into x * (a * s)
        # (a flushed 2**-127 again) and keeps x / s; the generic's values for powers of two,
        # the correctly rounded quotient for other scales (the generic's: within one ulp)
        out = []
        for leaf in leaves:
            if leaf.dtype in (tf.float32, tf.float64, tf.complex64, tf.complex128):
                out.append(leaf / tf.cast(scale, leaf.dtype))
            else:
                out.append(tf.cast(tf.cast(leaf, tf.float32) / scale, leaf.dtype))
        return out

    def native_global_norm(self, leaves, ord, dtype):
        if ord != 2.0:
            return super().global_norm(leaves, ord, dtype)
        # tf.linalg.global_norm's ops (one l2_loss per leaf, eager ops cost ~10 us each),
        # with 16-bit leaves cast first: their squares would overflow
        return tf.sqrt(2.0 * tf.add_n(_half_squares(leaves, dtype)))

    def native_logsumexp(self, x, axis=-1, keepdims=False):
        return tf.reduce_logsumexp(x, axis=axis, keepdims=keepdims)

    def native_log_softmax(self, x):
        return tf.nn.log_softmax(x, axis=-1)

    def native_softmax_nll(self, logits, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    def native_mean_softmax_nll(self, x, labels, ignore_index, label_smoothing=0.0):
        # eager CPU tensors only: there the kernel raises on out-of-range labels, ignored
        # ones included (on a GPU they are NaN rows), and reading the loss costs no sync.
        # The raw ops: tf.nn's wrapper costs ~40 us of Python on a tiny batch, reduce_mean
        # ~40 more
        if (
            not isinstance(x, tf.Tensor)
            or not isinstance(labels, tf.Tensor)
            or x.dtype not in _FAST_FLOATS
            or labels.dtype not in _FAST_INDICES
            or x.shape.rank != 2
            or labels.shape.rank != 1
            or not tf.executing_eagerly()
            or "CPU" not in x.device
            or 0 <= ignore_index < x.shape[-1]  # a class id to the kernel, which ignores none
            or label_smoothing  # the dense kernel takes any label: the full path checks them
        ):
            return None
        try:
            rows, _ = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels)
        except (tf.errors.OpError, ValueError, TypeError):  # the full path names the problem
            return None
        loss = tf.raw_ops.Mean(input=rows, axis=0)
        # non-finite: an empty batch (0 / 0), ignored labels (NaN rows off the CPU), or -inf
        # / +inf / NaN logits, whose rows the full path defines
        return loss if math.isfinite(float(loss)) else None

    def native_smoothed_nll(self, x, labels, eps, weight):
        if weight is not None:  # the fused kernel's gradient assumes targets that sum to 1
            return super().smoothed_nll(x, labels, eps, weight)
        count = x.shape[-1]
        targets = tf.one_hot(labels, count, on_value=1.0 - eps + eps / count,
                             off_value=eps / count, dtype=x.dtype)  # fmt: skip
        return tf.nn.softmax_cross_entropy_with_logits(labels=targets, logits=x)

    def finite_or_exact(self, fast, exact, like):
        if tf.executing_eagerly():
            return super().finite_or_exact(fast, exact, like)
        candidate = fast()  # in a graph: branch on device
        return tf.cond(tf.reduce_all(tf.math.is_finite(candidate)), lambda: candidate, exact)

    # -- schedules and adaptive clipping --
    def cos(self, x):
        return tf.cos(x)

    # -- fused cross-entropy --
    def matmul(self, a, b, transpose_a=False, transpose_b=False):
        if transpose_b and not transpose_a and cpu_only() and not in_xla_context():
            # TF's CPU MatMul (oneDNN) runs a @ b.T with transpose_b ~2x slower than
            # BatchMatMulV2 with adj_y (the chunk logits [C, d] x [V, d]: 339 against 173 ms
            # of CPU at C=128, d=1024, V=65536); (b @ a.T).T, 220 ms + its transpose, held
            # the product and its transpose at once: two [C, V] buffers where this has one
            return tf.raw_ops.BatchMatMulV2(x=a, y=b, adj_y=True)
        return tf.linalg.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)

    def concat(self, arrays):
        return tf.concat(arrays, axis=0)

    def add_at_rows(self, x, index, values):
        rows = tf.range(tf.shape(x, out_type=index.dtype)[0], dtype=index.dtype)
        return tf.tensor_scatter_nd_add(x, tf.stack([rows, index], axis=1), values)

    def sequenced(self, x, after):
        if tf.executing_eagerly():
            return x
        with tf.control_dependencies(after):
            return tf.identity(x)

    def native_softmax_nll_grad(self, x, labels):
        # (lse - x[y], softmax(x) - onehot(y)) from the one kernel behind sparse softmax CE
        return tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels)

    def on_gpu(self, x):
        return "GPU" in (x.device or "")  # a symbolic tensor's may be unset: the CPU's budget

    def matmul_accumulate(self, acc, a, b):
        if acc is None or tf.executing_eagerly() or in_xla_context():
            return super().matmul_accumulate(acc, a, b)
        return fused.matmul_accumulate(acc, a, b)  # in place, a block of rows at a time

    def scan_chunks(self, step, carry, inputs, chunk, rows):
        if tf.executing_eagerly() or rows // chunk < 3 or in_xla_context():
            return super().scan_chunks(step, carry, inputs, chunk, rows)
        return fused.scan_chunks(step, carry, inputs, chunk, rows, self.sequenced)

    def custom_gradient(self, forward, backward, args):
        present = [i for i, a in enumerate(args) if a is not None]
        # a tf.Variable argument is read here, so its gradient flows through the read
        tensors = [tf.convert_to_tensor(args[i]) for i in present]
        recording = not tf.executing_eagerly() or _tape_may_record()

        @tf.custom_gradient
        def fn(*inputs):
            full = [None] * len(args)
            for i, t in zip(present, inputs, strict=True):
                full[i] = t
            needs = tuple(recording and t is not None and t.dtype.is_floating for t in full)
            out, residuals = forward(tuple(full), needs)

            def grad(cotangent):
                grads = backward(residuals, cotangent)
                return [grads[i] for i in present]

            return out, grad

        return fn(*tensors)

    # -- data firewall --
    def compress(self, x, keep, axis):
        # one gather of host indices: eager tf.boolean_mask is ~10 Python-level ops, ~3 ms
        return tf.gather(x, np.flatnonzero(keep), axis=axis)


BACKEND = TensorflowBackend()


def _half_squares(leaves: list, dtype: str) -> list:
    """``tf.nn.l2_loss(tf.cast(x, dtype))`` (sum(x**2) / 2) of each leaf, through the raw
    ops: eagerly the Python wrappers cost more per leaf than a small leaf's kernel."""
    want = tf.as_dtype(dtype)
    return [
        tf.raw_ops.L2Loss(t=x if x.dtype == want else tf.raw_ops.Cast(x=x, DstT=want))
        for x in leaves
    ]


def _has_shape(x, shape) -> bool:
    """True when ``x`` statically has ``shape`` (a tuple or list; one -1 allowed)."""
    if not isinstance(shape, tuple | list) or x.shape.rank != len(shape):
        return False
    static = x.shape.as_list()
    return (
        None not in static
        and sum(d == -1 for d in shape) <= 1
        and all(d in (-1, s) for d, s in zip(shape, static, strict=True))
    )


#: rank -> the int32 tensor [0, 1, ..., rank - 1]: reduction axes of a full eager reduction
_AXES: dict[int, tf.Tensor] = {}


def _all_axes(x) -> tf.Tensor | None:
    """Every axis of ``x``, as a cached host int32 tensor, for a full reduction executed
    eagerly; None in a graph or for an unknown rank (tf.reduce_* then build the axes).

    Same op, same kernel as ``tf.reduce_*(x)``: only the conversion of the axes from NumPy,
    which costs more than a small reduction itself, is done once per rank."""
    rank = x.shape.rank
    if rank is None or not tf.executing_eagerly():
        return None
    axes = _AXES.get(rank)
    if axes is None:
        with tf.device("/CPU:0"):
            axes = _AXES[rank] = tf.constant(list(range(rank)), tf.int32)
    return axes


# -- fused cross-entropy --
def _tape_may_record() -> bool:
    """Whether an eager GradientTape may be watching (else no gradient can be asked for)."""
    try:
        from tensorflow.python.eager import record
    except ImportError:  # a future layout: assume a tape
        return True
    return bool(record.could_possibly_record())
