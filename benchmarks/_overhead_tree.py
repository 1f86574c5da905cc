"""The tree operations of benchmarks/overhead.py: numstab against what a user of each framework
writes without it, on one list of gradient-shaped arrays.

=============  ==========================  ==========================  ==========================
op             torch                       jax                         tensorflow
=============  ==========================  ==========================  ==========================
global_norm    nn.utils.get_total_norm     optax.global_norm           tf.linalg.global_norm
               (foreach=True)
clip           get_total_norm +            optax.clip_by_global_norm   tf.clip_by_global_norm
               _foreach_mul (new tensors)  (...).update
all_finite     stack of isfinite().all()   jmp.all_finite              reduce_all of
                                                                       is_finite per tensor
scaler step    _foreach_mul by 1/scale,    jmp.DynamicLossScale:       g * (1/scale), reduce_all
(unscale,      isfinite per tensor,        unscale, all_finite,        is_finite, Keras' update
check, update) _amp_update_scale_          adjust                      rule written in tf ops
find_nonfinite per-tensor isfinite().all() per-leaf jnp.isfinite       per-tensor reduce_all
(eager only)   read on the host            .all() read on the host     read on the host
=============  ==========================  ==========================  ==========================

numstab's calls: ``global_norm(g)``, ``clip_by_global_norm(g, MAX_NORM)``, ``all_finite(g)``,
``scaler.update(state, finite)`` after ``scaler.unscale(g, state)`` with the framework's own
preset ("torch", "jmp", "keras"), and ``find_nonfinite(g)``. Every pair is asserted to agree
before it is timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

import numstab

MAX_NORM = 1.0
SCALE = 2.0**15
Pair = tuple[Callable[[], Any], Callable[[], Any]]  # (numstab, native) zero-argument calls


def make_grads(tensors: int, params: int, seed: int = 0) -> list[np.ndarray]:
    """Half weight matrices, half bias vectors, ``params`` elements in all; global norm ~3."""
    rng = np.random.default_rng(seed)
    per_matrix = max(1, int(0.98 * params) // max(1, tensors // 2))
    side = max(1, int(math.sqrt(per_matrix)))
    shapes: list[tuple[int, ...]] = []
    for i in range(tensors):
        shapes.append((side + i % 7, side - i % 5) if i % 2 == 0 else (side + i % 11,))
    n = sum(math.prod(s) for s in shapes)
    std = 3.0 * MAX_NORM / math.sqrt(n)
    return [(rng.standard_normal(s, dtype=np.float32) * std) for s in shapes]


def _to_numpy_tree(tree: Any) -> list[np.ndarray]:
    from numstab.tree import flatten

    leaves, _ = flatten(tree)
    return [np.asarray(x.numpy() if hasattr(x, "numpy") else x, np.float64) for x in leaves]


def assert_agree(op: str, ours: Any, theirs: Any, rtol: float = 2e-5) -> None:
    a, b = _to_numpy_tree(ours), _to_numpy_tree(theirs)
    assert len(a) == len(b), f"{op}: numstab returned {len(a)} leaves, native {len(b)}"
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-12, err_msg=f"{op}: numstab differs")


def _find(grads: Any) -> Callable[[], Any]:
    from numstab.nonfinite import find_nonfinite

    return lambda: len(find_nonfinite(grads))


def torch_pairs(host: list[np.ndarray], device: str, compiled: bool) -> dict[str, Pair]:
    import torch

    dev = torch.device("cuda" if device == "gpu" else "cpu")
    g = [torch.from_numpy(x).to(dev) for x in host]
    scaled = [x * SCALE for x in g]
    scaler = numstab.LossScaler.preset("torch")
    state = scaler.init(like=g[0])

    def native_clip(grads):
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        return torch._foreach_mul(grads, torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)), norm

    def native_step(grads, scale, tracker):
        scale, tracker = scale.clone(), tracker.clone()  # _amp_update_scale_ works in place
        unscaled = torch._foreach_mul(grads, 1.0 / scale)
        found = (~torch.stack([torch.isfinite(x).all() for x in unscaled]).all()).float()
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2000)
        return unscaled, scale

    def ours_step(grads, state):
        unscaled, finite = scaler.unscale(grads, state)
        return unscaled, scaler.update(state, finite).scale

    pairs = {
        "global_norm": (
            lambda x: numstab.global_norm(x),
            lambda x: torch.nn.utils.get_total_norm(x, 2.0, foreach=True),
        ),
        "clip": (
            lambda x: numstab.clip_by_global_norm(x, MAX_NORM)[0],
            lambda x: native_clip(x)[0],
        ),
        "all_finite": (
            lambda x: numstab.all_finite(x),
            lambda x: torch.stack([torch.isfinite(t).all() for t in x]).all(),
        ),
    }
    out: dict[str, Pair] = {}
    wrap = torch.compile if compiled else (lambda f: f)
    for op, (ours, theirs) in pairs.items():
        ours, theirs = wrap(ours), wrap(theirs)
        out[op] = (lambda f=ours: f(g), lambda f=theirs: f(g))
    tracker = torch.zeros((), dtype=torch.int32, device=dev)
    ours_s, theirs_s = wrap(ours_step), wrap(native_step)
    out["scaler step"] = (
        lambda: ours_s(scaled, state),
        lambda: theirs_s(scaled, state.scale, tracker),
    )
    if not compiled and _has_find():
        out["find_nonfinite"] = (
            _find(g),
            lambda: sum(not bool(torch.isfinite(t).all()) for t in g),
        )
    return out


def jax_pairs(host: list[np.ndarray], device: str, compiled: bool) -> dict[str, Pair]:
    import jax
    import jax.numpy as jnp
    import jmp
    import optax

    dev = jax.devices("gpu" if device == "gpu" else "cpu")[0]
    g = [jax.device_put(x, dev) for x in host]
    scaled = [x * SCALE for x in g]
    scaler = numstab.LossScaler.preset("jmp")
    state = scaler.init(like=g[0])
    clip = optax.clip_by_global_norm(MAX_NORM)
    clip_state = clip.init(g)
    jmp_scale = jmp.DynamicLossScale(jnp.float32(SCALE))

    def native_step(grads, loss_scale):
        unscaled = loss_scale.unscale(grads)
        return unscaled, loss_scale.adjust(jmp.all_finite(unscaled)).loss_scale

    def ours_step(grads, state):
        unscaled, finite = scaler.unscale(grads, state)
        return unscaled, scaler.update(state, finite).scale

    pairs = {
        "global_norm": (lambda x: numstab.global_norm(x), optax.global_norm),
        "clip": (
            lambda x: numstab.clip_by_global_norm(x, MAX_NORM)[0],
            lambda x: clip.update(x, clip_state)[0],
        ),
        "all_finite": (lambda x: numstab.all_finite(x), jmp.all_finite),
    }
    wrap = jax.jit if compiled else (lambda f: f)
    out: dict[str, Pair] = {}
    for op, (ours, theirs) in pairs.items():
        ours, theirs = wrap(ours), wrap(theirs)
        out[op] = (lambda f=ours: f(g), lambda f=theirs: f(g))
    ours_s, theirs_s = wrap(ours_step), wrap(native_step)
    out["scaler step"] = (lambda: ours_s(scaled, state), lambda: theirs_s(scaled, jmp_scale))
    if not compiled and _has_find():
        out["find_nonfinite"] = (
            _find(g),
            lambda: sum(not bool(jnp.isfinite(t).all()) for t in g),
        )
    return out


def tensorflow_pairs(host: list[np.ndarray], device: str, compiled: bool) -> dict[str, Pair]:
    import tensorflow as tf

    placement = "/GPU:0" if device == "gpu" else "/CPU:0"
    with tf.device(placement):
        g = [tf.identity(x) for x in host]
        scaled = [x * SCALE for x in g]
    scaler = numstab.LossScaler.preset("keras")
    state = scaler.init(like=g[0])

    def native_step(grads, scale, counter):
        # Keras 3 LossScaleOptimizer's rule, in plain TF ops: double after 2000 finite steps,
        # halve on a non-finite one
        unscaled = [x * (1.0 / scale) for x in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(x)) for x in unscaled])
        grow = tf.logical_and(finite, counter + 1 >= 2000)
        new_scale = tf.where(finite, tf.where(grow, scale * 2.0, scale), scale * 0.5)
        return unscaled, new_scale

    def ours_step(grads, state):
        unscaled, finite = scaler.unscale(grads, state)
        return unscaled, scaler.update(state, finite).scale

    pairs = {
        "global_norm": (lambda x: numstab.global_norm(x), tf.linalg.global_norm),
        "clip": (
            lambda x: numstab.clip_by_global_norm(x, MAX_NORM)[0],
            lambda x: tf.clip_by_global_norm(x, MAX_NORM)[0],
        ),
        "all_finite": (
            lambda x: numstab.all_finite(x),
            lambda x: tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in x]),
        ),
    }
    wrap = tf.function if compiled else (lambda f: f)
    out: dict[str, Pair] = {}
    for op, (ours, theirs) in pairs.items():
        ours, theirs = wrap(ours), wrap(theirs)
        out[op] = (lambda f=ours: f(g), lambda f=theirs: f(g))
    counter = tf.constant(0, tf.int32)
    ours_s, theirs_s = wrap(ours_step), wrap(native_step)
    out["scaler step"] = (
        lambda: ours_s(scaled, state),
        lambda: theirs_s(scaled, state.scale, counter),
    )
    if not compiled and _has_find():
        out["find_nonfinite"] = (
            _find(g),
            lambda: sum(not bool(tf.reduce_all(tf.math.is_finite(t))) for t in g),
        )
    return out


def _has_find() -> bool:
    try:
        from numstab.nonfinite import find_nonfinite  # noqa: F401
    except ImportError:
        return False
    return True


PAIRS = {"torch": torch_pairs, "jax": jax_pairs, "tensorflow": tensorflow_pairs}
