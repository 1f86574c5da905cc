"""TensorFlow machinery for ``check_numerics``.

- ``mode="op"``: ``tf.debugging.enable_check_numerics()`` (native: every float op output,
  gradient ops included), turned off on exit unless it was on before. It checks NaN and inf
  together, so ``nan`` and ``inf`` must be equal on TensorFlow. TensorFlow cannot compile the
  check under ``tf.function(jit_compile=True)`` (``DebugNumericSummaryV2`` has no XLA
  kernel: such a function fails to compile), so numstab also sets
  ``tf.config.run_functions_eagerly(True)`` inside the context: every ``tf.function``, XLA
  or not, runs op by op and is checked, as ``torch.compile`` and ``jax.jit`` are.
  The callback is TensorFlow's own, but for float8, complex and eager 0-d bfloat16 outputs
  (``_Callback``).
- ``mode="sentinel"``: nothing is switched on; ``watch`` records per-leaf sums (float32 or
  wider) from a ``tf.function`` without a host sync.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.debug.lib import check_numerics_callback as tf_callback
from tensorflow.python.ops import array_ops

from numstab import _validate as v
from numstab._finite_reads import holds_nonfinite
from numstab.errors import InvalidArgumentError, NonFiniteError
from numstab.numerics import _where
from numstab.numerics._ops import op_error

_OP = re.compile(r'output (\d+) of (?:eagerly-executing|graph) op "(\w+)"')
_NODE = re.compile(r"Detected at node (\S+)")
_COUNT = re.compile(r"# of ([+-])(NaN|Inf) elements: (\d+)")


def is_enabled() -> bool:
    """Whether check_numerics is on in this thread (TensorFlow keeps it per thread)."""
    return getattr(tf_callback._state, "check_numerics_callback", None) is not None


class _Callback(tf_callback.CheckNumericsCallback):
    """TensorFlow's check-numerics op callback, except for the outputs it cannot take:
    8-bit floats (its ``CheckNumericsV2`` kernel refuses them: ``Value for attr 'T' of
    float8_e4m3fn is not in the list of allowed values``; a Keras model quantized to float8
    failed in ``mode="op"``), complex numbers (TensorFlow skipped them: a complex overflow
    was reported at the first real op after it, where JAX and NumPy name the op itself), and
    eager scalar bfloat16 outputs (TensorFlow builds its message, NaN and inf counts
    included, for every eager output, clean or not, with ``np.isinf(tensor)``, and a 0-d
    bfloat16 tensor's ``__array__`` gives a NumPy scalar, not an array: ``ValueError: object
    __array__ method not producing an array`` from ``tf.nn.gelu`` on bfloat16, whose
    ``Cast`` of a constant makes one; a Keras ``mixed_bfloat16`` model could not run; TF's
    own ``enable_check_numerics`` fails the same way). Executed eagerly, as every op in the
    context is, such an output is read on the host (float8 and bfloat16 upcast to float32;
    complex: both parts), and a NaN or inf in it raises TensorFlow's own error with its own
    message, its counts read from the host copy (a 0-d float8 NaN failed the same way);
    float6/float4 outputs hold neither. In a graph (tf.data) an op with a float8 or complex
    output is not instrumented; bfloat16 is, by TensorFlow (no values read there)."""

    def callback(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        eager = graph is None
        if not any(_read_on_host(out, eager) for out in outputs):
            return super().callback(op_type, inputs, attrs, outputs, op_name, graph)
        op = op_type.encode() if isinstance(op_type, str) else op_type
        skip = tf_callback.op_callbacks_common.OP_CALLBACK_SKIP_OPS + tf_callback.SAFE_OPS
        if not eager or op in skip:
            return None
        for slot, out in enumerate(outputs):
            on_host = _read_on_host(out, eager)
            if not (out.dtype.is_floating or on_host):
                continue
            if (op, slot) in tf_callback.IGNORE_OP_OUTPUTS or (on_host and _finite_on_host(out)):
                continue
            with np.errstate(all="ignore"):  # its NumPy counts compare complex NaN
                message = tf_callback.get_check_numerics_error_message(
                    slot,
                    len(outputs),
                    op_type,
                    _HostCopy(out) if on_host else out,
                    inputs,
                    stack_height_limit=self._stack_height_limit,
                    path_length_limit=self._path_length_limit,
                )
            if on_host:
                raise tf.errors.InvalidArgumentError(
                    None, None, f"{message} : Tensor had NaN or Inf values (read on the host)"
                )
            array_ops.check_numerics_v2(out, message)
        return None


def _read_on_host(out: tf.Tensor, eager: bool) -> bool:
    """An output TensorFlow's callback cannot check: an 8-bit float or a complex tensor, or
    (eagerly) a 0-d bfloat16 tensor, which NumPy cannot read as an array."""
    dtype = out.dtype
    return (
        dtype.is_complex
        or v.is_narrow_float(dtype.name)
        or (eager and dtype == tf.bfloat16 and out.shape.rank == 0)
    )


class _HostCopy:
    """What TensorFlow's message reads of an output (``dtype``, ``shape``, its values through
    NumPy), the values as a NumPy array: float8 and bfloat16 upcast to float32 (exact),
    complex as it is. A 0-d bfloat16 or float8 tensor gives NumPy a scalar of an ``ml_dtypes``
    type, which ``np.isinf`` refused."""

    def __init__(self, out: tf.Tensor) -> None:
        self.dtype, self.shape, self._out = out.dtype, out.shape, out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = np.asarray(self._out.numpy())
        if not self.dtype.is_complex:
            values = values.astype(np.float32)
        return values if dtype is None else values.astype(dtype)


def _finite_on_host(out: tf.Tensor) -> bool:
    """An eager float8, bfloat16 or complex tensor holds no NaN or inf (float6/float4
    cannot)."""
    if out.dtype.is_complex:
        return bool(np.isfinite(out.numpy()).all())  # both parts
    name = out.dtype.name
    if v.is_narrow_float(name) and not holds_nonfinite(name):
        return True
    return bool(np.isfinite(np.asarray(out.numpy()).astype(np.float32)).all())


def _enable() -> None:
    """``tf.debugging.enable_check_numerics()`` with ``_Callback``: TensorFlow creates its
    callback only when the thread has none."""
    tf_callback._state.check_numerics_callback = _Callback(30, 50)  # TF's defaults
    tf.debugging.enable_check_numerics()


class Arm:
    """TensorFlow's part of one active ``check_numerics`` context."""

    def __init__(self, settings, recorder) -> None:
        self.settings = settings
        self._restore: bool | None = None

    def enter(self) -> None:
        s = self.settings
        if s.mode != "op":
            return
        if s.nan != s.inf:
            raise InvalidArgumentError(
                "Expected nan == inf with TensorFlow in mode='op': tf.debugging."
                "enable_check_numerics checks NaN and inf together. Received: "
                f"nan={s.nan}, inf={s.inf}. Use both, or mode='sentinel'."
            )
        self._eagerly = tf.config.functions_run_eagerly()
        self._restore = was = is_enabled()
        if s.nan:
            tf.config.run_functions_eagerly(True)
        if s.nan and not was:
            _enable()
        elif not s.nan and was:
            tf.debugging.disable_check_numerics()

    def exit(self) -> None:
        if self._restore is None:
            return
        tf.config.run_functions_eagerly(self._eagerly)
        if self._restore and not is_enabled():
            _enable()
        elif not self._restore and is_enabled():
            tf.debugging.disable_check_numerics()
        self._restore = None

    def convert(self, exc: BaseException) -> NonFiniteError | None:
        message = str(exc)
        if not isinstance(exc, tf.errors.InvalidArgumentError) or "Infinity or NaN" not in (
            message
        ):
            return None
        match = _OP.search(message)
        index, op = (int(match.group(1)), match.group(2)) if match else (None, None)
        node = _NODE.search(message)
        node = node.group(1) if node else ""
        counts = {"NaN": 0, "Inf": 0}
        found = False
        for _sign, kind, n in _COUNT.findall(message):
            counts[kind] += int(n)
            found = True
        backward = (op or "").endswith("Grad") or "gradient" in node.lower()
        graph = "graph op" in message
        if not graph:
            backward = backward or _in_backprop(exc)
        where = _where.from_text(message) if graph else _where.from_traceback(exc.__traceback__)
        phase = "backward" if backward else "forward"
        return op_error(
            "tensorflow",
            op,
            produced=f"NaN or inf in output {index}",
            phase=phase,
            where=where,
            detail=f"tensorflow: {message.strip().splitlines()[-1][:200]}",
            nan_count=counts["NaN"] if found else None,
            inf_count=counts["Inf"] if found else None,
        )


