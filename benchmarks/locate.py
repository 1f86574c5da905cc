"""locate_nonfinite vs a plain training step (and torch.autograd.detect_anomaly), per backend.

The network is conformance_tests/locate_models.py (embed -> 2 blocks -> head) at a larger
size; the plain step is forward + loss + gradients (torch: ``loss.backward()``; Keras:
``tf.GradientTape``; JAX: ``jax.jit(jax.value_and_grad)``). ``locate_nonfinite`` runs on the
clean network with the same loss, so it does all its work (no early exit). Medians of
repeated runs, wall and CPU time (``time.process_time``: every thread of this process, so
less disturbed by other processes; with several intra-op threads, as XLA and TensorFlow use,
it sums them); ratios against the plain step measured in the same run. Goal: locate within
3 plain steps. JAX: the instrumented pass is compiled once per model and shapes; its
compile time is reported separately, next to the plain step's. Equinox and Flax NNX: the
same network as their modules, located after every "training step" (new weights, as in a
run: each timed call gets a model with other values), so the rows show that the compiled
pass is reused (its arrays are arguments; before, every call compiled again). ``--json
PATH`` writes the rows (ratio, goal, meets_goal; the ratio is the wall time over the plain
step's).

    python benchmarks/locate.py [--quick] [--backends torch,tensorflow,jax,equinox,nnx]
                                [--repeats N]
                                [--torch-threads N] [--json PATH]

``--torch-threads`` defaults to 1 intra-op thread, as guard.py, check_numerics.py and
``numstab bench`` do, so that their torch timings compare (0: torch's own default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _goals import add_json_option, check_backends, goal_row, print_rows, write_json

from conformance_tests import locate_models as lm
from numstab.locate import locate_nonfinite


def _medians(fns: dict, repeats: int) -> dict:
    """Median wall and CPU (this process) seconds of each function, run round-robin so that
    load on the machine hits every contender alike: label -> (wall, cpu)."""
    times: dict = {label: ([], []) for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[label][0].append(time.perf_counter() - t0)
            times[label][1].append(time.process_time() - c0)
    return {label: tuple(map(statistics.median, ts)) for label, ts in times.items()}


def bench_torch(size: dict, repeats: int) -> dict:
    import torch

    torch.manual_seed(0)
    if args_threads:
        torch.set_num_threads(args_threads)
    model = lm.torch_model(lm.weights(**size["w"]))
    ids = torch.from_numpy(lm.tokens(False, **size["t"]))
    targets = (torch.from_numpy(lm.targets(**size["t"])), 1.0)

    def step():
        model.zero_grad(set_to_none=True)
        lm.torch_loss(model(ids), targets).backward()

    def anomaly_step():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
            with torch.autograd.detect_anomaly(check_nan=True):
                step()

    def locate():
        report = locate_nonfinite(model, ids, loss_fn=lm.torch_loss, targets=targets)
        assert not report.found

    for fn in (step, anomaly_step, locate):
        fn()  # warm-up
    fns = {"plain step": step, "detect_anomaly step": anomaly_step, "locate_nonfinite": locate}
    return _medians(fns, repeats)


def bench_tensorflow(size: dict, repeats: int) -> dict:
    import tensorflow as tf

    model = lm.keras_model(lm.weights(**size["w"]))
    ids = tf.constant(lm.tokens(False, **size["t"]))
    targets = (tf.constant(lm.targets(**size["t"])), 1.0)

    def step():
        with tf.GradientTape() as tape:
            loss = lm.tf_loss(model(ids), targets)
        tape.gradient(loss, model.trainable_variables)

    def locate():
        report = locate_nonfinite(model, ids, loss_fn=lm.tf_loss, targets=targets)
        assert not report.found

    for fn in (step, locate):
        fn()
    return _medians({"plain step": step, "locate_nonfinite": locate}, repeats)


def bench_jax(size: dict, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    model = lm.jax_model(None)
    params = lm.jax_params(lm.weights(**size["w"]))
    ids = jnp.asarray(lm.tokens(False, **size["t"]))
    targets = (jnp.asarray(lm.targets(**size["t"])), 1.0)
    grad = jax.jit(jax.value_and_grad(lambda p: lm.jax_loss(model(p, ids), targets)))

    def step():
        jax.block_until_ready(grad(params))

    def locate():
        report = locate_nonfinite(model, params, ids, loss_fn=lm.jax_loss, targets=targets)
        assert not report.found

    t0, c0 = time.perf_counter(), time.process_time()
    step()
    plain_first = (time.perf_counter() - t0, time.process_time() - c0)
    t0, c0 = time.perf_counter(), time.process_time()
    locate()
    locate_first = (time.perf_counter() - t0, time.process_time() - c0)
    return {
        **_medians({"plain step": step, "locate_nonfinite": locate}, repeats),
        "plain step, first call (compile)": plain_first,
        "locate_nonfinite, first call (compile)": locate_first,
    }


def bench_module_library(library: str, size: dict, repeats: int) -> dict:
    """An Equinox or NNX model: the plain step is the library's jitted value-and-grad; each
    locate call gets the model after one more (scaled-weights) step."""
    import jax
    import jax.numpy as jnp

    ids = jnp.asarray(lm.tokens(False, **size["t"]))
    targets = (jnp.asarray(lm.targets(**size["t"])), 1.0)
    model = getattr(lm, f"{library}_model")(lm.weights(**size["w"]))
    scale = lambda x: x * 0.999 if jnp.issubdtype(getattr(x, "dtype", int), jnp.floating) else x
    if library == "equinox":
        import equinox as eqx

        grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: lm.jax_loss(m(ids), targets)))
        models = [model]
        for _ in range(repeats + 1):
            models.append(jax.tree_util.tree_map(scale, models[-1]))
        stepped = iter(models[1:])
    else:
        from flax import nnx

        grad = nnx.jit(nnx.value_and_grad(lambda m: lm.jax_loss(m(ids), targets)))
        states = iter([nnx.state(model)] * (repeats + 1))

        class Stepped:  # the same module, its values changed in place (as nnx.Optimizer does)
            def __next__(self):
                nnx.update(model, jax.tree_util.tree_map(scale, next(states)))
                return model

        stepped = Stepped()

    def step():
        jax.block_until_ready(grad(model))

    def locate(m=None):
        report = locate_nonfinite(m or next(stepped), ids, loss_fn=lm.jax_loss, targets=targets)
        assert not report.found

    t0, c0 = time.perf_counter(), time.process_time()
    step()
    plain_first = (time.perf_counter() - t0, time.process_time() - c0)
    t0, c0 = time.perf_counter(), time.process_time()
    locate(model)
    locate_first = (time.perf_counter() - t0, time.process_time() - c0)
    return {
        **_medians({"plain step": step, "locate_nonfinite": locate}, repeats),
        "plain step, first call (compile)": plain_first,
        "locate_nonfinite, first call (compile)": locate_first,
    }


GOAL = 3.0  # locate_nonfinite within 3 plain steps (wall)
args_threads = 1  # --torch-threads: intra-op threads (0 = torch's default)

BENCHES = {
    "torch": bench_torch,
    "tensorflow": bench_tensorflow,
    "jax": bench_jax,
    "equinox": lambda size, repeats: bench_module_library("equinox", size, repeats),
    "nnx": lambda size, repeats: bench_module_library("nnx", size, repeats),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--backends", default=",".join(BENCHES), help=", ".join(BENCHES))
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1, as guard.py, check_numerics.py and numstab "
        "bench use; 0: torch's own default)",
    )
    parser.add_argument("--repeats", type=int, default=0, help="runs per median (0: 5 / 20)")
    add_json_option(parser)
    args = parser.parse_args()
    backends = check_backends(parser, args.backends, list(BENCHES))
    global args_threads
    args_threads = args.torch_threads
    if args.quick:
        size = {"w": {"vocab": 64, "dim": 32, "hidden": 64}, "t": {"batch": 4, "seq": 16}}
        repeats = 5
    else:
        size = {"w": {"vocab": 512, "dim": 128, "hidden": 512}, "t": {"batch": 8, "seq": 64}}
        repeats = 20
    repeats = args.repeats or repeats
    size["t"]["vocab"] = size["w"]["vocab"]
    print(f"network: {size['w']} x 2 blocks, batch {size['t']}; median of {repeats}")
    rows = []
    for name in backends:
        times = BENCHES[name](size, repeats)
        plain, plain_cpu = times["plain step"]
        for label, (wall, cpu) in times.items():
            goal = GOAL if label == "locate_nonfinite" else None  # the others: for context
            rows.append(
                goal_row(
                    f"{name}: {label}",
                    wall / plain,
                    goal,
                    wall_ms=wall * 1e3,
                    cpu_ms=cpu * 1e3,
                    cpu_ratio=cpu / plain_cpu,
                )
            )
    print_rows(rows, [("wall_ms", ".2f"), ("cpu_ms", ".2f"), ("cpu_ratio", ".2f")])
    print("ratio: wall time over the plain step's; cpu_ratio (less sensitive to load): CPU time")
    write_json(args.json, args, rows)


if __name__ == "__main__":
    main()
