"""Under jax.jit: numstab's clipping and loss-scaled optimizer step against plain optax.

What is measured (fp32, default ~200 leaves holding ~20M parameters, CPU unless JAX sees more)
----------------------------------------------------------------------------------------------
1. clip: ``numstab.clip_by_global_norm(g, 1.0)`` against
   ``optax.clip_by_global_norm(1.0).update(g, state)`` on gradients whose norm exceeds 1.
2. step: one optimizer step on SCALED gradients, returning new params and state.
   numstab:  ``loss_scaled(optax.adam(1e-3), LossScaler.preset("jmp"))``: unscale, finite
             check, skip-or-apply, scale update; then ``optax.apply_updates``.
   baseline: what a jmp + optax user writes: ``jmp.DynamicLossScale.unscale``,
             ``jmp.all_finite``, ``.adjust``, ``optax.apply_if_finite(optax.adam(1e-3), 5)``,
             ``optax.apply_updates``.
3. step + clip: the same with ``max_norm=1.0`` against
   ``apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), 5)``.

How: both sides are jitted, run in one process on the same inputs, interleaved (AB BA AB ...)
after untimed warmup rounds (which also compile); each timed call ends in block_until_ready and
the garbage collector is paused. Reported: median milliseconds and ratio = numstab / baseline
(goal 1.00 within noise), the ratio of median process CPU times (less disturbed by other
processes on a shared machine), and the ratio of the bytes the two compiled programs access by
XLA's cost analysis, which machine load does not disturb. Before timing, the outputs of both sides
are asserted equal (params, updates, norms, scales), so a fast but wrong path cannot win.
Goal: a compiled call's, ratio <= 1.02 (issue 20); ``--json PATH`` writes the rows (ratio,
goal, meets_goal).

Usage: python benchmarks/clipping_jax.py [--leaves 200] [--params 20e6] [--repeats 15]
       [--warmup 3] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _goals import COMPILED_GOAL, add_json_option, goal_row, print_rows, write_json

import numstab
from numstab import LossScaler
from numstab.frameworks.jax.optax import loss_scaled

SCALE = 2.0**15


def make_tree(n_leaves: int, n_params: float, seed: int = 0) -> dict[str, jax.Array]:
    """``n_leaves`` leaves in groups of four (matrix, matrix, two vectors), ~``n_params`` total."""
    layers = max(n_leaves // 4, 1)
    per_layer = n_params / layers
    width = max(int((per_layer / 0.925) ** 0.5), 8)  # 0.8 w^2 + w^2 / 8 + 2 w elements
    rng = np.random.default_rng(seed)
    tree = {}
    for i in range(layers):
        shapes = {
            "w": (int(0.8 * width), width),
            "w2": (width, width // 8 or 1),
            "b": (width,),
            "g": (width,),
        }
        for name, shape in shapes.items():
            tree[f"{i:03d}.{name}"] = jnp.asarray(rng.standard_normal(shape, np.float32) * 1e-3)
    return tree


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (less disturbed by other load)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_pair(
    a: Callable[[], Any], b: Callable[[], Any], repeats: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """{"a": (median wall s, median CPU s), "b": ...}, calls interleaved AB BA AB ..."""
    for _ in range(warmup):
        jax.block_until_ready(a())
        jax.block_until_ready(b())
    wall: dict[str, list[float]] = {"a": [], "b": []}
    cpu: dict[str, list[float]] = {"a": [], "b": []}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            order = (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a))
            for name, fn in order:
                start, start_cpu = time.perf_counter(), cpu_seconds()
                jax.block_until_ready(fn())
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(cpu_seconds() - start_cpu)
    finally:
        gc.enable()
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in wall}


def assert_trees_close(a: Any, b: Any, what: str, rtol: float = 1e-5, atol: float = 0.0) -> None:
    la, da = jax.tree.flatten(a)
    lb, db = jax.tree.flatten(b)
    assert da == db, f"{what}: tree structures differ"
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=what)


# -- the compared programs ---------------------------------------------------------------------


Program = tuple[Callable, tuple]  # a jitted function and its arguments


def xla_bytes(program: Program) -> float:
    """Bytes accessed by the compiled program, from XLA's cost analysis (load-independent)."""
    fn, args = program
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("bytes accessed", float("nan")))


def clip_pair(grads: Any) -> tuple[Program, Program]:
    ours = jax.jit(lambda g: numstab.clip_by_global_norm(g, 1.0))
    clip = optax.clip_by_global_norm(1.0)
    theirs = jax.jit(lambda g: (clip.update(g, clip.init(g))[0], optax.global_norm(g)))
    clipped, norm = ours(grads)
    ref_clipped, ref_norm = theirs(grads)
    assert float(ref_norm) > 1.0, "the benchmark must exercise clipping"
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
    assert_trees_close(clipped, ref_clipped, "clip", rtol=1e-5, atol=1e-12)
    return (ours, (grads,)), (theirs, (grads,))