def _in_backprop(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(("backprop.py", "imperative_grad.py")):
            return True
        tb = tb.tb_next
    return False


@tf.function(reduce_retracing=True)
def _summary(leaves: list) -> Any:
    """Per-leaf sums in float32 (float64 stays): NaN and inf propagate through a sum, one pass
    per leaf (a finite leaf whose sum overflows reads as inf); complex: real part plus
    imaginary part of the sum, as on JAX. With a float64 leaf every sum is stacked as float64
    (exact; a float64 and a float32 sum could not be stacked)."""
    sums = [_leaf_sum(x) for x in leaves]
    if any(s.dtype == tf.float64 for s in sums):
        sums = [tf.cast(s, tf.float64) for s in sums]
    return tf.stack(sums)


def _leaf_sum(x: tf.Tensor) -> tf.Tensor:
    if x.dtype.is_complex:
        s = tf.reduce_sum(x)
        s = tf.math.real(s) + tf.math.imag(s)
        return s if s.dtype == tf.float64 else tf.cast(s, tf.float32)
    return tf.reduce_sum(x) if x.dtype == tf.float64 else tf.reduce_sum(tf.cast(x, tf.float32))


def summarize(leaves: list) -> Any:
    leaves = [
        x
        for x in leaves
        if (x.dtype.is_floating or x.dtype.is_complex) and x.shape.num_elements() != 0
    ]
    return _summary(leaves) if leaves else None


@contextlib.contextmanager
def quiet():
    """TensorFlow's check off (in this thread) while ``watch`` computes its own summaries: a
    NaN is reported under the watched name, not as a ``Sum`` fault."""
    if not is_enabled():
        yield
        return
    tf.debugging.disable_check_numerics()
    try:
        yield
    finally:
        if not is_enabled():
            _enable()


def read_summaries(summaries: list) -> list[tuple[bool, bool]]:
    out = []
    for s in summaries:
        sums = np.zeros(1) if s is None else s.numpy()
        out.append((bool(np.isnan(sums).any()), bool(np.isinf(sums).any())))
    return out
