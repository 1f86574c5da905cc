"""TensorFlow's fused linear cross-entropy on CPU, part by part: why its time sits over the
1.10 goal at its memory goal (issue 20, goal 5; docs/performance.md §3).

What is measured
----------------
1. The weight-gradient update of one chunk, ``dweight + g.T @ h_chunk`` (g: [C, V] float32,
   h_chunk: [C, d], dweight: [V, d]), interleaved rounds, median time per update:

   * ``fresh buffer``: one ``MatMul`` into a new [V, d] product and an add into another new
     buffer: the time floor's way (``benchmarks/memory.py``), fastest, but a second and a
     third ``dweight``-sized buffer live at once (2 x 256 MiB at the default shape);
   * ``numstab (in place)``, ``matmul_accumulate``: the product a block of ``dweight`` rows
     (4 MiB) at a time, each block added in place (``InplaceAdd`` on a [V / block, block * d]
     view), up to 16 blocks per ``while_loop`` iteration (unrolled in the graph);
   * the same in plain ops with 1 block per iteration (numstab's way until 2026-12-04) and
     with all blocks in one (a graph that grows with V);
   * ``InplaceUpdate, 1 a loop``: each block's sum (block + product) written back with
     ``InplaceUpdate`` (a copy in place of an add), for comparison.

   TensorFlow has no GEMM that accumulates into its output (oneDNN's fused MatMul + Add
   writes a new buffer), so an update that keeps one ``dweight`` is one of the in-place
   ways. Their ratio over ``fresh buffer`` is what the memory goal costs per chunk.
2. The logits product's working memory: the CPU allocator's peak during one
   ``h[:M] @ weight.T`` (BatchMatMulV2, ``adj_y``) beyond its [M, V] output, per chunk of M
   rows. At some M the CPU matmul takes a workspace of up to about one more chunk of logits
   (which M changes from process to process: 384 and 640 in one, 512 in another), and a
   fused step holds it on top of ``dweight``: one reason TensorFlow's default chunk stays
   at 256 rows for vocab 65536.

Each ratio is printed against its reference measured in the same run; ``--json PATH``
writes the rows (``ratio`` = the variant over ``fresh buffer``; the workspace rows have no
ratio, ``ratio`` None). No goal: a diagnostic, so every row prints ``-`` for its goal and
carries ``goal`` and ``meets_goal`` None.

Usage: python benchmarks/tf_fused_parts.py [--chunk 256] [--d-model 1024] [--vocab 65536]
       [--rounds 5] [--updates 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _goals
from _goals import goal_row, print_rows, write_json

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _variants(tf, vocab: int, width: int) -> dict:
    from numstab.frameworks.tensorflow import fused

    block, divides = fused._block_rows(vocab, width, 4)  # numstab's own blocks
    if not divides:
        raise SystemExit(f"vocab {vocab}: no block of numstab's size divides it; choose another")
    blocks = vocab // block

    def view(acc):
        return tf.reshape(tf.raw_ops.Snapshot(input=acc), (blocks, block * width))

    def product(g, h, i, after):
        with tf.control_dependencies([after]):  # one block at a time, as numstab's
            part = tf.slice(g, [0, i * block], [-1, block])
        return tf.matmul(part, h, transpose_a=True)

    def looped(per_iteration: int, copy: bool = False):
        """In place, ``per_iteration`` blocks per ``while_loop`` iteration (unrolled in the
        graph); ``copy``: each block's sum written back with InplaceUpdate."""

        def update(acc, g, h):
            def write(acc, i):
                rows = tf.reshape(product(g, h, i, acc), (1, -1))
                if copy:
                    rows = tf.slice(acc, [i, 0], [1, -1]) + rows
                    return tf.raw_ops.InplaceUpdate(x=acc, i=tf.reshape(i, (1,)), v=rows)
                return tf.raw_ops.InplaceAdd(x=acc, i=tf.reshape(i, (1,)), v=rows)

            def body(i, acc):
                for k in range(per_iteration):
                    acc = write(acc, i * per_iteration + k)
                return i + 1, acc

            _, acc = tf.while_loop(
                lambda i, _: i < blocks // per_iteration,
                body,
                (tf.constant(0), view(acc)),
                parallel_iterations=1,
            )
            return tf.reshape(acc, (vocab, width))

        return update

    return {
        "fresh buffer": lambda acc, g, h: acc + tf.matmul(g, h, transpose_a=True),
        "numstab (in place)": fused.matmul_accumulate,
        "in place, 1 block a loop": looped(1),
        "in place, all blocks": looped(blocks),
        "InplaceUpdate, 1 a loop": looped(1, copy=True),
    }