def adam_state(state: Any) -> optax.ScaleByAdamState:
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    (found,) = [x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x)]
    return found


def step_pair(params: Any, scaled: Any, max_norm: float | None) -> tuple[Program, Program]:
    import jmp

    tx = loss_scaled(optax.adam(1e-3), LossScaler.preset("jmp"), max_norm=max_norm)

    @jax.jit
    def ours(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    inner = optax.adam(1e-3)
    if max_norm is not None:
        inner = optax.chain(optax.clip_by_global_norm(max_norm), inner)
    guarded = optax.apply_if_finite(inner, max_consecutive_errors=5)

    @jax.jit
    def theirs(p, s, ls, g):  # ls: jmp's (loss_scale, counter), rebuilt here (jit-safe)
        ls = jmp.DynamicLossScale(*ls)
        g = ls.unscale(g)
        ls = ls.adjust(jmp.all_finite(g))
        updates, s = guarded.update(g, s, p)
        return optax.apply_updates(p, updates), s, (ls.loss_scale, ls.counter)

    state, ref_state = tx.init(params), guarded.init(params)
    ls = (jnp.float32(SCALE), jnp.int32(0))
    # agreement on a finite step, then on a non-finite one (both skip, both back off)
    p1, s1 = ours(params, state, scaled)
    q1, t1, ls1 = theirs(params, ref_state, ls, scaled)
    assert_trees_close(p1, q1, "step params", rtol=1e-6, atol=1e-9)
    assert_trees_close(adam_state(s1), adam_state(t1), "adam state", rtol=1e-5, atol=1e-12)
    assert float(s1.loss_scale.scale) == float(ls1[0]) == SCALE
    bad = {**scaled, "000.w": scaled["000.w"].at[0, 0].set(jnp.inf)}
    p2, s2 = ours(p1, s1, bad)
    q2, _, ls2 = theirs(q1, t1, ls1, bad)
    assert_trees_close(p2, p1, "skipped step moved params", rtol=0.0)
    assert_trees_close(q2, q1, "baseline skipped step moved params", rtol=0.0)
    assert float(s2.loss_scale.scale) == float(ls2[0]) == SCALE / 2
    assert int(s2.inner_state[0].count) == 1  # the skipped step did not advance adam
    assert_trees_close(s2.inner_state, s1.inner_state, "skipped step moved the state", rtol=0.0)
    return (ours, (params, state, scaled)), (theirs, (params, ref_state, ls, scaled))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", type=int, default=200)
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2M params, 5 repeats")
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.params, args.repeats, args.warmup = 2e6, 5, 1

    grads = make_tree(args.leaves, args.params)
    grads = jax.tree.map(lambda g: g * 100.0, grads)  # global norm well above 1
    params = make_tree(args.leaves, args.params, seed=1)
    scaled = jax.tree.map(lambda g: g * SCALE, grads)
    n_params = sum(int(x.size) for x in jax.tree.leaves(grads))
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, {jax.devices()[0].platform}, "
        f"{len(jax.tree.leaves(grads))} leaves, {n_params / 1e6:.1f}M params fp32, "
        f"{args.repeats} interleaved rounds (median)"
    )
    pairs = [
        ("clip_by_global_norm", "optax.clip_by_global_norm", clip_pair(grads)),
        ("loss_scaled(adam) step", "jmp + apply_if_finite(adam)", step_pair(params, scaled, None)),
        (
            "loss_scaled(adam, max_norm=1)",
            "jmp + apply_if_finite(chain(clip, adam))",
            step_pair(params, scaled, 1.0),
        ),
    ]
    rows = []
    for ours_name, base_name, (ours, theirs) in pairs:
        t = timed_pair(
            lambda p=ours: p[0](*p[1]), lambda p=theirs: p[0](*p[1]), args.repeats, args.warmup
        )
        (wall, cpu), (base_wall, base_cpu) = t["a"], t["b"]
        rows.append(
            goal_row(
                ours_name,
                wall / base_wall,
                COMPILED_GOAL,
                baseline=base_name,
                ms=wall * 1e3,
                base_ms=base_wall * 1e3,
                cpu_ratio=cpu / base_cpu,
                xla_bytes_ratio=xla_bytes(ours) / xla_bytes(theirs),
            )
        )
    columns = [("baseline", "s"), ("ms", ".2f"), ("base_ms", ".2f"), ("cpu_ratio", ".3f")]
    print_rows(rows, [*columns, ("xla_bytes_ratio", ".3f")])
    print("ratio: median wall time; cpu_ratio: median process CPU time; xla_bytes_ratio: bytes")
    print("accessed by the compiled programs (XLA cost analysis); all numstab / baseline")
    write_json(args.json, args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
