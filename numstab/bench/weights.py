"""Initial weights in NumPy from a seed: the same float32 arrays are loaded into every
framework, so the frameworks start from bit-identical models.

GPT-2 style: normal(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers),
LayerNorm gain 1 and bias 0, biases 0. ``logit_scale`` multiplies the unembedding (the
logit-scale blow-up fault).
"""

from __future__ import annotations

import numpy as np

from numstab.bench.spec import Preset


def init_params(preset: Preset, seed: int, logit_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Flat dict name -> float32 array, in a fixed order (names sort as the order of use)."""
    rng = np.random.default_rng(seed)
    d, f, v, n = preset.d_model, preset.d_ff, preset.vocab, preset.layers
    residual_std = 0.02 / np.sqrt(2 * n)

    def normal(shape: tuple[int, ...], std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    params = {"embed": normal((v, d)), "pos": normal((preset.context, d))}
    for i in range(n):
        p = f"block{i}."
        params[p + "ln1.g"] = np.ones(d, np.float32)
        params[p + "ln1.b"] = np.zeros(d, np.float32)
        params[p + "qkv.w"] = normal((d, 3 * d))
        params[p + "qkv.b"] = np.zeros(3 * d, np.float32)
        params[p + "out.w"] = normal((d, d), residual_std)
        params[p + "out.b"] = np.zeros(d, np.float32)
        params[p + "ln2.g"] = np.ones(d, np.float32)
        params[p + "ln2.b"] = np.zeros(d, np.float32)
        params[p + "mlp1.w"] = normal((d, f))
        params[p + "mlp1.b"] = np.zeros(f, np.float32)
        params[p + "mlp2.w"] = normal((f, d), residual_std)
        params[p + "mlp2.b"] = np.zeros(d, np.float32)
    params["lnf.g"] = np.ones(d, np.float32)
    params["lnf.b"] = np.zeros(d, np.float32)
    params["unembed"] = (normal((d, v)) * np.float32(logit_scale)).astype(np.float32)
    return params


def layout(preset: Preset) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, start, stop) of every parameter in the flat float32 vector."""
    out, start = [], 0
    for name, value in init_params(preset, 0).items():
        out.append((name, value.shape, start, start + value.size))
        start += value.size
    return out


def flatten(params: dict[str, np.ndarray]) -> np.ndarray:
    """All parameters as one float32 vector, in ``layout`` order."""
    return np.concatenate([v.ravel() for v in params.values()]).astype(np.float32)


def unflatten(ops: object, theta: object, shapes: list) -> dict[str, object]:
    """Views of the flat vector, by name (differentiable in every framework)."""
    return {name: ops.reshape(theta[a:b], shape) for name, shape, a, b in shapes}