def update_times(args) -> list[dict]:
    """Median seconds per chunk update of each variant, interleaved rounds."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    shape = (args.chunk, args.vocab)
    # one g per update: equal products would be computed once (grappler's common
    # subexpressions), flattering the fresh-buffer way
    gs = tuple(
        tf.constant(rng.standard_normal(shape, dtype=np.float32)) for _ in range(args.updates)
    )
    h = tf.constant(rng.standard_normal((args.chunk, args.d_model), dtype=np.float32))

    def updates(gs, h, update):
        acc = tf.zeros((args.vocab, args.d_model))  # made in the step, as the fused path's
        for i in range(args.updates):
            acc = update(acc, gs[i], h)
        return acc[0, 0], acc[-1, -1]

    # one tf.function per variant, each traced once (below); a partial, not a closure:
    # TensorFlow counts traces per function code, and five closures of one code read as
    # one function retraced five times ("triggered tf.function retracing" warning)
    runs = {
        name: tf.function(functools.partial(updates, update=fn))
        for name, fn in _variants(tf, args.vocab, args.d_model).items()
    }
    results = {name: [run(gs, h)] for name, run in runs.items()}  # traced, checked below
    reference = results["fresh buffer"][0]
    for name, (value,) in results.items():
        np.testing.assert_allclose(
            [float(x) for x in value], [float(x) for x in reference], rtol=1e-4, err_msg=name
        )
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(gs, h)[0].numpy()
            times[name].append((time.perf_counter() - start) / args.updates)
    base = statistics.median(times["fresh buffer"])
    rows = []
    for name, t in times.items():
        q = statistics.quantiles([x / base for x in t], n=4) if len(t) > 1 else [t[0] / base] * 3
        median = statistics.median(t)
        rows.append(
            goal_row(name, median / base, None, part="dweight update", variant=name,
                     ms=1e3 * median, q1=q[0], q3=q[2])
        )  # fmt: skip
    return rows


def logits_workspace(args) -> list[dict]:
    """The allocator's peak during one [M, V] logits product beyond its output, per M: the
    least and the most of ``--rounds`` calls (it changes from call to call)."""
    import tensorflow as tf

    weight = tf.random.stateless_normal((args.vocab, args.d_model), seed=(0, 0))
    # one function for every M, traced once (M unknown in the graph; the product's kernel and
    # its workspace are chosen at run time, from the actual M)
    signature = [tf.TensorSpec((None, args.d_model)), tf.TensorSpec(weight.shape)]
    fn = tf.function(
        lambda h, w: tf.raw_ops.BatchMatMulV2(x=h, y=w, adj_y=True)[0, 0],
        input_signature=signature,
    )
    rows = []
    for m in args.logit_rows:
        h = tf.random.stateless_normal((m, args.d_model), seed=(1, m))
        fn(h, weight).numpy()
        output, extras = 4 * m * args.vocab, []
        for _ in range(args.rounds):
            tf.config.experimental.reset_memory_stats("CPU:0")
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            fn(h, weight).numpy()
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            extras.append(max(peak - before - output, 0) / 2**20)
        rows.append(
            goal_row(f"M={m}", None, None, part="logits workspace", rows=m,
                     output_mib=output / 2**20, extra_mib_min=min(extras),
                     extra_mib_max=max(extras))
        )  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=256, help="rows per chunk (C)")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=4, help="chunk updates per timed call")
    parser.add_argument("--logit-rows", type=lambda s: [int(x) for x in s.split(",")],
                        default=[256, 384, 480, 512, 640, 1024])  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()

    updates = update_times(args)
    print(
        f"dweight += g.T @ h per chunk: C={args.chunk}, d={args.d_model}, V={args.vocab}, "
        f"float32, median of {args.rounds} interleaved rounds ({args.updates} updates each); "
        "ratio: over fresh buffer, with its quartiles q1, q3 (no goal: a diagnostic)"
    )
    print_rows(updates, [("ms", ".1f"), ("q1", ".2f"), ("q3", ".2f")])
    workspace = logits_workspace(args)
    print(
        f"logits product h[:M] @ weight.T (V={args.vocab}): allocator peak beyond its output, "
        f"least and most of {args.rounds} calls"
    )
    print_rows(
        workspace, [("output_mib", ".0f"), ("extra_mib_min", ".1f"), ("extra_mib_max", ".1f")]
    )
    write_json(args.json, args, updates + workspace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
