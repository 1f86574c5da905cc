"""A float64 NumPy oracle for the conformance suite, written independently of numstab.

It spells the documented formulas out row by row (docs/semantics.md) and returns the loss and
its analytic gradient with respect to the logits, so every backend, numpy included, is checked
against the same plain statement of the contract.
"""

from __future__ import annotations

import numpy as np


def _row_lse(row: np.ndarray) -> float:
    valid = row != -np.inf
    if not valid.any():
        return -np.inf
    m = np.max(row[valid])
    if not np.isfinite(m):
        return np.nan  # +inf - +inf is undefined; NaN propagates
    return float(m + np.log(np.sum(np.exp(row[valid] - m))))


def cross_entropy(
    logits,
    labels,
    *,
    label_smoothing=0.0,
    ignore_index=-100,
    weight=None,
    z_loss=0.0,
    reduction="mean",
    axis=-1,
):
    """Returns (value, d value / d logits); for reduction="none" the gradient is of the sum."""
    x = np.moveaxis(np.asarray(logits, np.float64), axis, -1)
    k = x.shape[-1]
    probability_labels = np.issubdtype(np.asarray(labels).dtype, np.floating)
    t_all = np.moveaxis(np.asarray(labels, np.float64), axis, -1) if probability_labels else None
    y_all = None if probability_labels else np.asarray(labels)
    w = np.ones(k) if weight is None else np.asarray(weight, np.float64)
    eps = label_smoothing
    rows = x.reshape(-1, k)
    losses = np.zeros(len(rows))
    grads = np.zeros_like(rows)
    denominator = 0.0
    with np.errstate(all="ignore"):
        for r, row in enumerate(rows):
            valid = row != -np.inf
            n_valid = valid.sum()
            lse = _row_lse(row)
            p = np.where(valid, np.exp(row - lse), 0.0)
            if probability_labels:
                t = t_all.reshape(-1, k)[r]
                if eps:
                    t = (1 - eps) * t + np.where(valid, eps / max(n_valid, 1), 0.0)
                denominator += 1
                if np.any((t > 0) & ~valid):
                    losses[r] = np.inf
                    continue
                tw = t * w
                losses[r] = np.sum(np.where(valid, tw * (lse - row), 0.0)) + z_loss * lse**2
                grads[r] = tw.sum() * p - tw + 2 * z_loss * lse * p
                continue
            y = int(y_all.reshape(-1)[r])
            if y == ignore_index:
                continue
            if not 0 <= y < k:
                losses[r] = np.nan
                denominator += 1
                continue
            denominator += w[y]
            if row[y] == -np.inf:
                losses[r] = np.inf
                continue
            onehot = np.zeros(k)
            onehot[y] = 1.0
            smooth = np.sum(np.where(valid, w * (lse - row), 0.0)) / max(n_valid, 1)
            losses[r] = w[y] * (1 - eps) * (lse - row[y]) + eps * smooth + z_loss * w[y] * lse**2
            grads[r] = (
                w[y] * (1 - eps) * (p - onehot)
                + eps / max(n_valid, 1) * (np.sum(w[valid]) * p - w * valid)
                + 2 * z_loss * w[y] * lse * p
            )
    if reduction == "none":
        value = losses.reshape(x.shape[:-1])
        scale = 1.0
    elif reduction == "sum":
        value, scale = losses.sum(), 1.0
    else:
        scale = 1.0 / denominator if denominator else 0.0
        value = losses.sum() * scale
    grad = np.moveaxis((grads * scale).reshape(x.shape), -1, axis)
    return value, grad
