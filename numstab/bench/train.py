"""One training run, written once: numstab's step (forward, loss scaling, finite check,
clipping, AdamW, skip) and the host loop every stack shares (schedule, faults, timing,
recording). A native stack (``frameworks/<name>/bench_native.py``) gives the loop a session
with the same three members as ``NumstabSession``: ``scale()``, ``skips`` and ``step(...)``.

The framework module ``fw`` gives: ``ops`` (see model.py), ``asarray(np_array)``,
``value_and_grad(fn)``, ``compile(step)``, ``no_grad()``, ``to_numpy(x)``, ``peak_memory()``
and ``reset_peak_memory()``. Everything numerical in between is numstab's:
``cross_entropy``, ``LossScaler`` (``scale``; ``unscale``, which also answers whether every
gradient is finite; ``update``), ``global_norm``, ``clip_coefficient`` and the schedule.

Remedies: ``ls`` = numstab's dynamic ``LossScaler`` for float16 (a fixed scale of 1 for
bfloat16 / float32, as ``LossScaler.for_dtype`` gives) and a step skipped (params and AdamW
state kept) when any gradient is non-finite; ``clip`` = clip by global norm ``preset.max_norm``.
Without ``ls`` a non-finite
gradient is applied as is, as a naive training loop would. ``qk_norm`` (model.py) and
``z_loss`` (``cross_entropy(z_loss=1e-4)``) change the compiled step, so they key its cache.
Faults: ``nan_batch`` adds NaN to the embeddings at step k; ``lr_spike`` multiplies the
learning rate by ``preset.lr_spike`` at step k; ``logit_blowup`` multiplies the initial
unembedding by ``preset.logit_scale``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from numstab._dispatch import resolve_backend
from numstab.bench.adamw import AdamWState, adamw_update
from numstab.bench.corpus import batches
from numstab.bench.model import forward
from numstab.bench.spec import COMPUTE_DTYPES, Z_LOSS, Preset, RunSpec
from numstab.bench.weights import flatten, init_params, layout, unflatten
from numstab.clipping import clip_coefficient, global_norm
from numstab.loss_scale import LossScaler
from numstab.losses import cross_entropy
from numstab.schedules import warmup_cosine_schedule

NO_SCALER = LossScaler(init_scale=1.0, dynamic=False)


def dynamic_scaler(preset: Preset) -> LossScaler:
    """torch.amp.GradScaler's defaults (init 2**16, x2 / x0.5) with the preset's growth
    interval (shorter than torch's 2000 so that short runs show growth as well)."""
    return LossScaler(growth_interval=preset.scale_growth_interval)


def make_step(
    fw: Any, preset: Preset, precision: str, qk_norm: bool = False, z_loss: bool = False
) -> Callable[..., tuple]:
    """``step(params, opt, ls_state, tokens, targets, lr, poison, flags) -> (params, opt,
    ls_state, loss, finite, grad_norm, stats, grads_tail)``; pure, so it compiles under
    jax.jit / tf.function. ``stats``: (per-layer max |attention logit|, max |output logit|);
    ``grads_tail``: the raw (scaled) gradient without the embedding table, whose rows of
    tokens absent from the batch are zero by construction.

    ``flags`` (0-d bool arrays) pick the remedy at run time, so one compiled step serves
    every ls/clip remedy of a (precision, qk_norm, z_loss): ``clip``; ``skip`` (skip
    non-finite steps); ``dynamic`` (update the loss scale). Without loss scaling the state
    holds a scale of 1, and multiplying by 1 (or by a clip factor of 1) is exact, so
    nothing else changes.
    """
    dtype = COMPUTE_DTYPES[precision]
    scaler = dynamic_scaler(preset)
    ops = fw.ops
    rows = preset.batch * preset.context
    shapes = layout(preset)
    embed_size = preset.vocab * preset.d_model  # the embedding table comes first in theta

    def loss_fn(flat, tokens, targets, poison, ls_state):
        params = unflatten(ops, flat["theta"], shapes)
        logits, attn_max = forward(ops, params, tokens, preset, dtype, poison, qk_norm)
        loss = cross_entropy(
            ops.reshape(logits, (rows, preset.vocab)),
            ops.reshape(targets, (rows,)),
            z_loss=Z_LOSS if z_loss else 0.0,
        )
        return scaler.scale(loss, ls_state), (loss, (attn_max, ops.absmax(logits)))

    grad_fn = fw.value_and_grad(loss_fn)

    def step(params, opt, ls_state, tokens, targets, lr, poison, flags):
        (_, (loss, stats)), grads = grad_fn(params, tokens, targets, poison, ls_state)
        tail = grads["theta"][embed_size:]
        with fw.no_grad():
            be = resolve_backend(loss)
            grads, finite = scaler.unscale(grads, ls_state)
            norm = global_norm(grads)
            factor = be.where(flags["clip"], clip_coefficient(norm, preset.max_norm), 1.0)
            grads = {k: g * factor for k, g in grads.items()}
            new_params, new_opt = adamw_update(
                be,
                params,
                grads,
                opt,
                lr,
                beta1=preset.beta1,
                beta2=preset.beta2,
                eps=preset.eps,
                weight_decay=preset.weight_decay,
            )
            keep_old = flags["skip"] & ~finite
            pick = lambda new, old: {k: be.where(keep_old, old[k], new[k]) for k in new}
            new_opt = AdamWState(
                be.where(keep_old, opt.count, new_opt.count),
                pick(new_opt.mu, opt.mu),
                pick(new_opt.nu, opt.nu),
            )
            updated = scaler.update(ls_state, finite)
            new_ls = type(ls_state)(
                *(be.where(flags["dynamic"], u, o) for u, o in zip(updated, ls_state, strict=True))
            )
        return pick(new_params, params), new_opt, new_ls, loss, finite, norm, stats, tail

    return step


class NumstabSession:
    """numstab's stack for one run: the compiled ``make_step`` and its state."""

    def __init__(self, fw: Any, preset: Preset, spec: RunSpec, step_fn: Callable, theta0):
        self.fw, self.step_fn = fw, step_fn
        self.params = {"theta": fw.asarray(theta0)}
        zeros = {"theta": fw.asarray(np.zeros_like(theta0))}
        self.opt = AdamWState(fw.asarray(np.int32(0)), zeros, dict(zeros))
        # float16 gets the dynamic scaler; bfloat16 / float32 a fixed scale of 1 (steps are
        # still skipped); no loss scaling: a fixed scale of 1 and nothing skipped
        dynamic = spec.loss_scaling and spec.precision == "fp16"
        ls = (dynamic_scaler(preset) if dynamic else NO_SCALER).init(like=self.params["theta"])
        # placed like every other input (a jax.jit cache hit needs the same placement)
        self.ls_state = type(ls)(*(fw.asarray(fw.to_numpy(x)) for x in ls))
        self.skips = spec.loss_scaling
        self.flags = {
            "clip": fw.asarray(np.bool_(spec.clip)),
            "skip": fw.asarray(np.bool_(spec.loss_scaling)),
            "dynamic": fw.asarray(np.bool_(dynamic)),
        }

    def scale(self) -> float:
        return float(self.fw.to_numpy(self.ls_state.scale))

    def step(self, tokens, targets, lr: float, poison: float) -> tuple:
        fw = self.fw
        lr_arr, poison_arr = fw.asarray(np.float32(lr)), fw.asarray(np.float32(poison))
        out = self.step_fn(
            self.params,
            self.opt,
            self.ls_state,
            fw.asarray(tokens),
            fw.asarray(targets),
            lr_arr,
            poison_arr,
            self.flags,
        )
        self.params, self.opt, self.ls_state, loss, finite, norm, stats, tail = out
        return loss, finite, norm, stats, [tail]


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def zero_fraction(to_numpy: Callable, grads: list) -> float:
    """Fraction of gradient elements that are exactly zero (a 16-bit underflow shows as 0)."""
    arrays = [to_numpy(g) for g in grads]
    zeros = sum(int(np.count_nonzero(a == 0)) for a in arrays)
    return zeros / max(1, sum(a.size for a in arrays))


def schedule_for(preset: Preset, spec: RunSpec) -> Callable[[int], float]:
    """warmup + cosine to the run's peak lr; min_lr keeps the preset's ratio to base_lr."""
    peak = spec.peak_lr(preset)
    return warmup_cosine_schedule(
        peak,
        warmup_steps=preset.warmup_steps,
        total_steps=preset.steps,
        min_lr=peak * preset.min_lr / preset.base_lr,
    )


def initial_weights(preset: Preset, spec: RunSpec) -> dict[str, np.ndarray]:
    logit_scale = preset.logit_scale if spec.fault == "logit_blowup" else 1.0
    return init_params(preset, spec.seed, logit_scale)


def numstab_session(fw: Any, preset: Preset, spec: RunSpec, cache: dict) -> NumstabSession:
    """numstab's stack; one compiled step per (precision, qk_norm, z_loss) in ``cache``."""
    key = ("numstab", spec.precision, spec.has("qk_norm"), spec.has("z_loss"))
    if key not in cache:
        cache[key] = fw.compile(make_step(fw, preset, *key[1:]))
    theta0 = flatten(initial_weights(preset, spec))
    return NumstabSession(fw, preset, spec, cache[key], theta0)


def train_run(
    fw: Any,
    preset: Preset,
    spec: RunSpec,
    session: Any,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train one run with ``session`` (numstab's stack or a native one: ``scale()``,
    ``skips``, ``step(tokens, targets, lr, poison)``) and return its per-step record
    (plain Python values; non-finite -> None).

    The run stops early, as diverged, after ``preset.divergence_patience`` consecutive
    non-finite losses: nothing can recover from there.
    """
    fault_at = preset.at_fault()
    data = batches(preset.vocab, preset.context, preset.batch, preset.steps, spec.seed)
    schedule = schedule_for(preset, spec)
    fw.reset_peak_memory()
    names = ("loss", "grad_finite", "skipped", "scale", "grad_norm", "lr", "step_time")
    rec: dict[str, list] = {k: [] for k in names}
    rec.update(attn_logit_max=[], out_logit_max=[], grad_underflow_frac=[])
    bad_streak = 0
    stopped_at = None
    for i in range(preset.steps):
        lr = schedule(i) * (preset.lr_spike if spec.fault == "lr_spike" and i == fault_at else 1)
        poison = math.nan if spec.fault == "nan_batch" and i == fault_at else 0.0
        scale = session.scale()
        start = time.perf_counter()
        loss, finite, norm, stats, tail = session.step(data[i, :, :-1], data[i, :, 1:], lr, poison)
        loss = float(fw.to_numpy(loss))
        finite = bool(fw.to_numpy(finite))
        norm = float(fw.to_numpy(norm))
        rec["step_time"].append(time.perf_counter() - start)
        attn = max((float(fw.to_numpy(a)) for a in stats[0]), default=math.nan)
        rec["attn_logit_max"].append(_finite_or_none(attn))
        rec["out_logit_max"].append(_finite_or_none(float(fw.to_numpy(stats[1]))))
        rec["grad_underflow_frac"].append(zero_fraction(fw.to_numpy, tail))
        rec["loss"].append(_finite_or_none(loss))
        rec["grad_finite"].append(finite)
        rec["skipped"].append(session.skips and not finite)
        rec["scale"].append(scale)
        rec["grad_norm"].append(_finite_or_none(norm))
        rec["lr"].append(lr)
        if on_step is not None:
            on_step(i)
        bad_streak = 0 if math.isfinite(loss) else bad_streak + 1
        if bad_streak >= preset.divergence_patience:
            stopped_at = i
            break
    peak, source = fw.peak_memory()
    return {
        **rec,
        "steps_run": len(rec["loss"]),
        "stopped_early_at": stopped_at,
        "peak_memory_bytes": peak,
        "peak_memory_source": source,
    }
