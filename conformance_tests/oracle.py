"""A float64 NumPy oracle for the conformance suite, written independently of numstab.

It spells the documented formulas out row by row (docs/semantics.md) and returns the loss and
its analytic gradient with respect to the logits, so every backend, numpy included, is checked
against the same plain statement of the contract.
"""

from __future__ import annotations

import numpy as np


def _row_shift(row: np.ndarray) -> float:
    """The max of the row's valid (not -inf) entries where finite, else 0: subtracted first,
    so that lse - x[c] = lse(x - m) - (x[c] - m) keeps float64's digits at any offset."""
    valid = row != -np.inf
    m = np.max(row[valid]) if valid.any() else 0.0
    return float(m) if np.isfinite(m) else 0.0


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
            shift = _row_shift(row)
            row = row - shift  # the loss and p are shift-invariant; z-loss needs lse + shift
            lse = _row_lse(row)
            lse_z = lse + shift if z_loss else 0.0  # (squaring float64's max would overflow)
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
                losses[r] = np.sum(np.where(valid, tw * (lse - row), 0.0)) + z_loss * lse_z**2
                grads[r] = tw.sum() * p - tw + 2 * z_loss * lse_z * p
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
            z_term = z_loss * w[y] * lse_z**2
            losses[r] = w[y] * (1 - eps) * (lse - row[y]) + eps * smooth + z_term
            grads[r] = (
                w[y] * (1 - eps) * (p - onehot)
                + eps / max(n_valid, 1) * (np.sum(w[valid]) * p - w * valid)
                + 2 * z_loss * w[y] * lse_z * p
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


# -- loss scaling ---------------------------------------------------------------------------
class ScalerOracle:
    """The loss-scale state machine of docs/semantics.md, in plain Python floats."""

    def __init__(
        self,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        hysteresis=1,
        min_scale=None,
        max_scale=None,
        consecutive_hysteresis=False,
        growth_delay_after_overflow=0,
        dynamic=True,
    ):
        self.cfg = dict(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            interval=growth_interval,
            hysteresis=hysteresis,
            min=min_scale,
            max=max_scale,
            consecutive=consecutive_hysteresis,
            delay=growth_delay_after_overflow,
            dynamic=dynamic,
        )
        # the documented bounds: float32 values within [min_scale, max_scale] and within
        # float32's normal range [2**-126, max]
        self.low = _float32_rounded(max(min_scale or 0.0, 2.0**-126), up=True)
        self.high = _float32_rounded(min(max_scale or np.inf, _F32_MAX), up=False)
        self.scale = min(max(float(np.float32(init_scale)), self.low), self.high)
        self.tracker = -growth_delay_after_overflow
        self.hysteresis_left = hysteresis

    def update(self, finite: bool) -> None:
        c = self.cfg
        if not c["dynamic"]:
            return
        if finite:
            self.tracker += 1
            if c["consecutive"]:
                self.hysteresis_left = c["hysteresis"]
            if self.tracker >= c["interval"]:
                self.tracker = 0
                self.hysteresis_left = c["hysteresis"]
                with np.errstate(over="ignore"):  # factors apply in float32
                    grown = float(np.float32(self.scale) * np.float32(c["growth_factor"]))
                if grown <= self.high:
                    self.scale = grown
        else:
            self.tracker = -c["delay"]
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                backed = float(np.float32(self.scale) * np.float32(c["backoff_factor"]))
                self.scale = max(backed, self.low)


_F32_MAX = float(np.finfo(np.float32).max)


def _float32_rounded(x: float, up: bool) -> float:
    """The float32 nearest ``x`` on the side asked (x within float32's finite range)."""
    f = np.float32(x)
    if (up and float(f) < x) or (not up and float(f) > x):
        f = np.nextafter(f, np.float32(np.inf if up else 0.0))
    return float(f)


class DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale (deepspeed/runtime/fp16/loss_scaler.py),
    transcribed without logging and without its raise at the minimum scale."""

    def __init__(
        self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis=False
    ):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class MegatronScaler:
    """Megatron-LM's DynamicGradScaler.update (megatron/core/optimizer/grad_scaler.py)."""

    def __init__(
        self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis
    ):
        self.scale, self.min_scale = initial_scale, min_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


def clip_by_global_norm(leaves, max_norm, norm_type=2.0):
    """(clipped leaves in float64, norm): scale = max_norm / max(norm, max_norm), untouched
    when the norm is not finite."""
    flat = np.concatenate([np.abs(np.asarray(x, np.float64)).ravel() for x in leaves] + [[0.0]])
    with np.errstate(all="ignore"):
        norm = flat.max() if norm_type == np.inf else np.sum(flat**norm_type) ** (1 / norm_type)
        scale = max_norm / max(norm, max_norm) if np.isfinite(norm) else 1.0
        return [np.asarray(x, np.float64) * scale for x in leaves], norm
