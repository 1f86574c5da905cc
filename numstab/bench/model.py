"""The benchmark's decoder-only transformer LM, written once over a small ``ops`` adapter.

Each framework's ``numstab/frameworks/<name>/bench.py`` supplies ``ops`` (cast, take,
matmul, reshape, transpose, mean, rsqrt, tanh, exp, max, sum, absmax, constant); the math
below is the same for all three, so the same weights give the same function.

Mixed precision, identical in every framework (numstab's own policy, not a framework's
autocast list, whose op lists differ): master weights stay float32 and are cast to the
compute dtype where used; matmuls, GELU and the residual stream run in the compute dtype;
LayerNorm statistics and the attention softmax run in float32 and are cast back; the logits
come out in the compute dtype and ``numstab.cross_entropy`` upcasts them to float32.

Pre-LN blocks: x += attn(LN1(x)); x += mlp(LN2(x)); logits = LNf(x) @ unembed.
GELU is the tanh approximation, written out. The causal mask adds -1e9 in float32.

``qk_norm`` (the remedy of Wortsman et al. 2023 for attention-logit growth) normalises each
head's queries and keys with a LayerNorm without gain or bias (float32 statistics) before
their product, so the weights stay the same with and without it. The native stacks call
the same function with ``dtype="float32"`` under the framework's own autocast (torch) or
with weights already cast by the framework's policy (Keras, jmp): the casts are then no-ops.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from numstab.bench.spec import Preset

Array = Any
F32 = "float32"
LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)


def causal_mask(context: int) -> np.ndarray:
    """(context, context) float32: 0 on and below the diagonal, -1e9 above."""
    return np.triu(np.full((context, context), -1e9, np.float32), k=1)


def layer_norm(ops: Any, x: Array, gain: Array | None, bias: Array | None, dtype: str) -> Array:
    """Over the last axis, in float32 (gain and bias too: a policy may have cast them)."""
    x32 = ops.cast(x, F32)
    centered = x32 - ops.mean(x32)
    y = centered * ops.rsqrt(ops.mean(centered * centered) + LN_EPS)
    if gain is not None:
        y = y * ops.cast(gain, F32) + ops.cast(bias, F32)
    return ops.cast(y, dtype)


def gelu(ops: Any, u: Array) -> Array:
    return 0.5 * u * (1.0 + ops.tanh(GELU_C * (u + 0.044715 * u * u * u)))


def softmax32(ops: Any, scores32: Array) -> Array:
    shifted = scores32 - ops.max(scores32)
    e = ops.exp(shifted)
    return e / ops.sum(e)


def forward(
    ops: Any,
    params: dict[str, Array],
    tokens: Array,
    preset: Preset,
    dtype: str,
    poison: Array,
    qk_norm: bool = False,
) -> tuple[Array, list[Array]]:
    """Logits (batch, context, vocab) in ``dtype``, and per layer the largest |attention
    logit| (float32 scalars). ``poison``: a float32 scalar added to the embeddings (0, or
    NaN for the NaN-batch fault)."""
    b, t, d, h = preset.batch, preset.context, preset.d_model, preset.heads
    dh = d // h

    def w(name: str) -> Array:
        return ops.cast(params[name], dtype)

    x = ops.take(w("embed"), tokens) + w("pos") + ops.cast(poison, dtype)
    mask = ops.constant(causal_mask(t))
    attn_max = []
    for i in range(preset.layers):
        p = f"block{i}."
        y = layer_norm(ops, x, params[p + "ln1.g"], params[p + "ln1.b"], dtype)
        qkv = ops.matmul(y, w(p + "qkv.w")) + w(p + "qkv.b")
        qkv = ops.transpose(ops.reshape(qkv, (b, t, 3, h, dh)), (2, 0, 3, 1, 4))
        q, k, v = qkv[0], qkv[1], qkv[2]
        if qk_norm:
            q, k = layer_norm(ops, q, None, None, dtype), layer_norm(ops, k, None, None, dtype)
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(dh))
        scores32 = ops.cast(scores, F32)
        attn_max.append(ops.absmax(scores32))
        probs = ops.cast(softmax32(ops, scores32 + mask), dtype)
        attn = ops.reshape(ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3)), (b, t, d))
        x = x + ops.matmul(attn, w(p + "out.w")) + w(p + "out.b")
        y = layer_norm(ops, x, params[p + "ln2.g"], params[p + "ln2.b"], dtype)
        u = ops.matmul(y, w(p + "mlp1.w")) + w(p + "mlp1.b")
        u = gelu(ops, u)
        x = x + ops.matmul(u, w(p + "mlp2.w")) + w(p + "mlp2.b")
    x = layer_norm(ops, x, params["lnf.g"], params["lnf.b"], dtype)
    return ops.matmul(x, w("unembed")), attn_max
