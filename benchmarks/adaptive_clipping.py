"""Adaptive clipping against the reference implementations, in one run.

1. ZClip on torch (eager, CPU unless CUDA is there): ``numstab.integrations.torch.ZClip().step``
   against ``zclip.ZClip().step`` (the zclip package, which reads the norm on the host with
   ``.item()``), on the ``.grad`` of a stack of Linear layers, past the 25-step warmup.
2. AGC under jax.jit: ``numstab.integrations.optax.agc()`` against
   ``optax.adaptive_grad_clip(0.01)``, ``update`` jitted, on a tree of 2-D and 1-D leaves.

How: both sides run in one process on the same inputs, interleaved (AB BA ...), after untimed
warmup calls (which also compile); torch gradients are restored from a copy before each call,
outside the timed region; JAX calls end in block_until_ready. Before timing, both sides'
outputs are asserted equal, so a fast but wrong path cannot win. Reported: median ms per call
and ratio = numstab / reference (< 1: numstab faster), against the goal of a call against
its native counterpart (issue 20): 1.05 eager (ZClip), 1.02 compiled (AGC).

Usage: python benchmarks/adaptive_clipping.py [--layers 16] [--width 512] [--repeats 30] [--quick]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from _goals import COMPILED_GOAL, EAGER_GOAL, add_json_option, goal_row, print_rows, write_json


def _interleaved(a, b, repeats, before=lambda: None):
    times = {"a": [], "b": []}
    for i in range(repeats):
        order = (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))
        for name, fn in order:
            before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["a"]) * 1e3, statistics.median(times["b"]) * 1e3


def bench_zclip(layers, width, repeats):
    import torch
    import zclip

    from numstab.integrations.torch import ZClip

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    grads = [torch.randn_like(p) * 0.01 for p in model.parameters()]

    def restore():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()

    ours, ref = ZClip(), zclip.ZClip()
    for _ in range(30):  # past the warmup; equal results on every step
        restore()
        norm = ours.step(model)
        mine = [p.grad.clone() for p in model.parameters()]
        restore()
        ref_norm = ref.step(model)
        assert abs(float(norm) - ref_norm) <= 1e-5 * ref_norm
        for a, p in zip(mine, model.parameters(), strict=True):
            torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-8)

    def sync_ours():
        ours.step(model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    numstab_ms, ref_ms = _interleaved(sync_ours, lambda: ref.step(model), repeats, restore)
    n = sum(p.numel() for p in model.parameters())
    case = f"ZClip torch ({2 * layers} leaves, {n / 1e6:.1f}M params)"
    return goal_row(case, numstab_ms / ref_ms, EAGER_GOAL, numstab_ms=numstab_ms, ref_ms=ref_ms)


def bench_agc(layers, width, repeats):
    import jax
    import jax.numpy as jnp
    import optax

    from numstab.integrations.optax import agc

    rng = np.random.default_rng(0)
    params, grads = {}, {}
    for i in range(layers):
        for name, shape in ((f"w{i}", (width, width)), (f"b{i}", (width,))):
            params[name] = jnp.asarray(rng.normal(0, 1, shape), jnp.float32)
            grads[name] = jnp.asarray(rng.normal(0, 0.02, shape), jnp.float32)
    ours, ref = agc(), optax.adaptive_grad_clip(0.01)
    ours_update = jax.jit(lambda g: ours.update(g, optax.EmptyState(), params)[0])
    ref_update = jax.jit(lambda g: ref.update(g, optax.EmptyState(), params)[0])
    for a, b in zip(
        jax.tree.leaves(ours_update(grads)), jax.tree.leaves(ref_update(grads)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    for _ in range(3):
        jax.block_until_ready((ours_update(grads), ref_update(grads)))
    numstab_ms, ref_ms = _interleaved(
        lambda: jax.block_until_ready(ours_update(grads)),
        lambda: jax.block_until_ready(ref_update(grads)),
        repeats,
    )
    n = sum(x.size for x in params.values())
    case = f"AGC jax.jit ({2 * layers} leaves, {n / 1e6:.1f}M params)"
    return goal_row(case, numstab_ms / ref_ms, COMPILED_GOAL, numstab_ms=numstab_ms, ref_ms=ref_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    add_json_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.repeats = 4, 128, 10
    rows = [
        bench_zclip(args.layers, args.width, args.repeats),
        bench_agc(args.layers, args.width, args.repeats),
    ]
    print_rows(rows, [("numstab_ms", ".3f"), ("ref_ms", ".3f")])
    print("reference: zclip.ZClip().step (zclip package) / optax.adaptive_grad_clip(0.01)")
    write_json(args.json, args, rows)


if __name__ == "__main__":
    main()
