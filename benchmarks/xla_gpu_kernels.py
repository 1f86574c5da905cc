"""Kernels per step of the JAX guard benchmark's programs as XLA:GPU compiles them, without a GPU.

What is measured
----------------
``benchmarks/guard.py``'s JAX programs (the ``--quick`` 4x256 MLP with Adam, or the sizes
given) lowered for a compile-only GPU device: JAX's CUDA plugin compiles for a target
description (``gpu_device_info`` of an H200 in ``benchmarks/_xla_gpu.py``, from XLA's
``xla/backends/gpu/target_config/specs/h200.txtpb``) with no GPU and no driver present.
Each program's entry computation is counted by ``benchmarks/_hlo.py``: on a GPU every fusion
(GEMMs included) and copy there is one kernel launch. On a small step, launches are most of
the time: the H200 run of 2026-12-04 measured the bare step (34 kernels here) at 0.53 ms.

Programs: the bare step; the floor any skip-capable guard pays (gradient norms + a select of
every leaf on a finite global norm); the guarded step (``guarded_step``) with the guard state
as 11 arrays (``policy.GuardState``) and packed in 2 (``PackedGuardState``, the default on an
accelerator); and ``policy.decide`` alone. Printed: kernels, and kernels over the floor's
(``ratio``: kernels / the floor's, for the bare and guarded steps; None for the rest).
No goal: counts, not times, so every row prints ``-`` for its goal and carries ``goal`` and
``meets_goal`` None (``guard.py`` judges the time they cost).
``--keras``: also the Keras guard's device-mode step on Keras' JAX backend (its check and
Keras' train step in one jit) with either form of the state.
Counts, not times: a GPU run of ``benchmarks/guard.py --device gpu`` times them.

Needs JAX's CUDA plugin, installed apart (``benchmarks/_xla_gpu.py`` says how), then:

    JAX_PLATFORMS=cpu PYTHONPATH=/tmp/jax-cuda python benchmarks/xla_gpu_kernels.py [--json PATH]

``--platform cpu`` counts the same programs as XLA:CPU compiles them (no plugin needed).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _hlo, guard, _goals
from _goals import dump_json, goal_row

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

FLOOR = "floor: norms + skip select"


def kernel_counts(args: argparse.Namespace) -> dict:
    """Program name -> opcode counts of its entry computation, compiled for the device."""
    import jax
    import jax.numpy as jnp
    from _hlo import entry_ops
    from _xla_gpu import abstract, compile_only_device
    from guard import jax_programs

    from numstab.backends import load_backend
    from numstab.frameworks.jax.guard_state import PackedGuardState
    from numstab.guard import TrainingGuard, policy

    device = compile_only_device(args.platform)

    def spec(tree):
        return abstract(tree, device)

    programs = jax_programs(args, jax.devices("cpu")[0])
    guard = TrainingGuard(snapshot_every=args.snapshot_every, host_every=args.host_every)
    params, opt_state = spec(programs.params0), spec(programs.tx.init(programs.params0))
    x, y = spec(programs.batches[0])
    state = policy.init_state(guard, load_backend("jax"))
    decide = jax.jit(lambda s, loss, norm: policy.decide(guard, load_backend("jax"), s, loss, norm))
    scalar = spec(jnp.float32(0))
    lowered = {
        "plain step": programs.plain_step.lower(params, opt_state, x, y),
        FLOOR: programs.norms_step.lower(True, params, opt_state, x, y),
        "guarded step, 11-array state": programs.guard_step.lower(
            guard, params, opt_state, spec(state), x, y
        ),
        "guarded step, packed state": programs.guard_step.lower(
            guard, params, opt_state, spec(PackedGuardState.pack(state)), x, y
        ),
        "policy.decide alone": decide.lower(spec(state), scalar, scalar),
    }
    return {name: entry_ops(low.compile().as_text()) for name, low in lowered.items()}


def keras_counts(args: argparse.Namespace) -> dict:
    """The Keras guard's device mode on Keras' JAX backend: the jitted step that runs the
    check and Keras' train step in one (``guard_arrays.ArrayGuardCallback._fused_step``),
    with the guard state as 11 arrays and packed, compiled for the device. Its arguments
    are captured from a short ``fit`` on the CPU."""
    import keras
    import numpy as np
    from _hlo import entry_ops
    from _xla_gpu import abstract, compile_only_device

    from numstab.guard import TrainingGuard

    device = compile_only_device(args.platform)
    x = np.random.default_rng(0).standard_normal((args.batch * 4, 32)).astype("float32")
    counts = {}
    for packed in (False, True):
        keras.utils.set_random_seed(0)
        hidden = [keras.layers.Dense(args.width, activation="tanh") for _ in range(args.layers)]
        model = keras.Sequential([keras.Input((32,)), *hidden, keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        cb = TrainingGuard(host_every=args.host_every).keras_callback()
        cb.pack_state = packed
        seen: list = []
        capture = _first_fused_call(keras, cb, seen)
        model.fit(x, x[:, :1], batch_size=args.batch, verbose=0, callbacks=[cb, capture])
        if not seen:
            sys.exit("the Keras guard ran no fused step (steps_per_execution, run_eagerly?)")
        specs = abstract(seen[0], device)
        form = "packed state" if packed else "11-array state"
        text = cb._fused_for[1].lower(*specs).compile().as_text()
        counts[f"keras (jax) guarded step, {form}"] = entry_ops(text)
    return counts


def _first_fused_call(keras, cb, seen: list):
    """A callback, placed after the guard's, that appends the arguments of the guard's first
    fused step to ``seen`` (the step exists once the guard's ``on_train_begin`` ran)."""

    class Capture(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and cb._fused is not None:
                fused = cb._fused
                cb._fused = lambda *a: seen.append(a) or fused(*a)

    return Capture()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--snapshot-every", type=int, default=100)
    parser.add_argument("--host-every", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument(
        "--keras", action="store_true", help="also the Keras guard's step on Keras' JAX backend"
    )
    args = parser.parse_args()
    counts = kernel_counts(args)
    if args.keras:
        os.environ["KERAS_BACKEND"] = "jax"  # before keras is imported
        counts.update(keras_counts(args))
    target = "an H200 (compile-only)" if args.platform == "gpu" else "XLA:CPU"
    print(f"MLP {args.layers}x{args.width}, batch {args.batch}, Adam; compiled for {target}")
    rows = kernel_rows(counts)
    for row in rows:
        extra = ""
        if row["ratio"] is not None:
            extra = (
                f"  ({row['kernels'] - row['floor']:+d} over the floor, ratio {row['ratio']:.3f})"
            )
        print(f"  {row['program']:<42} {row['kernels']:4d} kernels{extra}  goal -  {row['ops']}")
    dump_json(args.json, {"platform": args.platform, "rows": rows})


def kernel_rows(counts: dict) -> list[dict]:
    """One row per program (name -> opcode counts): its kernels, the floor's, and ``ratio``
    = kernels / the floor's where the floor is its own (the bare and guarded steps; None for
    ``policy.decide`` and the Keras steps, whose floor would be Keras'). No goal: counts."""
    floor = sum(counts[FLOOR].values())
    rows = []
    for name, ops in counts.items():
        kernels = sum(ops.values())
        compared = not name.startswith(("policy", "keras"))  # the floor is optax's
        ops = dict(ops.most_common())
        row = goal_row(name, kernels / floor if compared else None, None, program=name)
        rows.append(row | {"kernels": kernels, "ops": ops, "floor": floor})
    return rows


if __name__ == "__main__":
    main()
