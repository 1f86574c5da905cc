"""Numerically stable softmax cross-entropy, written once over the backend primitives.

Everything is computed through log-sum-exp in float32 at least: float16 and bfloat16 inputs
are upcast and the results come back in float32 (float64 stays float64).
See docs/semantics.md for the full contract.
"""

from __future__ import annotations

from typing import Any

from numstab import _validate as v
from numstab._config import AUTO, configured_backend
from numstab._dispatch import HOST, resolve_backend
from numstab._dispatch import framework_of as _framework_of
from numstab._dispatch import to_backend as _to_backend
from numstab._layouts import dense_only
from numstab._loss_checks import (
    check_label_shape,
    class_count,
    class_ids,
    int_bounds,
    matchable_ignore_index,
    raise_out_of_range,
    required,
    to_labels,
)
from numstab.backends import load_backend
from numstab.backends._base import Backend, native_op
from numstab.errors import InvalidArgumentError

Array = Any
INF = float("inf")
NAN = float("nan")
REDUCTIONS = ("mean", "sum", "none")


def _prepare(be: Backend, x: Array, name: str, axis: int) -> tuple[Array, int, str]:
    """Validate a float array, upcast it to the compute dtype and move ``axis`` last."""
    dtype = be.dtype_name(x)
    v.check_floating(name, dtype)
    rank = len(be.shape(x))
    if rank == 0:
        raise InvalidArgumentError(f"Expected {name} of rank >= 1. Received: {name}.shape=()")
    axis = v.normalize_axis(axis, rank)
    cdt = v.compute_dtype(dtype)
    if dtype != cdt:
        x = be.cast(x, cdt)
    if axis != rank - 1:
        x = be.moveaxis(x, axis, -1)
    return x, axis, cdt


def _classes_last(x: Array, axis: int, backend: str | None) -> tuple[Backend, Array, int]:
    """(backend, ``x`` upcast to its compute dtype with ``axis`` moved last, the normalised
    axis); raises for a non-float ``x`` and for a class axis unknown or of length 0."""
    be = resolve_backend(x, backend=backend)
    x = _to_backend(be, required("x", x), name="x")
    shape = be.shape(x)
    x, axis, _ = _prepare(be, x, "x", axis)
    class_count(be, x, "x", axis, shape)
    return be, x, axis


def logsumexp(
    x: Array, axis: int = -1, keepdims: bool = False, *, backend: str | None = None
) -> Array:
    """``log(sum(exp(x), axis))``, shifted by the finite max; in float32 at least.

    Rows of all -inf give -inf; any +inf gives +inf; NaN gives NaN.
    """
    keepdims = v.check_bool("keepdims", keepdims)
    be, x, axis = _classes_last(x, axis, backend)
    with be.float_errors_ignored():
        out = native_op(be, "logsumexp")(x, axis=-1, keepdims=keepdims)
    return be.moveaxis(out, -1, axis) if keepdims and axis != len(be.shape(out)) - 1 else out


def log_softmax(x: Array, axis: int = -1, *, backend: str | None = None) -> Array:
    """``x - logsumexp(x, axis)``, in float32 at least. -inf entries stay -inf."""
    be, x, axis = _classes_last(x, axis, backend)
    with be.float_errors_ignored():
        out = native_op(be, "log_softmax")(x)
    last = len(be.shape(out)) - 1
    return be.moveaxis(out, -1, axis) if axis != last else out


