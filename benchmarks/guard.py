"""Step time of a training loop with numstab's TrainingGuard against the same loop without it.

What is measured
----------------
One training step of an MLP (``--layers`` Linear layers of ``--width``, tanh, batch
``--batch``, MSE, Adam):

* torch: ``zero_grad; loss.backward(); optimizer.step()`` against ``zero_grad;
  loss.backward(); guard.step(loss)`` (per-parameter norms in one ``_foreach_norm``, one host
  read of loss and norm, the decision on the host, ``optimizer.step()``, the history).
* jax: a jitted ``value_and_grad`` + ``tx.update`` +
  ``apply_updates`` against the jitted ``guarded_step`` (norms and decision inside jit,
  ``lax.cond``) followed by ``after_step`` on the host (one ``device_get`` per step).

* keras: ``model.fit`` (TensorFlow backend) with and without ``guard.keras_callback()``.

Both sides use snapshots every ``--snapshot-every`` good steps (default 100; memory only), so
their cost is amortised as in a real run. No NaN is injected: this is the price of the guard
on healthy steps.

How
---
Before timing, a short run checks that the guarded loop ends with the same parameters as the
plain one (every step applied; bit-identical for torch, allclose for jax), so a guard that
silently skips cannot look fast. Then rounds alternate AB / BA; each round times ``--steps``
consecutive steps of each loop (with a device sync at the end); warmup rounds are not timed.
Reported: median milliseconds per step, and ratio = guarded / plain (goal <= 1.05), and the
device-to-host reads per step of each loop, counted outside the timed rounds
(``_host_reads``: the CPU stand-in for ``torch.cuda.set_sync_debug_mode``; goal: no read
beyond the plain loop's). Timings are printed, not asserted.

Usage: python benchmarks/guard.py [--quick] [--backends torch,jax,keras] [--threads 1]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _host_reads
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GOAL = 1.05  # guarded / plain step time; and no host read beyond the plain loop's


def torch_case(args: argparse.Namespace) -> dict:
    import torch

    from numstab.guard import TrainingGuard

    torch.set_num_threads(args.threads)

    def make():
        torch.manual_seed(0)
        layers = []
        for i in range(args.layers):
            layers.append(torch.nn.Linear(args.width if i else 32, args.width))
            layers.append(torch.nn.Tanh())
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    x = torch.randn(args.batch, 32, generator=torch.Generator().manual_seed(1))
    y = torch.randn(args.batch, 1, generator=torch.Generator().manual_seed(2))
    guard = TrainingGuard(snapshot_every=args.snapshot_every)

    def loop(model, opt, tg):
        def run(n):
            for _ in range(n):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                if tg is None:
                    opt.step()
                else:
                    tg.step(loss)

        return run

    plain_model, plain_opt = make()
    guard_model, guard_opt = make()
    plain = loop(plain_model, plain_opt, None)
    guarded = loop(guard_model, guard_opt, guard.for_torch(guard_model, guard_opt))
    plain(20)
    guarded(20)
    for a, b in zip(plain_model.parameters(), guard_model.parameters(), strict=True):
        assert torch.equal(a, b), "the guarded loop diverged from the plain one"
    return _measure("torch", plain, guarded, args, lambda: None)


def jax_case(args: argparse.Namespace) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from numstab.frameworks.jax.guard import guarded_step
    from numstab.guard import TrainingGuard

    keys = jax.random.split(jax.random.PRNGKey(0), args.layers + 1)
    sizes = [32] + [args.width] * args.layers + [1]
    params0 = [
        {"w": jax.random.normal(k, (i, o)) / np.sqrt(i), "b": jnp.zeros(o)}
        for k, i, o in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
    x = jax.random.normal(jax.random.PRNGKey(1), (args.batch, 32))
    y = jax.random.normal(jax.random.PRNGKey(2), (args.batch, 1))
    tx = optax.adam(1e-3)

    def loss_fn(params):
        h = x
        for layer in params[:-1]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h @ params[-1]["w"] + params[-1]["b"] - y) ** 2)

    @jax.jit
    def plain_step(params, opt_state):
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    guard = TrainingGuard(snapshot_every=args.snapshot_every)

    @functools.partial(jax.jit, static_argnums=0)
    def guard_step(guard, params, opt_state, gstate):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return guarded_step(guard, tx, params, opt_state, gstate, loss, grads)

    og = guard.for_optax()
    state = {"plain": (params0, tx.init(params0))}
    state["guard"] = (params0, tx.init(params0), og.init(params0, tx.init(params0)))

    def plain(n):
        p, o = state["plain"]
        for _ in range(n):
            p, o = plain_step(p, o)
        state["plain"] = (p, o)

    def guarded(n):
        p, o, g = state["guard"]
        for _ in range(n):
            p, o, g, d = guard_step(guard, p, o, g)
            p, o, g = og.after_step(d, p, o, g)
        state["guard"] = (p, o, g)

    plain(20)
    guarded(20)
    for a, b in zip(*(jax.tree.leaves(state[k][0]) for k in ("plain", "guard")), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def sync():
        jax.block_until_ready((state["plain"], state["guard"]))

    return _measure("jax", plain, guarded, args, sync)


def keras_case(args: argparse.Namespace) -> dict:
    """Keras 3 (TensorFlow backend) ``model.fit`` with and without ``guard.keras_callback()``.
    One round is one ``fit`` call over ``--steps`` batches."""
    import keras
    import numpy as np

    from numstab.guard import TrainingGuard

    rng = np.random.default_rng(1)
    x = rng.normal(size=(args.batch * args.steps, 32)).astype(np.float32)
    y = rng.normal(size=(args.batch * args.steps, 1)).astype(np.float32)

    def make():
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(args.width, activation="tanh") for _ in range(args.layers)]
        model = keras.Sequential([keras.Input((32,)), *layers, keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        return model

    plain_model, guard_model = make(), make()
    callback = TrainingGuard(snapshot_every=args.snapshot_every).keras_callback()

    def loop(model, callbacks):
        def run(n):
            for _ in range(max(1, n // args.steps)):
                model.fit(
                    x, y, batch_size=args.batch, shuffle=False, verbose=0, callbacks=callbacks
                )

        return run

    plain, guarded = loop(plain_model, []), loop(guard_model, [callback])
    plain(args.steps)
    guarded(args.steps)
    for a, b in zip(plain_model.get_weights(), guard_model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return _measure("tensorflow", plain, guarded, args, lambda: None)


def _measure(framework: str, plain, guarded, args, sync) -> dict:
    """Median step times (interleaved rounds) and host reads per step of both loops."""
    from _host_reads import counting

    row = _time(plain, guarded, args, sync)
    for name, fn in (("plain", plain), ("guard", guarded)):
        with counting(framework) as reads:
            fn(args.steps)
            sync()
        row[f"{name}_host_reads_per_step"] = reads.count / args.steps
    extra = row["guard_host_reads_per_step"] - row["plain_host_reads_per_step"]
    row["extra_host_reads_per_step"] = extra
    row["goal"] = GOAL
    row["meets_goal"] = row["ratio"] <= GOAL and extra <= 0
    return row


def _time(plain, guarded, args, sync) -> dict:
    times = {"plain": [], "guard": []}
    for r in range(args.warmup + args.repeats):
        order = (("plain", plain), ("guard", guarded))
        for name, fn in order if r % 2 == 0 else order[::-1]:
            gc.disable()
            t = time.perf_counter()
            fn(args.steps)
            sync()
            elapsed = time.perf_counter() - t
            gc.enable()
            if r >= args.warmup:
                times[name].append(1e3 * elapsed / args.steps)
    plain_ms = statistics.median(times["plain"])
    guard_ms = statistics.median(times["guard"])
    return {"plain_ms": plain_ms, "guard_ms": guard_ms, "ratio": guard_ms / plain_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backends", default="torch,jax,keras", help=", ".join(CASES))
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--snapshot-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a small model, few rounds")
    args = parser.parse_args()
    unknown = set(args.backends.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(CASES)}")
    if args.quick:
        args.width, args.layers, args.batch = 256, 4, 64
        args.steps, args.repeats, args.warmup = 20, 5, 1
    print(
        f"MLP {args.layers}x{args.width}, batch {args.batch}, Adam; {args.steps} steps per "
        f"round, median of {args.repeats} rounds; torch threads {args.threads}"
    )
    rows = []
    for name in args.backends.split(","):
        r = {"backend": name.strip(), **CASES[name.strip()](args)}
        print(
            f"{name:>10}: plain {r['plain_ms']:.3f} ms/step, guarded {r['guard_ms']:.3f} ms/step,"
            f" ratio {r['ratio']:.3f} (goal {GOAL}); host reads per step: plain "
            f"{r['plain_host_reads_per_step']:.2f}, guarded {r['guard_host_reads_per_step']:.2f}"
            f" (goal: no extra) -> {'meets' if r['meets_goal'] else 'MISSES'} goal"
        )
        rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


CASES = {"torch": torch_case, "jax": jax_case, "keras": keras_case}

if __name__ == "__main__":
    main()
