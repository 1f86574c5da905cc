"""Float64 oracles for schedules and adaptive clipping (docs/semantics.md §12,
docs/semantics.md §13), spelled out in plain Python / NumPy.

``ZClipOracle`` transcribes ``zclip.ZClip.step`` (zclip 1.0.0) on a list of gradients, plus
numstab's one deliberate difference: a non-finite norm changes nothing.
"""

from __future__ import annotations

import math

import numpy as np


def warmup_cosine(step, base_lr, warmup_steps, total_steps, min_lr=0.0, warmup_start_lr=0.0):
    """optax.warmup_cosine_decay_schedule(warmup_start_lr, base_lr, warmup_steps, total_steps,
    min_lr) in float64; negative steps give warmup_start_lr."""
    if step < 0:
        return warmup_start_lr
    if step < warmup_steps:
        return warmup_start_lr + (base_lr - warmup_start_lr) * step / warmup_steps
    decay = total_steps - warmup_steps
    t = min(step - warmup_steps, decay)
    return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * t / decay))


class ZClipOracle:
    def __init__(
        self,
        alpha=0.97,
        z_thresh=2.5,
        max_grad_norm=1.0,
        eps=1e-6,
        warmup_steps=25,
        mode="zscore",
        clip_option="adaptive_scaling",
        clip_factor=1.0,
        skip_update_on_spike=False,
    ):
        self.alpha, self.z_thresh, self.max_grad_norm, self.eps = (
            alpha,
            z_thresh,
            max_grad_norm,
            eps,
        )
        self.warmup_steps, self.mode, self.clip_option = warmup_steps, mode, clip_option
        self.clip_factor, self.skip_update_on_spike = clip_factor, skip_update_on_spike
        self.buffer, self.initialized, self.mean, self.var = [], False, None, None
        self.min_margin = math.inf  # closest |z - z_thresh| seen: a borderline step is flaky

    def step(self, leaves):
        """(clipped float64 leaves, raw global norm)."""
        leaves = [np.asarray(x, np.float64) for x in leaves]
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in leaves))
        if not math.isfinite(norm):
            return leaves, norm
        if not self.initialized:
            self.buffer.append(norm)
            if len(self.buffer) >= self.warmup_steps:
                n = len(self.buffer)
                self.mean = sum(self.buffer) / n
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / n
                self.initialized, self.buffer = True, []
            coef = 1.0
            if self.max_grad_norm is not None:
                coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            return [x * coef for x in leaves], norm
        std = self.var**0.5
        clip = None
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            self.min_margin = min(self.min_margin, abs(norm - threshold) / max(std, 1e-12))
            if norm > threshold:
                clip = threshold
        else:
            z = (norm - self.mean) / (std + self.eps)
            self.min_margin = min(self.min_margin, abs(z - self.z_thresh))
            if z > self.z_thresh:
                if self.clip_option == "adaptive_scaling":
                    clip = (
                        self.mean + self.z_thresh * std / (z / self.z_thresh)
                    ) * self.clip_factor
                else:
                    clip = self.mean
        limit = clip if clip is not None else norm
        if self.max_grad_norm is not None:
            limit = min(limit, self.max_grad_norm)
        coef = limit / (norm + 1e-6) if norm > limit else 1.0
        if not (clip is not None and self.skip_update_on_spike):
            x = clip if clip is not None else norm
            self.mean = self.alpha * self.mean + (1 - self.alpha) * x
            self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
        return [x * coef for x in leaves], norm


def agc_units(shape, layout="io"):
    """The reduced axes of one AGC unit (None: the whole leaf), as optax / timm define them."""
    rank = len(shape)
    if layout == "oi":
        return None if rank <= 1 else tuple(range(1, rank))
    if sum(d != 1 for d in shape) <= 1:
        return None
    return {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}[rank]


def agc(grads, params, clip_factor=0.01, eps=1e-3, layout="io"):
    """optax.adaptive_grad_clip in float64 on lists of leaves."""
    out = []
    for g, p in zip(grads, params, strict=True):
        g, p = np.asarray(g, np.float64), np.asarray(p, np.float64)
        axes = agc_units(g.shape, layout)
        g_norm = np.sqrt(np.sum(g * g, axis=axes, keepdims=True))
        limit = clip_factor * np.maximum(np.sqrt(np.sum(p * p, axis=axes, keepdims=True)), eps)
        out.append(np.where(g_norm < limit, g, g * (limit / np.maximum(g_norm, 1e-6))))
    return out
