"""PyTorch's own AMP recipe for the benchmark (``--stack native``).

As a PyTorch user writes it: ``torch.autocast(device_type, dtype=float16|bfloat16)`` around
the forward pass and the loss (autocast's own op lists decide what runs in 16 bits),
``F.cross_entropy``, ``torch.amp.GradScaler`` for float16 with the ``ls`` remedy
(``scaler.scale(loss).backward()``, ``scaler.unscale_``, ``clip_grad_norm_`` for ``clip``,
``scaler.step``, ``scaler.update``), ``torch.optim.AdamW``. The model is model.py's forward
with ``dtype="float32"`` (its casts are no-ops; autocast does the casting), on the same
initial weights as numstab's stack. ``z_loss`` adds ``1e-4 * mean(logsumexp(logits)**2)``.
Without ``ls`` (or in bf16 / fp32, where the recipe has no scaler) nothing is skipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from numstab.bench.model import forward
from numstab.bench.spec import COMPUTE_DTYPES, Z_LOSS, Preset, RunSpec
from numstab.bench.train import initial_weights


class TorchNativeSession:
    def __init__(self, fw: Any, preset: Preset, spec: RunSpec):
        self.fw, self.preset, self.spec = fw, preset, spec
        device = fw.asarray(torch.zeros(()).numpy()).device
        self.device_type = device.type
        self.params = {
            name: torch.nn.Parameter(fw.asarray(value))
            for name, value in initial_weights(preset, spec).items()
        }
        self.amp_dtype = getattr(torch, COMPUTE_DTYPES[spec.precision])
        self.autocast = spec.precision != "fp32"
        self.skips = spec.loss_scaling and spec.precision == "fp16"
        # torch's defaults (init 2**16, x2 / x0.5), the preset's growth interval
        self.scaler = torch.amp.GradScaler(
            self.device_type,
            growth_interval=preset.scale_growth_interval,
            enabled=self.skips,
        )
        self.opt = torch.optim.AdamW(
            list(self.params.values()),
            lr=spec.peak_lr(preset),
            betas=(preset.beta1, preset.beta2),
            eps=preset.eps,
            weight_decay=preset.weight_decay,
        )

    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.skips else 1.0

    def _loss(self, tokens: torch.Tensor, targets: torch.Tensor, poison: float) -> tuple:
        p = self.preset
        with torch.autocast(self.device_type, dtype=self.amp_dtype, enabled=self.autocast):
            poison_t = torch.tensor(poison, dtype=torch.float32, device=tokens.device)
            logits, attn_max = forward(
                self.fw.ops, self.params, tokens, p, "float32", poison_t, self.spec.has("qk_norm")
            )
            flat = logits.reshape(-1, p.vocab)
            loss = F.cross_entropy(flat, targets.reshape(-1).long())
            if self.spec.has("z_loss"):
                loss = loss + Z_LOSS * torch.logsumexp(flat.float(), dim=-1).pow(2).mean()
        return loss, (attn_max, logits.detach().abs().amax().float())

    def step(self, tokens, targets, lr: float, poison: float) -> tuple:
        fw = self.fw
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss, stats = self._loss(fw.asarray(tokens), fw.asarray(targets), poison)
        self.scaler.scale(loss).backward()
        params = list(self.params.values())
        tail = [p.grad.detach().clone() for n, p in self.params.items() if n != "embed"]
        self.scaler.unscale_(self.opt)
        if self.spec.clip:
            norm = torch.nn.utils.clip_grad_norm_(params, self.preset.max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        finite = torch.isfinite(norm)
        self.scaler.step(self.opt)  # skipped by the scaler when it found inf / NaN
        self.scaler.update()
        return loss.detach().float(), finite, norm, stats, tail


def session(fw: Any, preset: Preset, spec: RunSpec, cache: dict) -> TorchNativeSession:
    return TorchNativeSession(fw, preset, spec)
