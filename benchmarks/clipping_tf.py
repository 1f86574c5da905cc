"""numstab.clip_by_global_norm against tf.clip_by_global_norm, inside tf.function, one run.

What is measured
----------------
A list of fp32 tensors shaped like a model's gradients (default 200 tensors, about 20M
parameters: 100 weight matrices of varied shapes and 100 bias vectors), clipped by global norm
in a ``tf.function`` (graph mode, no XLA) by numstab and by TensorFlow, in two cases:

* ``clip``: max_norm below the norm, every tensor is scaled;
* ``no clip``: max_norm above the norm (both still multiply every tensor, numstab by exactly
  1.0, TF by ``clip_norm * min(1 / norm, 1 / clip_norm)``);
* ``norm only``: numstab.global_norm against tf.linalg.global_norm, to locate a difference.

How
---
* Before any timing, both results (clipped tensors and norm) are asserted equal
  (``np.testing.assert_allclose``, rtol 1e-5), so a fast but wrong version cannot win.
* numstab and TF run in the same process on the same inputs, interleaved: each round runs both,
  alternating which goes first (AB BA ...). Warmup rounds come first (they also trace the
  functions). The garbage collector is paused while the clock runs; a call to a tf.function
  on CPU returns when its outputs are computed. Reported: median milliseconds over the timed
  rounds and ratio = numstab / TF, and the minimum over rounds (less sensitive to other load on
  the machine). Goal: median ratio <= 1.02, a compiled call's goal (issue 20). Timings are
  printed, never asserted; ``--json PATH`` writes the rows (ratio, goal, meets_goal).

Usage: python benchmarks/clipping_tf.py [--tensors 200] [--params 20e6] [--repeats 31]
       [--warmup 3] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's numstab

import numpy as np
from _goals import COMPILED_GOAL, add_json_option, goal_row, print_rows, write_json

if TYPE_CHECKING:
    import tensorflow as tf


def make_grads(n_tensors: int, n_params: float, seed: int = 0) -> list[tf.Tensor]:
    """Half matrices of varied shapes holding almost every parameter, half bias vectors."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    n_mats = n_tensors // 2
    weights = rng.uniform(0.5, 1.5, size=n_mats)
    sizes = (weights / weights.sum() * n_params).astype(int)
    grads = []
    for size in sizes:
        cols = int(rng.choice([128, 256, 384, 512, 768]))
        rows = max(1, int(size) // cols)
        grads.append(rng.standard_normal((rows, cols), dtype=np.float32) * 1e-3)
        grads.append(rng.standard_normal((cols,), dtype=np.float32) * 1e-3)
    grads = grads[:n_tensors]
    return [tf.constant(g) for g in grads]


def check_equal(a: tuple, b: tuple) -> None:
    (ga, na), (gb, nb) = a, b
    np.testing.assert_allclose(float(na), float(nb), rtol=1e-5)
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-5, atol=1e-12)


def time_pair(fn_a, fn_b, args, repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds of every timed call of fn_a(*args) and fn_b(*args), interleaved AB BA AB ..."""
    for _ in range(warmup):
        fn_a(*args)
        fn_b(*args)
    times: dict[int, list[float]] = {0: [], 1: []}
    fns = (fn_a, fn_b)
    for r in range(repeats):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            gc.disable()
            start = time.perf_counter()
            fns[i](*args)
            elapsed = time.perf_counter() - start
            gc.enable()
            times[i].append(elapsed)
    return times[0], times[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, parsed before TensorFlow (and numstab) are imported: ``--help`` and a
    bad option answer at once, not after the import's 15 s."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="TF intra-op threads (0: TF's)")
    add_json_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tensorflow as tf

    import numstab  # after tensorflow: numstab then keeps AutoGraph off its own code at once

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)

    grads = make_grads(args.tensors, args.params)
    n_params = sum(int(g.shape.num_elements()) for g in grads)
    norm = float(tf.linalg.global_norm(grads))

    @tf.function
    def ns_clip(gs, max_norm):
        return numstab.clip_by_global_norm(gs, max_norm)

    @tf.function
    def tf_clip(gs, max_norm):
        return tf.clip_by_global_norm(gs, max_norm)

    print(
        f"tensorflow {tf.__version__}, numstab {numstab.__version__}, CPU, "
        f"{len(grads)} tensors, {n_params / 1e6:.2f}M fp32 params, global norm {norm:.4g}; "
        f"tf.function, median of {args.repeats} interleaved rounds"
    )
    ns_norm = tf.function(lambda gs: numstab.global_norm(gs))
    tf_norm = tf.function(lambda gs: tf.linalg.global_norm(gs))
    cases = [
        # a Python float: numstab validates max_norm on the host, like torch and optax
        ("clip", norm / 4, lambda gs: ns_clip(gs, norm / 4), lambda gs: tf_clip(gs, norm / 4)),
        ("no clip", norm * 4, lambda gs: ns_clip(gs, norm * 4), lambda gs: tf_clip(gs, norm * 4)),
        ("norm only", None, ns_norm, tf_norm),
    ]
    rows = []
    for case, max_norm, ns_fn, tf_fn in cases:
        if max_norm is None:
            np.testing.assert_allclose(float(ns_fn(grads)), float(tf_fn(grads)), rtol=1e-5)
        else:
            check_equal(ns_fn(grads), tf_fn(grads))
        t_ns, t_tf = time_pair(ns_fn, tf_fn, (grads,), args.repeats, args.warmup)
        med_ns, med_tf = statistics.median(t_ns), statistics.median(t_tf)
        rows.append(
            goal_row(
                case,
                med_ns / med_tf,
                COMPILED_GOAL,
                max_norm=max_norm,  # None (null in --json, "-" printed): norm only
                numstab_ms=med_ns * 1e3,
                tf_ms=med_tf * 1e3,
                min_ratio=min(t_ns) / min(t_tf),
            )
        )
    columns = [("max_norm", ".4g"), ("numstab_ms", ".2f"), ("tf_ms", ".2f"), ("min_ratio", ".3f")]
    print_rows(rows, columns)
    write_json(args.json, args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
