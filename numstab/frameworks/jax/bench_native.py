"""JAX's own mixed-precision recipe for the benchmark (``--stack native``): jmp + optax.

As a JAX user writes it: a ``jmp.Policy`` (params float32, compute float16 / bfloat16,
output float32) casting the weights before model.py's forward and the logits after it;
``optax.softmax_cross_entropy_with_integer_labels``; for float16 with the ``ls`` remedy a
``jmp.DynamicLossScale`` (initial 2**15 as in jmp's examples, x2 / x0.5, the preset's
growth interval), ``jmp.all_finite`` and ``jmp.select_tree`` to skip a non-finite step;
``optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(lr))`` (the clip only with
``clip``; the learning rate set each step through ``optax.inject_hyperparams``), all in one
``jax.jit`` step, compiled once per (precision, remedy) and reused across runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from numstab.bench.model import forward
from numstab.bench.spec import COMPUTE_DTYPES, Z_LOSS, Preset, RunSpec
from numstab.bench.train import initial_weights

JMP_INITIAL_SCALE = 2.0**15


def _optimizer(preset: Preset, spec: RunSpec) -> optax.GradientTransformation:
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=spec.peak_lr(preset),
        b1=preset.beta1,
        b2=preset.beta2,
        eps=preset.eps,
        weight_decay=preset.weight_decay,
    )
    clip = [optax.clip_by_global_norm(preset.max_norm)] if spec.clip else []
    return optax.chain(*clip, adamw)


def make_step(fw: Any, preset: Preset, spec: RunSpec) -> Any:
    compute = jnp.dtype(COMPUTE_DTYPES[spec.precision])
    policy = jmp.Policy(param_dtype=jnp.float32, compute_dtype=compute, output_dtype=jnp.float32)
    tx = _optimizer(preset, spec)
    qk_norm, z_loss = spec.has("qk_norm"), spec.has("z_loss")
    dynamic = spec.loss_scaling and spec.precision == "fp16"

    def loss_fn(params, tokens, targets, poison, loss_scale):
        compute_params = policy.cast_to_compute(params)
        logits, attn_max = forward(
            fw.ops, compute_params, tokens, preset, compute.name, poison, qk_norm
        )
        logits = policy.cast_to_output(logits)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        if z_loss:
            loss = loss + Z_LOSS * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        out_max = jnp.max(jnp.abs(jax.lax.stop_gradient(logits)))
        return loss_scale.scale(loss), (loss, (attn_max, out_max))

    def step(params, opt_state, loss_scale, tokens, targets, lr, poison):
        grads, (loss, stats) = jax.grad(loss_fn, has_aux=True)(
            params, tokens, targets, poison, loss_scale
        )
        tail = [g for name, g in grads.items() if name != "embed"]
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        norm = optax.global_norm(grads)
        inner = opt_state[-1]
        hyper = {**inner.hyperparams, "learning_rate": lr}
        opt_state = (*opt_state[:-1], inner._replace(hyperparams=hyper))
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if dynamic:
            loss_scale = loss_scale.adjust(finite)
            new_params, new_opt = jmp.select_tree(
                finite, (new_params, new_opt), (params, opt_state)
            )
        return new_params, new_opt, loss_scale, loss, finite, norm, stats, tail

    return jax.jit(step)


class JaxNativeSession:
    def __init__(self, fw: Any, preset: Preset, spec: RunSpec, step_fn: Any):
        self.fw, self.step_fn = fw, step_fn
        self.params = {k: fw.asarray(v) for k, v in initial_weights(preset, spec).items()}
        # strongly typed and placed like every step's output: the first step's inputs then
        # match the later ones, and jax.jit compiles once (the lr is set each step)
        state = _optimizer(preset, spec).init(self.params)
        self.opt_state = jax.tree.map(lambda x: fw.asarray(np.asarray(x)), state)
        self.skips = spec.loss_scaling and spec.precision == "fp16"
        if self.skips:
            scale = jmp.DynamicLossScale(
                np.float32(JMP_INITIAL_SCALE), period=preset.scale_growth_interval
            )
            self.loss_scale = jax.tree.map(lambda x: fw.asarray(np.asarray(x)), scale)
        else:
            self.loss_scale = jmp.NoOpLossScale()

    def scale(self) -> float:
        return float(self.loss_scale.loss_scale)

    def step(self, tokens, targets, lr: float, poison: float) -> tuple:
        fw = self.fw
        out = self.step_fn(
            self.params,
            self.opt_state,
            self.loss_scale,
            fw.asarray(tokens),
            fw.asarray(targets),
            fw.asarray(np.float32(lr)),
            fw.asarray(np.float32(poison)),
        )
        self.params, self.opt_state, self.loss_scale, loss, finite, norm, stats, tail = out
        return loss, finite, norm, stats, tail


def session(fw: Any, preset: Preset, spec: RunSpec, cache: dict) -> JaxNativeSession:
    key = ("native", spec.precision, spec.remedy)
    if key not in cache:
        cache[key] = make_step(fw, preset, spec)
    return JaxNativeSession(fw, preset, spec, cache[key])