def smooth_labels(
    labels: Array, alpha: float, num_classes: int | None = None, *, backend: str | None = None
) -> Array:
    """``(1 - alpha) * onehot + alpha / K``: the smoothed targets of torch, Keras and optax.

    Integer class ids need ``num_classes`` and give float32 targets; probability labels
    (last axis = classes) keep their float dtype and K is their last dimension.
    """
    alpha = v.check_number("alpha", alpha, low=0.0, high=1.0)
    be = resolve_backend(labels, backend=backend)
    labels = to_labels(be, labels)
    dtype = be.dtype_name(labels)
    if v.is_integer(dtype):
        if num_classes is None:
            raise InvalidArgumentError(
                "Expected num_classes for integer class ids. Received: num_classes=None"
            )
        num_classes = v.check_int("num_classes", num_classes)
        if num_classes < 1:
            raise InvalidArgumentError(
                f"Expected num_classes >= 1. Received: num_classes={num_classes}"
            )
        most = int_bounds(be.index_dtype)[1]  # past it NumPy, torch, TF and JAX raised their own
        if num_classes > most:
            raise InvalidArgumentError(
                f"Expected num_classes <= {most} (class ids are {be.index_dtype} on the "
                f"{be.name} backend). Received: num_classes={num_classes}"
            )
        ids = class_ids(be, labels)
        out_of_range = (ids < 0) | (ids >= num_classes)
        if not be.is_tracing(out_of_range) and be.any(out_of_range):
            raise_out_of_range(be, labels, num_classes, ignore_index=None)
        labels = be.one_hot(ids, num_classes, "float32")
    elif v.is_floating(dtype):
        shape = be.shape(labels)
        if num_classes is not None:
            num_classes = v.check_int("num_classes", num_classes)
        if not shape or (num_classes is not None and shape[-1] != num_classes):
            raise InvalidArgumentError(
                f"Expected probability labels whose last axis has num_classes={num_classes} "
                f"entries. Received: labels.shape={shape}"
            )
        num_classes = class_count(be, labels, "labels", -1, shape)  # 0 classes: 0/0 raised
    else:
        raise InvalidArgumentError(
            f"Expected integer class ids or probabilities of a floating dtype "
            f"({v.FLOAT_DTYPES}). Received: labels.dtype={dtype}"
        )
    return labels * (1.0 - alpha) + alpha / num_classes


@dense_only
def cross_entropy(
    logits: Array,
    labels: Array,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    weight: Array | None = None,
    z_loss: float = 0.0,
    reduction: str = "mean",
    axis: int = -1,
    backend: str | None = None,
) -> Array:
    """Softmax cross-entropy of ``logits`` against integer class ids or class probabilities.

    Per counted row, with p = softmax(logits), eps = label_smoothing, K_valid = the number of
    classes whose logit is not -inf, and w the class weights (1 without ``weight``):

        hard labels y:  w[y] * (1 - eps) * -log p[y]
                        + eps / K_valid * sum_{c valid} w[c] * -log p[c]
                        + z_loss * w[y] * logsumexp(logits)**2
        probabilities t: -sum_c w[c] * t'[c] * log p[c] + z_loss * logsumexp(logits)**2,
                         t' = (1 - eps) * t + eps / K_valid on the valid classes.

    "mean" divides by the summed w[y] of counted rows (hard labels; torch's convention) or by
    the number of rows (probabilities), and is 0.0 with zero gradient when nothing is counted.
    Rows labelled ``ignore_index`` add nothing. Masked (-inf) classes get no smoothing mass; a
    row whose target class is -inf costs +inf. Out-of-range labels raise eagerly and give NaN
    rows under jit / tf.function / torch.compile. Result: float32 (float64 for float64 logits).
    """
    if (
        type(label_smoothing) in _PLAIN
        and type(z_loss) in _PLAIN
        and weight is None
        and backend is None
    ):
        fast = _fast_mean(logits, labels, label_smoothing, z_loss, ignore_index, reduction, axis)
        if fast is not None:
            return fast
    v.check_choice("reduction", reduction, REDUCTIONS)
    eps = v.check_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    z_loss = v.check_number("z_loss", z_loss, low=0.0)
    ignore_index = v.check_int("ignore_index", ignore_index)
    be = resolve_backend(logits, labels, weight, backend=backend)
    logits = _to_backend(be, required("logits", logits), name="logits")
    labels = to_labels(be, labels, like=logits, ignore_index=ignore_index)
    weight = _to_backend(be, weight, like=logits, name="weight")

    shape = be.shape(logits)
    x, axis, cdt = _prepare(be, logits, "logits", axis)
    num_classes = class_count(be, x, "logits", axis, shape)
    if weight is not None:
        weight = _class_weight(be, weight, num_classes, cdt)
    batch_shape = shape[:axis] + shape[axis + 1 :]
    label_dtype = be.dtype_name(labels)
    label_shape = be.shape(labels)
    with be.float_errors_ignored():
        x2 = x if len(shape) == 2 else be.reshape(x, (-1, num_classes))
        if v.is_integer(label_dtype):
            check_label_shape(label_shape, batch_shape, shape, "labels of shape")
            y = class_ids(be, labels, None, ignore_index)  # (labels when of the index dtype)
            y = y if len(label_shape) == 1 else be.reshape(y, (-1,))
            loss = _hard_label_loss(
                be, x2, y, labels, eps, ignore_index, weight, z_loss, cdt, reduction
            )
            return be.unflatten_rows(loss, x) if reduction == "none" else loss
        elif v.is_floating(label_dtype):
            check_label_shape(label_shape, shape, shape, "probability labels of shape", label_dtype)
            t = be.cast(_prepare(be, labels, "labels", axis)[0], cdt)
            t = be.reshape(t, (-1, num_classes))
            kernel = _probability_kernel
            if be.can_read(x2) and be.can_read(t):
                kernel = be.compiled_eager(kernel, _PROBABILITY_STATIC)
            loss = kernel(be, x2, t, eps, weight, z_loss, cdt, reduction)
            return be.unflatten_rows(loss, x) if reduction == "none" else loss
        raise InvalidArgumentError(
            f"Expected labels of an integer dtype (class ids) or a floating dtype "
            f"({v.FLOAT_DTYPES}: probabilities). Received: labels.dtype={label_dtype}"
        )


