"""Fused linear cross-entropy: the loss of ``cross_entropy(hidden @ weight.T + bias, labels)``
without ever holding the [tokens, vocab] logits, forward or backward.

Rows of ``hidden`` are processed in chunks. For each chunk the forward pass computes the
logits, their log-sum-exp, the per-row losses and, when a gradient may be asked for, the
chunk's gradients (Liger-Kernel's scheme):

    p       = softmax(x),  x = hidden_c @ weight.T + bias,  s = row scale (1/D, 1 or cotangent)
    (all of it on x shifted by its row max, so that lse - x[c] keeps its digits at any offset)
    dL/dx   = s * [(1 - eps) * (p - onehot(y)) + eps * (p - u) + 2 z lse p]
              (u = 1/K_valid on the classes a -inf bias leaves, 0 on the masked ones)
    dhidden = dL/dx @ weight,  dweight += dL/dx.T @ hidden_c,  dbias += sum_rows dL/dx

Only those small gradients are kept; the backward pass scales them by the incoming cotangent.
``reduction="none"`` cannot pre-scale per row, so its backward recomputes the chunks with the
cotangent as the row scale. See docs/semantics.md §11 for the full contract.

A ``-inf`` bias entry masks its class, as a ``-inf`` logit does in ``cross_entropy``: the
mask is one vector over the vocabulary (``hidden @ weight.T`` is finite), so K_valid, the
smoothing weights 1/K_valid and the masked rows' sum of ``weight`` are computed once per call
on the device (``_vocab_mask``), and a chunk costs what it does with a finite bias.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from numstab import _validate as v
from numstab._dispatch import resolve_backend
from numstab._dispatch import to_backend as _to_backend
from numstab._loss_checks import (
    class_ids,
    matchable_ignore_index,
    raise_out_of_range,
    required,
    to_labels,
)
from numstab.backends._base import Backend, has_native, native_op
from numstab.clipping import LARGEST_FINITE
from numstab.errors import InvalidArgumentError
from numstab.losses import REDUCTIONS, _safe_divide

Array = Any
NAN = float("nan")

#: ``chunk_size=None`` keeps one chunk of float32 logits near this many bytes (the
#: backend's ``fused_chunk_budget``: TensorFlow's is twice this, a GPU's 1 GiB)
CHUNK_BYTES = 32 * 2**20


def default_chunk_size(rows: int, vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk of float32 logits is about ``budget_bytes``.

    ``budget_bytes // (4 * vocab)`` rows, rounded down to a multiple of 8 when it is >= 8,
    at least 1 and at most ``rows``; then evened out over the chunks this needs, so the last
    chunk is not a sliver. vocab 65536 -> 128 rows (32 MiB), vocab 128k -> 64 rows.
    """
    size = max(1, budget_bytes // (4 * max(vocab, 1)))
    if size >= 8:
        size -= size % 8
    if rows <= size:
        return max(rows, 1)
    chunks = -(-rows // size)
    return -(-rows // chunks)


def fused_linear_cross_entropy(
    hidden: Array,
    weight: Array,
    labels: Array,
    *,
    bias: Array | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str | None = None,
) -> Array:
    """``cross_entropy(hidden @ weight.T + bias, labels, ...)`` computed chunk by chunk.

    ``hidden``: (..., d) floating; ``weight``: (V, d) and ``bias``: (V,) of ``hidden``'s dtype;
    ``labels``: integer class ids of shape ``hidden.shape[:-1]``. Per counted row, with
    x = the row's logits, eps = label_smoothing, z = z_loss:

        loss = (1 - eps) * (lse(x) - x[y]) + eps * (lse(x) - mean(x)) + z * lse(x)**2

    A ``-inf`` ``bias`` entry masks its class as a ``-inf`` logit does in ``cross_entropy``:
    the mean is over the K_valid unmasked classes, a masked class gets gradient 0, and a row
    whose label is masked costs +inf (gradient 0).

    Rows labelled ``ignore_index`` add 0 and no gradient; "mean" divides by the number of
    counted rows and is 0.0 (zero gradient) when there is none. The logits are computed in the
    input dtype and everything after in float32 (float64 for float64 inputs); weight and bias
    gradients accumulate over chunks in float32. Out-of-range labels raise eagerly and give NaN
    rows when traced. ``chunk_size`` rows per chunk; None chooses ``default_chunk_size``.
    Under torch.autocast, hidden, weight and bias are first cast as ``F.linear`` would.
    """
    v.check_choice("reduction", reduction, REDUCTIONS)
    eps = v.check_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    z_loss = v.check_number("z_loss", z_loss, low=0.0)
    ignore_index = v.check_int("ignore_index", ignore_index)
    if chunk_size is not None:
        chunk_size = v.check_int("chunk_size", chunk_size)
        if chunk_size <= 0:
            raise InvalidArgumentError(
                f"Expected chunk_size >= 1 or None. Received: chunk_size={chunk_size}"
            )
    be = resolve_backend(hidden, weight, labels, bias, backend=backend)
    hidden = _to_backend(be, required("hidden", hidden), name="hidden")
    weight = _to_backend(be, required("weight", weight), like=hidden, name="weight")
    labels = to_labels(be, labels, like=hidden, ignore_index=ignore_index)
    bias = _to_backend(be, bias, like=hidden, name="bias")
    hidden, weight, bias = be.autocast_operands(hidden, weight, bias)  # torch.autocast
    rows, width, vocab, batch_shape = _check_inputs(be, hidden, weight, labels, bias)
    cdt = v.compute_dtype(be.dtype_name(hidden))

    h = be.reshape(hidden, (rows, width))
    y = be.reshape(class_ids(be, labels, None, ignore_index), (rows,))
    matchable = matchable_ignore_index(be, ignore_index)  # None: no label can equal it
    out_of_range = (y < 0) | (y >= vocab)
    if matchable is not None:
        out_of_range = out_of_range & ~_equal(y, matchable)
    traced = be.is_tracing(out_of_range)  # unread: out-of-range rows become NaN (§11)
    if not traced and be.any(out_of_range):  # concrete labels only
        raise_out_of_range(be, labels, vocab, ignore_index)

    chunk_size = chunk_size or default_chunk_size(rows, vocab, be.fused_chunk_budget(h))
    plan = _Plan(be, eps, z_loss, matchable, reduction, cdt, vocab, rows, chunk_size, traced)
    with be.float_errors_ignored():
        out = be.custom_gradient(plan.forward, plan.backward, (h, weight, bias, y))
    if reduction == "none":
        return be.reshape(out, batch_shape)
    return out


def _check_inputs(be: Backend, hidden, weight, labels, bias) -> tuple[int, int, int, tuple]:
    """Validate dtypes and shapes; return (rows, d, V, hidden.shape[:-1])."""
    dtype = be.dtype_name(hidden)
    v.check_floating("hidden", dtype)
    for name, x in (("weight", weight), ("bias", bias)):
        if x is not None and be.dtype_name(x) != dtype:
            raise InvalidArgumentError(
                f"Expected {name} of hidden's dtype {dtype}. "
                f"Received: {name}.dtype={be.dtype_name(x)}"
            )
    label_dtype = be.dtype_name(labels)
    if not v.is_integer(label_dtype):
        raise InvalidArgumentError(
            f"Expected labels of an integer dtype (class ids). Received: labels.dtype={label_dtype}"
        )
    shape, w_shape = be.shape(hidden), be.shape(weight)
    if len(shape) < 1 or not v.is_static_shape(shape):
        raise InvalidArgumentError(
            f"Expected hidden of rank >= 1 with a static shape. Received: hidden.shape={shape}"
        )
    # a symbolic vocab (jax.export) is not static: its comparison with 0 may be inconclusive
    static_w = v.is_static_shape(w_shape)
    if not static_w or len(w_shape) != 2 or w_shape[1] != shape[-1] or w_shape[0] == 0:
        raise InvalidArgumentError(
            f"Expected weight of shape (vocab, {shape[-1]}) with vocab >= 1, for hidden of "
            f"shape {shape}. Received: weight.shape={w_shape}"
        )
    vocab = w_shape[0]
    if bias is not None and be.shape(bias) != (vocab,):
        raise InvalidArgumentError(
            f"Expected bias of shape ({vocab},), one per class. "
            f"Received: bias.shape={be.shape(bias)}"
        )
    batch_shape = shape[:-1]
    if not v.shapes_match(be.shape(labels), batch_shape):
        raise InvalidArgumentError(
            f"Expected labels of shape {batch_shape} for hidden of shape {shape}. "
            f"Received: labels.shape={be.shape(labels)}"
        )
    rows = 1
    for n in batch_shape:
        rows *= n
    return rows, shape[-1], vocab, batch_shape


class _Plan:
    """The chunked forward and backward of one call (static settings only, no arrays).
    ``traced``: the labels could not be read, so out-of-range rows are found on the device
    (NaN rows); read labels were checked, and then no op makes a NaN on clean input (§14)."""

    def __init__(self, be, eps, z_loss, ignore_index, reduction, cdt, vocab, rows, chunk, traced):
        self.be, self.eps, self.z_loss, self.ignore_index = be, eps, z_loss, ignore_index
        self.reduction, self.cdt, self.vocab, self.rows, self.chunk = (
            reduction, cdt, vocab, rows, chunk)  # fmt: skip
        self.traced = traced

    # -- the two halves handed to Backend.custom_gradient ---------------------------------
    def forward(self, args: tuple, needs: tuple) -> tuple[Array, Any]:
        h, w, b, y = args
        be = self.be
        needs = (needs[0], needs[1], needs[2] and b is not None)
        y_safe, ignored, out_of_range, counted = self._label_masks(y)
        self.needs = needs  # static flags, kept here: residuals must be arrays (JAX)
        if self.reduction == "none":  # per-row cotangents: the backward recomputes
            rows, _ = self._pass(h, w, b, y_safe, ignored, out_of_range, None, (False,) * 3)
            return rows, (h, w, b, y)
        denominator = be.sum(be.cast(~ignored, self.cdt))
        scale = _safe_divide(be, 1.0, denominator) if self.reduction == "mean" else 1.0
        rows, grads = self._pass(h, w, b, y_safe, ignored, out_of_range, counted * scale, needs)
        total = rows if self.reduction == "sum" else _safe_divide(be, rows, denominator)
        return total, grads

    def backward(self, residuals: Any, cotangent: Array) -> tuple:
        be = self.be
        if self.reduction != "none":  # gradients were computed forward, for cotangent 1
            dh, dw, db, keep = residuals  # spelled out: Dynamo failed on a generator here
            return (
                None if dh is None else be.scale_owned(dh, cotangent),
                None if dw is None else _scale_classes(be, dw, cotangent, keep),
                None if db is None else _scale_classes(be, db, cotangent, keep),
                None,
            )
        h, w, b, y = residuals
        needs = self.needs
        y_safe, ignored, out_of_range, counted = self._label_masks(y)
        row_scale = counted * be.cast(cotangent, self.cdt)
        _, grads = self._pass(h, w, b, y_safe, ignored, out_of_range, row_scale, needs)
        return grads

    # -- the chunk loop ---------------------------------------------------------------------
    def _label_masks(self, y: Array) -> tuple[Array, Array, Array | None, Array]:
        """(labels with 0 on skipped rows, ignored, out of range or None when the labels were
        read and checked, counted rows as 1.0/0.0 in the compute dtype)."""
        be = self.be
        out_of_range = ((y < 0) | (y >= self.vocab)) if self.traced else None
        if self.ignore_index is None:  # outside the labels' dtype: none ignored (y < y)
            ignored, skipped = y < y, out_of_range
        else:
            ignored = _equal(y, self.ignore_index)
            if out_of_range is not None:
                out_of_range = out_of_range & ~ignored
            skipped = ignored if out_of_range is None else ignored | out_of_range
        if skipped is None:  # every label read and in range
            return y, ignored, None, be.cast(~ignored, self.cdt)
        return be.where(skipped, 0, y), ignored, out_of_range, be.cast(~skipped, self.cdt)

    def _pass(self, h, w, b, y, ignored, out_of_range, row_scale, needs):
        """Loss rows (concatenated for "none", else their sum) and (dh, dw, db, None)."""
        be, cdt = self.be, self.cdt
        want_grads = row_scale is not None and any(needs)
        want_rows = row_scale is None or self.reduction != "none"
        mask = b32 = None
        if b is not None:
            want_dh = want_grads and needs[0]
            mask = _vocab_mask(be, be.cast(b, cdt), w, self.eps, self.vocab, cdt, want_dh)
            b32 = mask.bias
        none = self.reduction == "none"

        def step(carry, chunk_inputs):
            total, dw, db = carry
            h_part, y_part, ignored_part, out_of_range_part, scale = chunk_inputs
            target_ok = None
            if mask is not None:  # a row whose label is masked: +inf, gradient 0
                target_ok = be.gather(mask.valid, y_part) > 0.5
                if scale is not None:
                    scale = be.where(target_ok, scale, mask.fill)
            rows, g, pending = self._chunk(h_part, w, b32, y_part, scale, want_rows, mask)
            row_out = dh = None
            if want_rows:
                if target_ok is not None:
                    rows = be.where(target_ok, rows, float("inf"))
                if out_of_range_part is not None:  # traced labels only: no NaN made eagerly
                    rows = be.where(out_of_range_part, NAN, rows)
                rows = be.where(ignored_part, 0.0, rows)
                if none:
                    row_out = rows
                else:
                    total = be.sum(rows) if total is None else total + be.sum(rows)
            if g is not None:
                fix = None  # a masked column's smoothing shift, in g, taken back out of dh
                if mask is not None and self.eps and needs[0]:
                    fix = (scale * mask.eps_k, mask.w_masked)
                dh, dw, db = self._chunk_grads(g, pending, h_part, w, dw, db, needs, fix)
            return (total, dw, db), (row_out, dh)

        inputs = (h, y, ignored, out_of_range, row_scale if want_grads else None)
        (total, dw, db), (row_losses, dh) = be.scan_chunks(
            step, (None, None, None), inputs, self.chunk, self.rows
        )
        out = (row_losses if none else total) if want_rows else None
        if not want_grads:
            return out, (None, None, None, None)
        # masked classes get gradient 0 (no smoothing mass): their rows of dw and db are
        # zeroed here for "none", else in backward's multiply by the cotangent (one pass)
        keep = None  # 1 on valid classes, 0 on masked ones, NaN when all are masked
        if mask is not None and (needs[1] or needs[2]):
            keep = mask.valid + mask.fill  # all masked: NaN (jitted, NaN * 0 gave 0)
            if none and self.eps:  # without smoothing they are 0 already (sums of 0s)
                dw = dw if dw is None else _scale_classes(be, dw, None, keep)
                db = db if db is None else _scale_classes(be, db, None, keep)
        grads = (
            dh if needs[0] else None,
            _cast_if_needed(be, dw, be.dtype_name(w)) if needs[1] else None,
            _cast_if_needed(be, db, be.dtype_name(b)) if needs[2] else None,
            None if none else keep,  # a residual for backward
        )
        return out, grads

    def _chunk_grads(self, g, pending, h, w, dw, db, needs, fix=None):
        """The chunk's ``dhidden`` rows and the running ``dweight``, ``dbias``. A ``pending``
        row scale s (not yet in ``g``) goes into the narrow operands instead of the [C, V] one:
        ``(s * g) @ w = s * (g @ w)``, ``(s * g).T @ h = g.T @ (s * h)``, one pass less over the
        chunk (float32 / float64 inputs without a bias gradient; else ``g`` is scaled).
        ``fix = (shift, w_masked)``: ``g`` holds ``-shift`` on every masked column (the
        smoothing term's, which those classes do not get): ``dh += shift * w_masked``, with
        ``w_masked`` the masked rows' sum of ``w`` (0 for a finite bias: dh as it was)."""
        be, dtype = self.be, self.be.dtype_name(h)
        if pending is not None and (needs[2] or dtype != self.cdt):
            g, pending = g * be.reshape(pending, (-1, 1)), None
        s = None if pending is None else be.reshape(pending, (-1, 1))
        dh = None
        g_in = be.cast(g, dtype) if needs[0] or needs[1] else None  # the products' operand
        if needs[0]:
            dh = be.matmul(g_in, w)
            dh = dh if s is None else dh * s
            if fix is not None:
                shift, w_masked = fix
                wide = be.cast(dh, self.cdt) + be.reshape(shift, (-1, 1)) * w_masked
                dh = _cast_if_needed(be, wide, dtype)
        if needs[1]:  # summed in float32 for 16-bit inputs
            dw = be.matmul_accumulate(dw, g_in, h if s is None else h * s)
        if needs[2]:
            db = be.sum(g, axis=0) if db is None else db + be.sum(g, axis=0)
        return dh, dw, db

    def _chunk(self, h, w, b32, y, scale, want_rows, mask=None):
        """One chunk: (loss rows or None, dL/dlogits or None, a row scale still to apply to
        dL/dlogits or None); the logits die here. ``mask`` (a bias was given): the smoothing
        mean and shift over the valid classes (``_vocab_mask``)."""
        be, eps, z, vocab = self.be, self.eps, self.z_loss, self.vocab
        x = be.cast(be.matmul(h, w, transpose_b=True), self.cdt)
        if b32 is not None:
            x = x + b32
        if scale is not None and not eps and not z and has_native(be, "softmax_nll_grad"):
            # one fused kernel, which shifts each row by its max itself (the same bits as on
            # x - m); x's only reader, so its buffer can become the gradient's
            nll, grad = native_op(be, "softmax_nll_grad")(x, y)
            return (nll if want_rows else None), grad, scale  # scaled by _chunk_grads
        # shifted by the row max m: lse(x) - x[c] = lse(x - m) - (x[c] - m) keeps its digits
        # at any offset, and so does the gradient's exp(x - lse); z-loss needs the true lse
        shift, m = be.row_shift(x)
        x = be.shift_owned(x, shift)  # kept: the gradient's exp(x - lse) needs it too
        lse = native_op(be, "shifted_logsumexp")(x)
        rows = None
        if want_rows:
            rows = lse - be.take_rows(x, y)
            if eps:  # a sum of x / K: a sum of x may overflow
                mean = be.sum(x * (1.0 / vocab if mask is None else mask.mean_weights), axis=-1)
                rows = rows * (1.0 - eps) + eps * (lse - mean)
            if z:
                rows = rows + z * (lse + m) * (lse + m)
        if scale is None:
            return rows, None, None
        coefficient = scale * (1.0 + 2.0 * z * (lse + m)) if z else scale
        shift = (scale * (eps / vocab if mask is None else mask.eps_k)) if eps else None
        x = be.softmax_grad_owned(x, lse, coefficient, shift)  # reusing the name frees x
        if eps < 1.0:
            x = be.add_at_rows(x, y, scale * -(1.0 - eps))
        return rows, x, None


def _equal(y: Array, value: int) -> Array:
    """``y == value`` elementwise. TensorFlow 1 graph tensors compare by identity (a Python
    bool): there, through ``<`` and ``>``."""
    same = y == value
    return ~((y < value) | (y > value)) if isinstance(same, bool) else same


def _scale_classes(be: Backend, g: Array, factor: Array | None, keep: Array | None) -> Array:
    """``g * factor`` (dweight or dbias: a row per class) with the vocabulary mask ``keep``
    (1 on valid classes, 0 on masked ones) folded into the factor: one pass over ``g``. A
    masked class's row comes out 0 (the sign of that zero, -0.0 where the product's is
    negative, is not part of the contract)."""
    if keep is None:
        return be.scale_owned(g, factor)
    keep = be.reshape(keep, (-1,) + (1,) * (len(be.shape(g)) - 1))
    return be.scale_owned(g, keep if factor is None else factor * keep)


def _cast_if_needed(be: Backend, x: Array, dtype: str) -> Array:
    """``x`` itself when it has ``dtype`` (torch.compile rejects saving a no-op cast's alias)."""
    return x if be.dtype_name(x) == dtype else be.cast(x, dtype)


class _Mask(NamedTuple):
    """The vocabulary mask of a bias (``_vocab_mask``); arrays over the vocabulary or 0-d."""

    bias: Array  # the bias, -inf replaced by half the lowest finite value (compute dtype)
    valid: Array  # 1.0 on unmasked classes, 0.0 on masked ones (compute dtype)
    fill: Array  # the row scale of a row whose label is masked: 0, NaN when all are masked
    mean_weights: Array | None  # 1/K_valid on valid classes, 0 on masked (eps > 0)
    eps_k: Array | None  # eps / K_valid (eps > 0)
    w_masked: Array | None  # the masked rows' sum of weight (eps > 0 and dhidden wanted)


def _vocab_mask(be: Backend, b32, w, eps: float, vocab: int, cdt: str, want_dh: bool) -> _Mask:
    """A ``-inf`` bias entry masks its class for every row (``hidden @ weight.T`` is finite),
    as a ``-inf`` logit does in ``cross_entropy`` (docs/semantics.md §4.4.3): K_valid and the
    per-class weights are computed here, once per call, on the device (no host read).

    Masked logits get half the lowest finite value instead of -inf: ``exp`` still gives 0
    (softmax, lse), but ``x * 0`` is 0, not NaN, so the smoothing mean is one weighted sum as
    before, ``sum_c x[c] * mean_weights[c]``. The smoothing shift the softmax gradient puts on
    every column is taken back on the masked ones: out of dhidden by ``w_masked``, and out of
    dweight and dbias by zeroing their masked rows once, in the multiply by the
    cotangent (``_scale_classes``). A finite bias gives the same values as no mask at all:
    weights ``1/V`` and ``eps/V``, ``w_masked`` 0. NaN compares false (valid, it propagates);
    +inf is valid (non-finite results)."""
    lowest = -LARGEST_FINITE[cdt]
    masked = b32 < lowest  # -inf only
    valid = be.cast(~masked, cdt)
    count = be.sum(valid)
    full = count > vocab - 0.5  # K_valid = V: the same constants as without a mask
    # all masked: 0/0 = NaN, as cross_entropy; else 0, with no NaN constant made (§14)
    fill = 0.0 / count
    bias = be.where(masked, 0.5 * lowest, b32)
    if not eps:
        return _Mask(bias, valid, fill, None, None, None)
    inverse = be.where(full, 1.0 / vocab, 1.0 / count)
    mean_weights = be.where(masked, 0.0, be.reshape(inverse, (1,)) * valid)
    eps_k = be.where(full, eps / vocab, eps / count)
    w_masked = None
    if want_dh:  # one read of weight, no [V, d] temporary (a finite bias pays this too)
        rows = be.reshape(be.cast(masked, be.dtype_name(w)), (1, -1))
        w_masked = be.cast(be.matmul(rows, w), cdt)
    return _Mask(bias, valid, fill, mean_weights, eps_k, w_masked)
