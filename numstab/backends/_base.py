"""The primitives a backend provides, and the generic forms of the composite ones.

A backend is a small table of primitives over its framework's native arrays. Algorithms
(numstab.losses, ...) are written once on top of these, plus Python operators, which every
framework overloads. A backend may add ``native_<op>`` methods: fused framework kernels with
exactly the semantics of the generic ``<op>``. ``native_op`` picks them unless the environment
variable ``NUMSTAB_FORCE_GENERIC=1`` asks for the generic path (the test suite runs both).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

from numstab import _validate as v
from numstab.backends._native import FORCE_GENERIC_ENV, generic_forced, has_native, native_op
from numstab.backends._tree_ops import TreeOps

__all__ = [
    "FORCE_GENERIC_ENV",
    "Array",
    "Backend",
    "generic_forced",
    "has_native",
    "native_op",
    "numpy_dtype_name",
]

Array = Any


@functools.cache
def numpy_dtype_name(dtype: Any) -> str:
    """``dtype.name`` of a NumPy dtype (JAX arrays have them too), cached: NumPy builds the
    name in Python on every access (~3 us), and tree and data functions ask per leaf."""
    return dtype.name


class Backend(TreeOps, abc.ABC):
    """Primitives over one framework's arrays. Subclasses implement every abstract method;
    the composites at the end are generic (a subclass may add ``native_<name>`` versions)."""

    name: str = "abstract"
    #: dtype of class indices (JAX without x64 has no int64)
    index_dtype: str = "int64"
    #: fused linear cross-entropy's default chunk: float32 logits of about this many bytes
    fused_chunk_bytes: int = 32 * 2**20
    #: the same on a GPU: its products need about 2048 rows to run at speed (docs/performance.md §3)
    fused_chunk_bytes_gpu: int = 2**30
    #: whether its kernels flush float32 subnormals to 0 (TensorFlow, XLA): a loss scale's
    #: reciprocal past 2**126 is one, so ``LossScaler.unscale`` takes ``unscale_leaves``
    flushes_subnormals: bool = False

    # -- conversion and metadata ------------------------------------------------------------
    @abc.abstractmethod
    def asarray(self, x: Any, dtype: str | None = None, like: Array | None = None) -> Array:
        """Convert host data (NumPy, scalars) to this framework, on the device of ``like``."""

    @abc.abstractmethod
    def to_numpy(self, x: Array) -> Any:
        """A NumPy copy (bfloat16 becomes float32, which holds it exactly)."""

    def replicated(self, x: Array) -> Array:
        """``x`` as a plain array holding its whole (global) value on this process. Only a
        torch ``DTensor`` changes: its ``full_tensor()``, a collective every rank joins."""
        return x

    @abc.abstractmethod
    def dtype_name(self, x: Array) -> str:
        """Canonical dtype name: 'float16', 'bfloat16', 'float32', 'int64', 'bool', ..."""

    @abc.abstractmethod
    def cast(self, x: Array, dtype: str) -> Array: ...

    @abc.abstractmethod
    def shape(self, x: Array) -> tuple[int | None, ...]:
        """Static shape; None marks a dimension unknown while tracing."""

    @abc.abstractmethod
    def reshape(self, x: Array, shape: tuple[int, ...]) -> Array: ...

    @abc.abstractmethod
    def moveaxis(self, x: Array, source: int, destination: int) -> Array: ...

    def size(self, x: Array, dtype: str) -> int | Array:
        """Number of elements: a Python int when static, else a scalar array of ``dtype`` (a
        ``jax.export`` symbolic size: a value of the program)."""
        n = math.prod(self.shape(x))
        return n if isinstance(n, int) else self.asarray(n, dtype)

    @abc.abstractmethod
    def unflatten_rows(self, rows: Array, like: Array) -> Array:
        """Reshape a vector of per-row values to ``like.shape[:-1]`` (dynamic shapes too)."""

    @abc.abstractmethod
    def arange(self, n: int, like: Array | None = None) -> Array:
        """Integers 0..n-1, on the device of ``like``."""

    @abc.abstractmethod
    def is_tracing(self, x: Array) -> bool:
        """True inside jit / tf.function / torch.compile, where values cannot be read."""

    def can_read(self, x: Array) -> bool:
        """True when ``x``'s values can be read on the host now (not traced)."""
        return not self.is_tracing(x)

    def host_view(self, x: Array) -> Any:
        """``x``'s values as a NumPy array, where reading them waits for no device and no
        trace (an eager array in host memory), else None. For small state machines
        (ZClip's statistics): NumPy's 0-d ops cost less than a framework's eager dispatch."""
        return None

    def compiled_eager(self, fn: Callable[..., Array], static: tuple[str, ...]) -> Callable:
        """``fn`` for eager calls on readable arrays, its ``static`` arguments (names) being
        hashable settings: ``fn`` itself here. A backend whose eager ops each cost a dispatch
        compiles it once per settings and shapes (JAX: ``jax.jit``), so that a whole loss is
        one dispatch; the result must equal ``fn``'s to rounding."""
        return fn

    def label_summary(self, labels: Array, ignore_index: int) -> tuple[int, int, bool]:
        """(min, max, any ignored) of an integer array, read on the host in one transfer;
        labels equal to ``ignore_index`` count as 0 in min and max ((0, 0, False) if empty)."""
        host = self.to_numpy(labels)
        if host.size == 0:
            return 0, 0, False
        ignored = host == ignore_index
        counted = host * ~ignored  # no NumPy import here: importing numstab imports none
        return int(counted.min()), int(counted.max()), bool(ignored.any())

    def float_errors_ignored(self) -> contextlib.AbstractContextManager:
        """A context in which IEEE warnings (log(0), inf - inf) are not reported."""
        return contextlib.nullcontext()

    # -- elementwise and reductions ----------------------------------------------------------
    @abc.abstractmethod
    def where(self, condition: Array, x: Array | float, y: Array | float) -> Array: ...

    @abc.abstractmethod
    def exp(self, x: Array) -> Array: ...

    def stop_gradient(self, x: Array) -> Array:
        """``x``, treated as a constant by automatic differentiation (identity without it)."""
        return x

    @abc.abstractmethod
    def log(self, x: Array) -> Array: ...

    @abc.abstractmethod
    def isfinite(self, x: Array) -> Array: ...

    def elements(self, x: Array) -> Array:
        """``x``'s values as an array every reduction takes: ``x`` itself, but for a torch
        nested tensor (its components, concatenated flat)."""
        return x

    @abc.abstractmethod
    def real_view(self, x: Array) -> Array:
        """A complex ``x`` as a real array of shape ``(*x.shape, 2)``: its (real, imaginary)
        pairs, as ``torch.view_as_real`` (a view where the framework has one)."""

    @abc.abstractmethod
    def abs(self, x: Array) -> Array: ...

    @abc.abstractmethod
    def sqrt(self, x: Array) -> Array: ...

    @abc.abstractmethod
    def maximum(self, x: Array, y: Array | float) -> Array: ...

    @abc.abstractmethod
    def clip(self, x: Array, low: float, high: float) -> Array: ...

    @abc.abstractmethod
    def all(self, x: Array) -> Array:
        """Logical AND of every element, as a 0-d boolean array (no host sync)."""

    @abc.abstractmethod
    def stack(self, arrays: list[Array]) -> Array: ...

    @abc.abstractmethod
    def sum(self, x: Array, axis: int | None = None, keepdims: bool = False) -> Array: ...

    @abc.abstractmethod
    def max(self, x: Array, axis: int | None = None, keepdims: bool = False) -> Array: ...

    @abc.abstractmethod
    def any(self, x: Array) -> bool:
        """Host-side truth of any element: a device sync, for eager validation only."""

    # -- indexing ----------------------------------------------------------------------------
    @abc.abstractmethod
    def take_rows(self, x: Array, index: Array) -> Array:
        """``out[i] = x[i, index[i]]`` for a 2-D ``x`` and in-range integer ``index``."""

    @abc.abstractmethod
    def gather(self, vector: Array, index: Array) -> Array:
        """``vector[index]`` for a 1-D ``vector`` and in-range integer ``index``."""

    @abc.abstractmethod
    def bitcast(self, x: Array, dtype: str) -> Array:
        """The bits of ``x`` read as ``dtype``, of the same width (float16 <-> int16,
        float32 <-> int32): no conversion of values."""

    # -- generic composites (backends may add native_* fused versions; the tree ones: TreeOps) --
    def step_toward_zero(self, x: Array) -> Array:
        """The next representable value toward 0 of each element of a 16-bit float array,
        for nonzero ``x`` (elsewhere the result is unspecified): the bits read as int16,
        minus 1 (sign and magnitude: one less magnitude, whatever the sign)."""
        return self.bitcast(self.bitcast(x, "int16") - 1, self.dtype_name(x))

    def count(self, mask: Array, axis: int | None, dtype: str, keepdims: bool = False) -> Array:
        """Number of true entries along ``axis``, as ``dtype``."""
        return self.sum(self.cast(mask, dtype), axis=axis, keepdims=keepdims)

    def one_hot(self, labels: Array, num_classes: int, dtype: str) -> Array:
        """``out[..., c] = (labels[..., None] == c)`` as ``dtype``."""
        return self.cast(labels[..., None] == self.arange(num_classes, like=labels), dtype)

    def logsumexp(self, x: Array, axis: int = -1, keepdims: bool = False) -> Array:
        """log(sum(exp(x))) shifted by the finite max: all -inf gives -inf, +inf gives +inf."""
        m = self.max(x, axis=axis, keepdims=True)
        m = self.where(self.isfinite(m), m, 0.0)
        total = self.sum(self.exp(x - m), axis=axis, keepdims=keepdims)
        if not keepdims:
            m = self.sum(m, axis=axis)  # summing a length-1 axis drops it, exactly
        return self.log(total) + m

    def row_shift(self, x: Array) -> tuple[Array, Array]:
        """``(m, m_row)``: the max over the last axis where finite, else 0 (a row of all -inf,
        or holding +inf or NaN), kept as ``(..., 1)`` and dropped to ``x.shape[:-1]``; no
        gradient (every use below is invariant to it).

        ``lse(x) - x[c] = lse(x - m) - (x[c] - m)``: the right side keeps full precision at
        any common offset, where the left loses every digit once the offset's ulp exceeds
        the spread (float32 logits at 1e6: ulp 0.0625). ``x - m`` is exact for entries
        within a factor 2 of m (Sterbenz) and never overflows unless the spread does. Use it
        inside the reductions (``sum(f(x - m))``) and subtract ``m_row`` from gathered
        values: a materialised ``x - m`` read by several reductions cost 1.4x under jax.jit.
        """
        m = self.max(x, axis=-1, keepdims=True)
        m = self.stop_gradient(self.where(self.isfinite(m), m, 0.0))
        return m, self.sum(m, axis=-1)  # summing a length-1 axis drops it, exactly

    def shifted_logsumexp(self, x: Array) -> Array:
        """``logsumexp(x, axis=-1)`` of rows already shifted by their max (``row_shift``):
        a backend whose compiler fuses ``log(sum(exp(x)))`` may skip logsumexp's own max."""
        return native_op(self, "logsumexp")(x, axis=-1)

    def log_softmax(self, x: Array) -> Array:
        """(x - m) - log(sum(exp(x - m))) over the last axis, m the row max.

        Shifting before subtracting keeps precision for large common offsets. A row of all
        -inf is NaN, and so is a row holding +inf (inf - inf), as in the native kernels.
        """
        m = self.max(x, axis=-1, keepdims=True)
        shifted = x - self.where(m == -float("inf"), 0.0, m)
        return shifted - self.log(self.sum(self.exp(shifted), axis=-1, keepdims=True))

    def softmax_nll(self, logits: Array, labels: Array) -> Array:
        """Per-row -log_softmax(logits)[label] for 2-D logits and in-range labels."""
        return -self.take_rows(self.log_softmax(logits), labels)

    def softmax_nll_grad(self, x: Array, labels: Array) -> tuple[Array, Array]:
        """``(lse(x) - x[y], softmax(x) - onehot(y))`` per row of a 2-D ``x``: hard-label
        cross-entropy and its gradient w.r.t. ``x``, from one log-softmax."""
        log_p = self.log_softmax(x)
        onehot = self.one_hot(labels, self.shape(x)[-1], self.dtype_name(x))
        return -self.take_rows(log_p, labels), self.exp(log_p) - onehot

    def mean_softmax_nll(
        self, x: Array, labels: Array, ignore_index: int, label_smoothing: float = 0.0
    ) -> Array | None:
        """``cross_entropy(x, labels, ignore_index=ignore_index, label_smoothing=...)`` (the
        mean over counted rows; ``label_smoothing`` in [0, 1], spread over all K classes: the
        full path's K_valid wherever the loss is finite, since a -inf class makes it +inf)
        where a backend can give it exactly in one fused call, else None: the full path then
        validates and computes. A ``native_`` version must return None for anything whose
        answer could differ from the full path's: bad or ignored-only labels, non-finite
        losses, traced or unusual arrays (the full path then raises or handles them)."""
        return None

    def smoothed_nll(self, x: Array, labels: Array, eps: float, weight: Array | None) -> Array:
        """Per row, label smoothing over ALL K classes (torch's ``label_smoothing`` rows):
        ``(1 - eps) * w[y] * (lse - x[y]) + eps / K * sum_c w[c] * (lse - x[c])``, w = 1
        without ``weight``, shifted by ``row_shift`` (lse here is lse(x - m)). A row holding a
        -inf (masked) class must come out non-finite."""
        m, m_row = self.row_shift(x)
        lse = native_op(self, "shifted_logsumexp")(x - m)
        nll = lse - (self.take_rows(x, labels) - m_row)
        count = self.shape(x)[-1]
        if weight is None:  # the mean as a sum of x / K: a sum of x may overflow where it may not
            return nll * (1.0 - eps) + (lse - self.sum((x - m) * (1.0 / count), axis=-1)) * eps
        nll = nll * self.gather(weight, labels)
        smooth = lse * self.sum(weight) - self.sum((x - m) * weight, axis=-1)
        return nll * (1.0 - eps) + smooth * (eps / count)

    def finite_or_exact(
        self, fast: Callable[[], Array], exact: Callable[[], Array], like: Array
    ) -> Array:
        """``fast()`` when all of it is finite, else ``exact()``: for a cheap formula that is
        exact wherever its result is finite. Eager: one host read. Where values cannot be read
        (``can_read(like)`` is False): ``exact()`` alone; a backend with graph control flow may
        branch on device instead."""
        if not self.can_read(like):
            return exact()
        candidate = fast()
        return exact() if self.any(~self.isfinite(candidate)) else candidate

    # -- schedules and adaptive clipping --
    @abc.abstractmethod
    def cos(self, x: Array) -> Array: ...

    # -- fused cross-entropy --
    @abc.abstractmethod
    def matmul(
        self, a: Array, b: Array, transpose_a: bool = False, transpose_b: bool = False
    ) -> Array:
        """``op(a) @ op(b)`` for 2-D arrays of one dtype, op = transpose where asked."""

    @abc.abstractmethod
    def concat(self, arrays: list[Array]) -> Array:
        """Join arrays along axis 0."""

    def add_at_rows(self, x: Array, index: Array, values: Array) -> Array:
        """``x`` with ``values[i]`` added at ``[i, index[i]]`` (2-D ``x``, in-range index).

        May reuse ``x``'s memory: the caller must not use ``x`` afterwards."""
        hit = self.reshape(index, (-1, 1)) == self.reshape(
            self.arange(self.shape(x)[-1], like=index), (1, -1)
        )
        return x + self.where(hit, self.reshape(values, (-1, 1)), 0.0)

    def fused_chunk_budget(self, x: Array) -> int:
        """Bytes of float32 logits per chunk of fused cross-entropy for ``x``'s device:
        ``fused_chunk_bytes_gpu`` on a GPU (``on_gpu``), else ``fused_chunk_bytes``."""
        return self.fused_chunk_bytes_gpu if self.on_gpu(x) else self.fused_chunk_bytes

    def on_gpu(self, x: Array) -> bool:
        """Whether ``x`` (or a computation traced on it) lives on a GPU."""
        return False

    def matmul_accumulate(self, acc: Array | None, a: Array, b: Array) -> Array:
        """``acc + a.T @ b`` for ``a`` and ``b`` of one dtype, in ``compute_dtype`` of it:
        16-bit operands are multiplied exactly and summed in float32 (what a tensor-core GEMM
        with a float32 output does, up to the order of the sums). ``a.T @ b`` when ``acc`` is
        None. May reuse ``acc``'s memory."""
        wide = v.compute_dtype(self.dtype_name(a))
        product = self.matmul(self.cast(a, wide), self.cast(b, wide), transpose_a=True)
        return product if acc is None else acc + product

    def scale_owned(self, x: Array, factor: Array) -> Array:
        """``x * factor`` in ``x``'s dtype; may reuse ``x``'s memory (the caller owns it)."""
        return x * self.cast(factor, self.dtype_name(x))

    def shift_owned(self, x: Array, shift: Array) -> Array:
        """``x - shift`` (``row_shift``'s ``m``); may reuse ``x``'s memory (the caller owns it
        and does not use ``x`` afterwards)."""
        return x - shift

    def softmax_grad_owned(self, x: Array, lse: Array, scale: Array, shift: Array | None) -> Array:
        """``exp(x - lse[:, None]) * scale[:, None] - shift[:, None]`` (no shift when None), for
        2-D ``x``; may reuse ``x``'s memory (the caller must not use ``x`` afterwards)."""
        out = self.exp(x - self.reshape(lse, (-1, 1))) * self.reshape(scale, (-1, 1))
        return out if shift is None else out - self.reshape(shift, (-1, 1))

    def sequenced(self, x: Array, after: list[Array]) -> Array:
        """``x``, made available only once ``after`` is computed: keeps a graph executor from
        running the chunks of a loop side by side (and holding all their buffers at once)."""
        return x

    def scan_chunks(
        self, step: Callable, carry: Any, inputs: tuple, chunk: int, rows: int
    ) -> tuple[Any, tuple]:
        """Fold ``step(carry, chunk_inputs) -> (carry, chunk_outputs)`` over consecutive chunks
        of ``chunk`` rows (the last may be shorter) of every array in ``inputs`` (None entries
        pass as None). Returns the final carry and each output concatenated over the chunks
        (None stays None). The first chunk may turn None carry entries into arrays; after it
        the carry keeps its shapes and dtypes. Here: a Python loop, each chunk sequenced after
        the previous one."""
        outputs, previous = [], None
        for start in range(0, max(rows, 1), chunk):
            part = slice(start, min(start + chunk, rows))
            sliced = tuple(None if x is None else x[part] for x in inputs)
            if previous is not None and sliced[0] is not None:
                sliced = (self.sequenced(sliced[0], previous), *sliced[1:])
            carry, out = step(carry, sliced)
            previous = [o for o in (*out, *carry) if o is not None] or None
            outputs.append(out)
        return carry, self._concat_outputs(outputs)

    def _concat_outputs(self, outputs: list[tuple]) -> tuple:
        return tuple(
            None if parts[0] is None else self.concat(list(parts))
            for parts in zip(*outputs, strict=True)
        )

    def autocast_operands(self, *arrays: Array | None) -> tuple:
        """The operands of a fused linear layer as the framework's mixed-precision context
        would cast them for its own linear layer (torch.autocast); here as they are."""
        return arrays

    def custom_gradient(
        self,
        forward: Callable[[tuple, tuple], tuple[Array, Any]],
        backward: Callable[[Any, Array], tuple],
        args: tuple,
    ) -> Array:
        """``forward(args, needs)[0]``, differentiated by ``backward`` instead of autograd.

        ``forward(args, needs) -> (out, residuals)``, residuals a flat tuple of arrays or
        None; ``needs[i]`` is True when ``args[i]`` may
        need a gradient (a framework that cannot tell says True for every float argument).
        ``backward(residuals, cotangent_of_out) -> one gradient per arg`` (None where not
        needed, and for integer or None args). Without autograd (NumPy) only the value is
        computed."""
        return forward(args, (False,) * len(args))[0]

    # -- data firewall --
    @abc.abstractmethod
    def compress(self, x: Array, keep: Array, axis: int) -> Array:
        """The slices of ``x`` along ``axis`` where ``keep`` is true; ``keep`` is a host (NumPy)
        1-D boolean array. Eager only: the result's size depends on ``keep``."""