_PLAIN = (int, float)


def _fast_mean(logits, labels, eps, z_loss, ignore_index, reduction, axis) -> Array | None:
    """The common eager call (hard labels, label smoothing or none, no weight or z-loss,
    "mean" over the last axis of 2-D logits, no backend= keyword) through the backend's one
    fused kernel, ``native_mean_softmax_nll``: None wherever that kernel declines or its
    answer could differ from the full path's (which then validates and computes as usual). A
    tiny loss costs a few microseconds over the framework's own, not the full path's ~50
    (torch)."""
    if z_loss or type(ignore_index) is not int or type(axis) is not int or reduction != "mean":
        return None
    if not 0.0 <= eps <= 1.0:  # NaN too: the full path names the bad value
        return None
    kind = _framework_of(logits)
    if axis not in (-1, 1) or kind == HOST or _framework_of(labels) != kind:
        return None
    if configured_backend() not in (AUTO, kind):
        return None
    return native_op(load_backend(kind), "mean_softmax_nll")(logits, labels, ignore_index, eps)


def _class_weight(be: Backend, weight: Array, num_classes: int, cdt: str) -> Array:
    v.check_floating("weight", be.dtype_name(weight))
    if be.shape(weight) != (num_classes,):
        raise InvalidArgumentError(
            f"Expected weight of shape ({num_classes},), one per class. "
            f"Received: weight.shape={be.shape(weight)}"
        )
    if be.can_read(weight):  # eagerly: one read of K numbers; traced weights are not checked
        import numpy as np  # numpy is not imported with numstab

        host = np.asarray(be.to_numpy(weight), dtype=np.float64)
        bad = ~np.isfinite(host) | (host < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgumentError(
                f"Expected finite, non-negative class weights. Received: weight[{i}]={host[i]}"
                f" ({int(bad.sum())} bad)"
            )
    return be.cast(weight, cdt)


def _hard_label_loss(be, x, y, labels, eps, ignore_index, weight, z_loss, cdt, reduction):
    """The loss of integer labels: per-row losses for "none", else their sum or mean.

    Eagerly the labels are read once on the host (the range check needs them anyway) and the
    device work is one ``be.compiled_eager`` kernel. Traced logits mean a trace; labels that
    are concrete there (``vmap`` over the logits only) are still read and checked, while
    traced labels (jit, even of constants; vmap over them) have their masks computed on the
    device."""
    matchable = matchable_ignore_index(be, ignore_index)  # None: no label can equal it
    num_classes = be.shape(x)[-1]
    if be.can_read(x) and be.can_read(y):
        rows_counted = _read_label_masks(be, y, labels, num_classes, ignore_index, matchable)
        kernel = be.compiled_eager(_hard_label_kernel, _HARD_LABEL_STATIC)
    elif _concrete_here(be, y):
        rows_counted = _read_label_masks(be, y, labels, num_classes, ignore_index, matchable)
        kernel = _hard_label_kernel
    else:
        rows_counted, kernel = TRACED, _hard_label_kernel
    return kernel(be, x, y, weight, eps, matchable, z_loss, cdt, reduction, rows_counted)


def _concrete_here(be: Backend, y: Array) -> bool:
    """Whether labels met beside traced logits hold values here: True under a ``vmap`` of the
    logits only (torch's or JAX's, without jit), where they pass through as they are. An op
    on them tells: under jit (JAX stages even a closed-over constant), tf.function,
    torch.compile or a vmap over the labels its result is traced."""
    return be.can_read(y) and not be.is_tracing(y < 0)


# How the rows to count are known, a static argument of _hard_label_kernel:
EVERY_ROW = "every row"  # read eagerly: no label ignored, none out of range
SOME_IGNORED = "some ignored"  # read eagerly: some labels equal ignore_index, none out of range
TRACED = "traced"  # unread: ignored and out-of-range rows found on the device
_HARD_LABEL_STATIC = ("be", "eps", "ignore_index", "z_loss", "cdt", "reduction", "rows_counted")


def _hard_label_kernel(be, x, y, weight, eps, ignore_index, z_loss, cdt, reduction, rows_counted):
    """Per-row losses for integer labels (out-of-range rows NaN when traced, ignored rows
    0), reduced by ``reduction``: written once, compiled as one kernel where eager ops are
    expensive (``Backend.compiled_eager``). ``ignore_index`` None: no label can equal it."""
    num_classes = be.shape(x)[-1]
    ignored = out_of_range = skipped = None  # skipped: ignored or out of range
    if rows_counted == TRACED:
        out_of_range = skipped = (y < 0) | (y >= num_classes)
    if rows_counted != EVERY_ROW and ignore_index is not None:
        ignored = y == ignore_index
        if out_of_range is not None:
            out_of_range = out_of_range & ~ignored
        skipped = ignored if skipped is None else skipped | ignored
    if skipped is not None:  # a safe index for the skipped rows
        y = be.where(skipped, 0, y)
    target_logit = be.take_rows(x, y)
    target_weight = be.gather(weight, y) if weight is not None else None
    if eps == 0.0:
        rows = native_op(be, "softmax_nll")(x, y)
        if target_weight is not None:
            rows = rows * target_weight
    else:  # the all-classes kernel is exact where it is finite; masked classes need the mask
        rows = be.finite_or_exact(
            lambda: native_op(be, "smoothed_nll")(x, y, eps, weight),
            lambda: _masked_smoothed_rows(be, x, y, target_weight, eps, weight, cdt),
            like=x,
        )
    if z_loss:
        lse = _offset_logsumexp(be, x)
        z_term = z_loss * lse * lse
        rows = rows + (z_term * target_weight if target_weight is not None else z_term)
    rows = be.where(target_logit == -INF, INF, rows)
    if out_of_range is not None:  # counted in the denominator
        rows = be.where(out_of_range, NAN, rows)
    if ignored is None:  # every row counted (traced: the batch may be of unknown size)
        denominator = be.size(y, cdt) if target_weight is None else be.sum(target_weight)
    else:
        rows = be.where(ignored, 0.0, rows)
        if target_weight is None:
            denominator = be.count(~ignored, axis=None, dtype=cdt)
        else:
            denominator = be.sum(be.where(ignored, 0.0, target_weight))
    return _reduce_rows(be, rows, denominator, reduction)


def _reduce_rows(be: Backend, rows: Array, denominator: Array | int, reduction: str) -> Array:
    """``rows`` ("none"), their sum, or their sum over ``denominator`` ("mean")."""
    if reduction == "none":
        return rows
    total = be.sum(rows)
    return total if reduction == "sum" else _safe_divide(be, total, denominator)


def _read_label_masks(be, y, labels, num_classes, ignore_index, matchable) -> str:
    """Eager label check on the host (one read): raises on out-of-range labels; returns
    EVERY_ROW (the common case, which then skips three wheres and a count) or SOME_IGNORED.
    ``matchable`` None (no label can equal ``ignore_index``): the summary ignores 0 instead,
    which leaves the min and max as they are."""
    low, high, some_ignored = be.label_summary(y, 0 if matchable is None else matchable)
    if low < 0 or high >= num_classes:
        raise_out_of_range(be, labels, num_classes, ignore_index)
    return SOME_IGNORED if some_ignored and matchable is not None else EVERY_ROW


def _masked_smoothed_rows(be, x, y, target_weight, eps, weight, cdt):
    """Label-smoothed rows with the -inf (masked) classes left out of the smoothing mean:

        (1 - eps) * w[y] * (lse - x[y]) + eps * (lse * sum_valid w - sum_valid w * x) / K_valid

    shifted by ``row_shift`` (w = 1 without ``weight``; NaN logits count as valid, so they
    propagate). Written through
    lse rather than log_softmax: under jax.jit it measured 0.7x optax's smoothed loss, where
    the log_softmax form was 1.08x.
    """
    m, m_row = be.row_shift(x)  # lse - x[c] shifted: exact at any common offset
    lse = native_op(be, "shifted_logsumexp")(x - m)
    nll = lse - (be.take_rows(x, y) - m_row)  # gathered here: TF's cond would densify one
    if target_weight is not None:
        nll = nll * target_weight
    valid = x != -INF
    valid_count = be.count(valid, axis=-1, dtype=cdt)
    divisor = be.where(valid_count > 0, valid_count, 1.0)
    # sum_valid w (x - m) / K_valid as a sum of (x - m) / K times K / K_valid: a plain sum
    # may overflow where the mean does not
    count = be.shape(x)[-1]
    wx = (x - m) * (1.0 / count) if weight is None else (x - m) * weight * (1.0 / count)
    mean = be.sum(be.where(valid, wx, 0.0), axis=-1) * (count / divisor)
    if weight is None:
        smooth = lse - mean
    else:  # an all -inf row has lse = -inf and no valid weight: 0, not -inf * 0
        valid_weight = be.sum(be.where(valid, weight, 0.0), axis=-1)
        smooth = be.where(valid_count > 0, lse, 0.0) * (valid_weight / divisor) - mean
    return nll * (1.0 - eps) + smooth * eps


_PROBABILITY_STATIC = ("be", "eps", "z_loss", "cdt", "reduction")


def _probability_kernel(be, x, t, eps, weight, z_loss, cdt, reduction):
    """The loss of probability labels, reduced ("mean": over every row); one compiled
    kernel eagerly where eager ops are expensive (``Backend.compiled_eager``)."""
    rows = _probability_rows(be, x, t, eps, weight, z_loss, cdt)
    return _reduce_rows(be, rows, be.size(rows, cdt), reduction)


def _probability_rows(be, x, t, eps, weight, z_loss, cdt):
    """Per-row losses for probability labels."""
    log_p = native_op(be, "log_softmax")(x)
    valid = x != -INF
    if eps:
        valid_count = be.count(valid, axis=-1, dtype=cdt, keepdims=True)
        uniform = eps / be.where(valid_count > 0, valid_count, 1.0)
        t = t * (1.0 - eps) + be.where(valid, uniform, 0.0)
    terms = t * be.where(valid, log_p, 0.0)  # 0 * log 0 = 0 on masked classes
    if weight is not None:
        terms = terms * weight
    rows = -be.sum(terms, axis=-1)
    if z_loss:
        lse = _offset_logsumexp(be, x)
        rows = rows + z_loss * lse * lse
    masked_mass = be.sum(be.where(valid, 0.0, t), axis=-1)
    return be.where(masked_mass > 0, INF, rows)  # a target on a -inf class is impossible


def _offset_logsumexp(be: Backend, x: Array) -> Array:
    """``lse(x - m) + m`` over the last axis, m = ``row_shift``'s constant row max: its
    gradient is softmax(x - m), exact at any offset, where torch's logsumexp differentiates
    to exp(x - lse) and loses the digits of x that lse's ulp hides (1e-3 at 1e4)."""
    m, m_row = be.row_shift(x)
    return native_op(be, "shifted_logsumexp")(x - m) + m_row


def _safe_divide(be: Backend, total: Array, denominator: Array | int) -> Array:
    """total / denominator, and 0 (with zero gradient) when the denominator is 0."""
    if isinstance(denominator, int):
        return total / denominator if denominator else total * 0.0
    nothing_counted = denominator == 0
    return be.where(nothing_counted, 0.0, total / be.where(nothing_counted, 1.0, denominator))
