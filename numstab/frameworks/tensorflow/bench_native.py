"""Keras 3's own mixed-precision recipe (TensorFlow backend) for the benchmark
(``--stack native``).

As a Keras user writes it: the global dtype policy ``mixed_float16`` / ``mixed_bfloat16``
set when the model is built (variables float32, autocast to the compute dtype when read in
``call``); the model is one ``keras.layers.Layer`` whose ``call`` is model.py's forward
(its casts are no-ops on the autocast weights); ``SparseCategoricalCrossentropy(
from_logits=True)``; ``keras.optimizers.AdamW`` (``global_clipnorm=max_norm`` with
``clip``), wrapped for float16 with ``ls`` in ``keras.optimizers.LossScaleOptimizer``
(Keras's default initial scale 2**15, the preset's growth interval), used in a custom
``tf.function`` step (``scale_loss``, ``GradientTape``, ``apply``: the LossScaleOptimizer
unscales, checks, skips and adjusts the scale). One model, optimizer and traced step per
(precision, remedy), reset to the run's initial weights and a fresh optimizer state (every
optimizer variable as it was after ``build``) at the start of each run.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from numstab.bench.model import forward
from numstab.bench.spec import Z_LOSS, Preset, RunSpec
from numstab.bench.train import initial_weights

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


class BenchLM(keras.layers.Layer):
    """model.py's transformer as a Keras layer holding the weights as Keras variables."""

    def __init__(self, fw: Any, preset: Preset, weights: dict[str, np.ndarray], qk_norm: bool):
        super().__init__(name="bench_lm")
        self.fw, self.preset, self.qk_norm = fw, preset, qk_norm
        self.names = list(weights)
        self.vars = []
        for name, value in weights.items():
            var = self.add_weight(
                shape=value.shape, initializer="zeros", dtype="float32", name=name
            )
            var.assign(value)
            self.vars.append(var)

    def call(self, tokens, poison):
        params = {n: v.value for n, v in zip(self.names, self.vars, strict=True)}
        return forward(
            self.fw.ops, params, tokens, self.preset, self.compute_dtype, poison, self.qk_norm
        )


def _optimizer(preset: Preset, spec: RunSpec, dynamic: bool) -> keras.optimizers.Optimizer:
    opt = keras.optimizers.AdamW(
        learning_rate=spec.peak_lr(preset),
        weight_decay=preset.weight_decay,
        beta_1=preset.beta1,
        beta_2=preset.beta2,
        epsilon=preset.eps,
        global_clipnorm=preset.max_norm if spec.clip else None,
    )
    if dynamic:
        opt = keras.optimizers.LossScaleOptimizer(
            opt, dynamic_growth_steps=preset.scale_growth_interval
        )
    return opt


class KerasNativeSession:
    def __init__(self, fw: Any, preset: Preset, spec: RunSpec):
        self.fw = fw
        self.skips = spec.loss_scaling and spec.precision == "fp16"
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(POLICIES[spec.precision])
        try:
            self.model = BenchLM(fw, preset, initial_weights(preset, spec), spec.has("qk_norm"))
        finally:
            keras.config.set_dtype_policy(previous)
        self.opt = _optimizer(preset, spec, self.skips)
        self.opt.build(self.model.trainable_variables)
        self.fresh_opt = [v.numpy() for v in self.opt.variables]
        self.step_fn = fw.compile(self._make_step(preset, spec))

    def reset(self, preset: Preset, spec: RunSpec) -> KerasNativeSession:
        """The run's initial weights and a fresh optimizer (same traced step)."""
        weights = initial_weights(preset, spec)
        for name, var in zip(self.model.names, self.model.vars, strict=True):
            var.assign(weights[name])
        for var, value in zip(self.opt.variables, self.fresh_opt, strict=True):
            var.assign(value)
        return self

    def _make_step(self, preset: Preset, spec: RunSpec) -> Any:
        model, opt, skips = self.model, self.opt, self.skips
        cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        z_loss = spec.has("z_loss")
        embed = model.names.index("embed")

        def step(tokens, targets, poison):
            variables = model.trainable_variables
            with tf.GradientTape() as tape:
                logits, attn_max = model(tokens, poison)
                loss = cross_entropy(targets, logits)
                if z_loss:
                    lse = keras.ops.logsumexp(keras.ops.cast(logits, "float32"), axis=-1)
                    loss = loss + Z_LOSS * keras.ops.mean(keras.ops.square(lse))
                scaled = opt.scale_loss(loss) if skips else loss
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(scaled, variables)]
            scale = opt.dynamic_scale if skips else 1.0
            norm = tf.linalg.global_norm(grads) / scale
            finite = opt.check_finite(grads) if skips else tf.math.is_finite(norm)
            opt.apply(grads, variables)
            out_max = tf.cast(tf.reduce_max(tf.abs(tf.stop_gradient(logits))), tf.float32)
            tail = [g for i, g in enumerate(grads) if i != embed]
            return loss, finite, norm, (attn_max, out_max), tail

        return step

    def scale(self) -> float:
        return float(self.opt.dynamic_scale.numpy()) if self.skips else 1.0

    def step(self, tokens, targets, lr: float, poison: float) -> tuple:
        fw = self.fw
        self.opt.learning_rate = lr
        return self.step_fn(fw.asarray(tokens), fw.asarray(targets), fw.asarray(np.float32(poison)))


def session(fw: Any, preset: Preset, spec: RunSpec, cache: dict) -> KerasNativeSession:
    key = ("native", spec.precision, spec.remedy)
    if key not in cache:
        cache[key] = KerasNativeSession(fw, preset, spec)
    return cache[key].reset(preset, spec)
