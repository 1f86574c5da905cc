"""Step time of a training loop with numstab's TrainingGuard against the same loop without it.

What is measured
----------------
One training step of an MLP (``--layers`` Linear layers of ``--width``, tanh, batch
``--batch``, MSE, Adam), each guard in two modes: ``host`` (``host_every=1``, the default:
the decision read on the host every step) and ``device`` (``host_every=--host-every``: the
steady step stays on the device, the host reads every k steps; docs/semantics.md §16.12).

* torch: ``zero_grad; loss.backward(); optimizer.step()`` against ``zero_grad;
  loss.backward(); guard.step(loss)``. Device mode with the default Adam (the step is undone
  on the device: backup + ``where``) and with ``fused=True`` Adam (``found_inf``: against a
  plain fused-Adam loop). Floors, in the plain loop, the work any guard of that kind must
  do besides deciding: the gradient norms + ``found_inf`` (against plain fused Adam), and the
  norms + backup + undo (``_foreach_copy_`` before the step, the guard's compiled ``where``
  after it); and each part alone.
* jax: a jitted ``value_and_grad`` + ``tx.update`` + ``apply_updates`` against the jitted
  ``guarded_step`` (norms and decision inside jit, a select) followed by ``after_step``
  on the host (host mode: one ``device_get`` per step; device mode: none). Floors: the
  plain jitted step also computing the gradient norms (``norms alone``), and also keeping
  params and optimizer state only where the global norm is finite (``norms + skip
  select``: a ``where`` per leaf, so every leaf's update waits for a reduction over all the
  gradients, as in any guard that can skip a step; the device mode's floor). The row
  ``floor gap`` is the device mode over the ``norms + skip select`` floor, per round. The
  device mode keeps the guard state in the form ``OptaxGuard.init`` picks for the device
  (packed in two arrays on a GPU, 11 arrays on a CPU), and runs once more in the other form
  (its own rows). Then the compiled programs' kernels are counted (``benchmarks/_hlo.py``;
  ``benchmarks/xla_gpu_kernels.py`` counts them for a GPU without one).
* keras: ``model.fit`` (TensorFlow backend; another with ``KERAS_BACKEND=jax`` or ``torch``)
  with and without ``guard.keras_callback()``. Floors (TensorFlow), in one ``tf.function``:
  the undo copy of the state and the update norms alone; and with the gate any guard that
  can undo must pay, a ``tf.cond`` on isfinite(global update norm) whose branch restores
  the copy (each called as its concrete function, as the guard's). On JAX, in the guard's
  form there (one ``jax.jit`` with Keras' train step, ``model.train_function`` wrapped):
  the update norms, a ``where`` per variable on their global norm being finite, and the
  undo copy; on torch, the same as one inductor-compiled call at each batch's start,
  writing in place, as the guard's. ``floor gap``: the device mode over the gated floor,
  per round.

Snapshots every ``--snapshot-every`` good steps (default 100; memory only), so their cost is
amortised as in a real run. No NaN is injected: this is the price of the guard on healthy
steps. ``--device gpu`` runs torch on CUDA and JAX on its GPU (Keras stays where its backend
puts it); there torch's host syncs are also counted as the GPU reports them
(``torch.cuda.set_sync_debug_mode("warn")``: the C++ ones too), and the goal holds for both
counts. Every framework's loops cycle through the same 128 batches of a noisy teacher
(``teacher_batches``): a single fixed batch (or random targets) is memorised to a loss of
~1e-13 within a few hundred steps, where its wobbles read as loss spikes, and the guard then
skips steps and rolls back (measured: 49 skips and 2 rollbacks in 1500 torch steps), which is
not the healthy step this benchmark times. The run fails if a guard rolled back and reports
the steps its detectors skipped (``guard_skipped_steps`` in the JSON rows).

How
---
Before timing, a short run checks that each guarded loop ends with the same parameters as
the plain one (every step applied; bit-identical for torch, allclose for jax and Keras), so a
guard that silently skips cannot look fast. Every loop then runs 128 + k steps (past the
spike windows' first fill and a read). Each round times ``--steps`` consecutive steps of
every loop, in an order that rotates from round to round (with a device sync after each);
warmup rounds are not timed. Reported: median milliseconds per step; ratio = the median over
rounds of guarded / base in the same round, with its quartiles (goal <= 1.05; a floor row
is a reference: it prints no goal, and its ``goal`` and ``meets_goal`` are None in the
JSON, which is rewritten after each backend); and the device-to-host reads of each loop
(``_host_reads``: the CPU stand-in for ``torch.cuda.set_sync_debug_mode``) over k steps:
per steady step (the median step) and amortised. Goal: no read beyond the base loop's on a
steady step. Timings are printed, not asserted.

Usage: python benchmarks/guard.py [--quick] [--backends torch,jax,keras] [--threads 1]
       [--host-every K] [--device cpu|gpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _host_reads, _goals
from _goals import check_backends, goal_row, ratio_text, write_json

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GOAL = 1.05  # guarded / plain step time; and no host read beyond the plain loop's


_START = time.perf_counter()


def progress(message: str) -> None:
    """A timestamped line on stderr: where a run that hit its time limit had got to."""
    print(f"   [{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


POOL = 128  # batches of the teacher, cycled: 4000 steps of the 4x256 MLP stay healthy


def teacher_batches(batch: int, pool: int = POOL, seed: int = 1) -> tuple:
    """``pool`` batches ``(x [pool, batch, 32], y [pool, batch, 1])`` (float32 NumPy) of a
    noisy teacher, ``y = sin(3 x.t) + 0.5 noise``: the loss levels off near the noise's 0.25,
    so the steps stay healthy (see the module docstring)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((pool, batch, 32), dtype=np.float32)
    teacher = rng.standard_normal((32, 1), dtype=np.float32) / np.sqrt(32)
    noise = rng.standard_normal((pool, batch, 1), dtype=np.float32)
    return xs, (np.sin(3 * xs @ teacher) + 0.5 * noise).astype(np.float32)


def healthy(framework: str, runners: dict, rows: list[dict], pairs: list) -> None:
    """Fail if a guard rolled back (its timed steps were not healthy ones); print the steps
    its detectors skipped and put them in the rows (``runners``: loop name -> (GuardRunner,
    steps taken); a skipped step does the work of an applied one, or less)."""
    for name, (runner, steps) in runners.items():
        if runner.rollbacks:
            bad = [e for e in runner.log.events if e["event"] != "snapshot"]
            raise RuntimeError(f"{framework} {name}: the guard rolled back: {bad[:4]}")
        print(f"   {framework} {name}: the detectors skipped {runner.skipped} of {steps} steps")
    for (*_, name), row in zip(pairs, rows, strict=True):
        if name in runners:
            row["guard_skipped_steps"] = runners[name][0].skipped


def torch_case(args: argparse.Namespace) -> list[dict]:
    """Rows: the host mode and the device mode (generic undo) with default Adam, the device
    mode with fused Adam (found_inf) against a plain fused-Adam loop, and the floors: the
    work any guard of a kind must do besides deciding, on the guard's own primitives (norms:
    ``layer_norms``; undo: ``_foreach_copy_`` before the step, the compiled select after).
    ``norms + found_inf`` is the fused row's floor, ``norms + backup + undo`` the undo
    row's; ``gradient norms alone`` and ``backup + undo alone`` are their parts."""
    import torch

    from numstab.backends import load_backend
    from numstab.frameworks.torch.guard_compiled import undo_plan
    from numstab.frameworks.torch.guard_device import undo_elsewhere
    from numstab.guard import TrainingGuard
    from numstab.guard.monitor import layer_norms

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "gpu" else "cpu")

    def make(fused=False):
        torch.manual_seed(0)
        layers = []
        for i in range(args.layers):
            layers.append(torch.nn.Linear(args.width if i else 32, args.width))
            layers.append(torch.nn.Tanh())
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)

    xs, ys = teacher_batches(args.batch)
    batches = [
        (torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
        for x, y in zip(xs, ys, strict=True)
    ]
    be = load_backend("torch")

    def loop(fused=False, host_every=None, extra=None):
        model, opt = make(fused)
        guard = (
            None
            if host_every is None
            else TrainingGuard(snapshot_every=args.snapshot_every, host_every=host_every)
        )
        tg = guard.for_torch(model, opt) if guard is not None else None
        params = list(model.parameters())
        taken = [0]  # steps so far: every loop sees the same batches in the same order

        def run(n, tick=None):
            for i in range(taken[0], taken[0] + n):
                x, y = batches[i % POOL]
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                if tg is None:
                    after = extra(loss, params, opt) if extra is not None else None
                    opt.step()
                    if callable(after):  # the undo floors' select, after the step
                        after()
                else:
                    tg.step(loss)
                if tick is not None:
                    tick()
            taken[0] += n

        run.model, run.guard, run.taken = model, tg, taken
        return run

    def norms_only(loss, params, opt):  # the floor: the gradient norms the guard needs
        with torch.no_grad():
            return layer_norms(be, [p.grad for p in params])[1]

    def norms_found_inf(loss, params, opt):  # + the flag any found_inf guard hands the step
        opt.found_inf = (~torch.isfinite(norms_only(loss, params, opt))).float()

    plans = {}

    def copy_only(loss, params, opt, flag=None):  # the floor of the undo path: backup, select
        with torch.no_grad():
            tensors = params + [t for p in params for t in opt.state[p].values()]
            flag = loss.isfinite() if flag is None else flag
            if len(plans.get(id(opt), ((),))[0]) != len(tensors):
                buffers = [torch.empty_like(t) for t in tensors]
                here = [i for i, t in enumerate(tensors) if t.device == flag.device]
                pick = lambda xs: [xs[i] for i in here]
                elsewhere = [(t, b) for t, b in zip(tensors, buffers, strict=True)
                             if t.device != flag.device]  # fmt: skip
                plans[id(opt)] = (buffers, undo_plan(flag, pick(tensors), pick(buffers)), elsewhere)
            buffers, plan, elsewhere = plans[id(opt)]
            torch._foreach_copy_(buffers, tensors)

        def select():  # after the step: the guard's compiled where; Adam's CPU step counts
            with torch.no_grad():  # (no capturable=True) as the guard does: one flag copy
                plan(flag)
                undo_elsewhere(flag, elsewhere)

        return select

    def norms_copy(loss, params, opt):  # the gradient norms + backup and select
        return copy_only(loss, params, opt, torch.isfinite(norms_only(loss, params, opt)))

    k = args.host_every
    loops = {
        "plain": loop(),
        "host": loop(host_every=1),
        "device": loop(host_every=k),
        "floor:norms": loop(extra=norms_only),
        "floor:undo": loop(extra=copy_only),
        "floor:norms+undo": loop(extra=norms_copy),
        "plain_fused": loop(fused=True),
        "device_fused": loop(fused=True, host_every=k),
        "floor:norms+found_inf": loop(fused=True, extra=norms_found_inf),
    }
    for name, fn in loops.items():
        fn(20)
        progress(f"torch {name}: first 20 steps (compiles included)")
    for base, other in (("plain", "host"), ("plain", "device"), ("plain_fused", "device_fused")):
        for a, b in zip(
            loops[base].model.parameters(), loops[other].model.parameters(), strict=True
        ):
            assert torch.equal(a, b), f"the {other} loop diverged from the {base} one"
    pairs = [
        ("torch", "host", "plain", "host"),
        ("torch", f"device (host_every={k}, undo)", "plain", "device"),
        ("torch", f"device (host_every={k}, fused Adam)", "plain_fused", "device_fused"),
        ("torch", "floor: gradient norms alone", "plain", "floor:norms"),
        ("torch", "floor: backup + undo alone", "plain", "floor:undo"),
        ("torch", "floor: norms + backup + undo", "plain", "floor:norms+undo"),
        ("torch", "floor: norms + found_inf (fused)", "plain_fused", "floor:norms+found_inf"),
    ]
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    rows = _measure("torch", loops, pairs, args, sync)
    runners = {}
    for name, run in loops.items():
        if run.guard is not None:
            run.guard.flush()
            runners[name] = (run.guard.runner, run.taken[0])
    healthy("torch", runners, rows, pairs)
    return rows


def jax_programs(args: argparse.Namespace, device) -> types.SimpleNamespace:
    """The JAX case's model, batches (on ``device``) and jitted steps: ``plain_step``,
    ``guard_step`` (static guard) and ``norms_step`` (static skip: the floors); shared with
    ``benchmarks/xla_gpu_kernels.py``, which compiles them for a GPU it does not have."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from numstab.frameworks.jax.guard import guarded_step

    keys = jax.random.split(jax.random.PRNGKey(0), args.layers + 1)
    sizes = [32] + [args.width] * args.layers + [1]
    params0 = jax.device_put(
        [
            {"w": jax.random.normal(k, (i, o)) / np.sqrt(i), "b": jnp.zeros(o)}
            for k, i, o in zip(keys, sizes[:-1], sizes[1:], strict=True)
        ],
        device,
    )
    xs, ys = teacher_batches(args.batch)
    batches = [jax.device_put((x, y), device) for x, y in zip(xs, ys, strict=True)]
    tx = optax.adam(1e-3)

    def loss_fn(params, x, y):
        h = x
        for layer in params[:-1]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h @ params[-1]["w"] + params[-1]["b"] - y) ** 2)

    @jax.jit
    def plain_step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @functools.partial(jax.jit, static_argnums=0)
    def guard_step(guard, params, opt_state, gstate, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return guarded_step(guard, tx, params, opt_state, gstate, loss, grads)

    @functools.partial(jax.jit, static_argnums=0)
    def norms_step(skip, params, opt_state, x, y):  # the floors: plain step + guard's norms
        grads = jax.grad(loss_fn)(params, x, y)
        norms = jnp.stack([jnp.linalg.norm(g) for g in jax.tree.leaves(grads)])
        total = jnp.linalg.norm(norms)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if not skip:
            return new_params, new_opt, total
        # + the select any guard that can skip a step needs: every leaf's update waits for
        # a verdict on all the gradients (here the cheapest one: a finite global norm)
        ok = jnp.isfinite(total)
        pick = functools.partial(jnp.where, ok)
        return jax.tree.map(pick, new_params, params), jax.tree.map(pick, new_opt, opt_state), total

    return types.SimpleNamespace(
        params0=params0,
        batches=batches,
        tx=tx,
        plain_step=plain_step,
        guard_step=guard_step,
        norms_step=norms_step,
    )


def jax_case(args: argparse.Namespace) -> list[dict]:
    import jax
    import numpy as np
    from _hlo import entry_ops, summary

    from numstab.frameworks.jax.guard_state import on_accelerator
    from numstab.guard import TrainingGuard

    device = jax.devices(args.device)[0]  # committed inputs: every jit runs there
    programs = jax_programs(args, device)
    params0, batches, tx = programs.params0, programs.batches, programs.tx
    plain_step, guard_step, norms_step = (
        programs.plain_step,
        programs.guard_step,
        programs.norms_step,
    )

    # name -> [params, opt_state, (guard state,) steps taken]: every loop sees the same batches
    state = {k: [params0, tx.init(params0), 0] for k in ("plain", "floor", "floor_skip")}

    def plain(n, tick=None):
        p, o, start = state["plain"]
        for i in range(start, start + n):
            p, o = plain_step(p, o, *batches[i % POOL])
            if tick is not None:
                tick()
        state["plain"] = [p, o, start + n]

    def floor_loop(name, skip):
        def run(n, tick=None):
            p, o, start = state[name]
            for i in range(start, start + n):
                p, o, _ = norms_step(skip, p, o, *batches[i % POOL])
                if tick is not None:
                    tick()
            state[name] = [p, o, start + n]

        return run

    guards, training_guards = {}, {}

    def guarded_loop(name, host_every, packed=None):
        guard = TrainingGuard(snapshot_every=args.snapshot_every, host_every=host_every)
        training_guards[name] = guard
        og = guards[name] = guard.for_optax()
        gstate = og.init(params0, tx.init(params0), packed=packed)
        state[name] = [params0, tx.init(params0), gstate, 0]

        def run(n, tick=None):
            p, o, g, start = state[name]
            for i in range(start, start + n):
                p, o, g, d = guard_step(guard, p, o, g, *batches[i % POOL])
                p, o, g = og.after_step(d, p, o, g)
                if tick is not None:
                    tick()
            state[name] = [p, o, g, start + n]

        return run

    # the guard state in the form OptaxGuard.init picks for this device (packed on a GPU),
    # and in the other form, measured beside it (guard_state.py)
    packed = on_accelerator(params0)
    forms = {True: "packed state", False: "11-array state"}
    loops = {
        "plain": plain,
        "host": guarded_loop("host", 1),
        "device": guarded_loop("device", args.host_every),
        "device_other": guarded_loop("device_other", args.host_every, packed=not packed),
        "floor": floor_loop("floor", False),
        "floor_skip": floor_loop("floor_skip", True),
    }
    for name, fn in loops.items():
        fn(20)
        progress(f"jax {name}: first 20 steps (compiles included)")
    for name in ("host", "device", "device_other", "floor", "floor_skip"):
        for a, b in zip(*(jax.tree.leaves(state[k][0]) for k in ("plain", name)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def sync():
        jax.block_until_ready([s[:-1] for s in state.values()])

    pairs = [
        ("jax", "host", "plain", "host"),
        ("jax", f"device (host_every={args.host_every}, {forms[packed]})", "plain", "device"),
        ("jax", f"device, {forms[not packed]} (not the default here)", "plain", "device_other"),
        ("jax", "floor: gradient norms alone", "plain", "floor"),
        ("jax", "floor: norms + skip select", "plain", "floor_skip"),
        # the device mode against its own floor, round by round: what the guard adds
        ("jax", "floor gap: device / skip floor", "floor_skip", "device"),
        ("jax", f"floor gap: device, {forms[not packed]}", "floor_skip", "device_other"),
    ]
    rows = _measure("jax", loops, pairs, args, sync)
    runners = {}
    for name, og in guards.items():
        p, o, g, steps = state[name]
        og.flush(p, o, g)
        runners[name] = (og.runner, steps)
    healthy("jax", runners, rows, pairs)  # a skipped step: the same work (a select)
    x, y = batches[0]
    p, o, g, _ = state["device"]
    other = state["device_other"][2]
    lowered = {
        "plain": plain_step.lower(p, o, x, y),
        "floor: norms + skip select": norms_step.lower(True, p, o, x, y),
        f"device mode, {forms[packed]}": guard_step.lower(training_guards["device"], p, o, g, x, y),
        f"device mode, {forms[not packed]}": guard_step.lower(
            training_guards["device"], p, o, other, x, y
        ),
    }
    ops = {name: entry_ops(program.compile().as_text()) for name, program in lowered.items()}
    for name, counts in ops.items():  # on a GPU each one is a kernel launch (benchmarks/_hlo)
        print(f"   jax compiled step, {name}: {summary(counts)}")
    for row in rows:
        row["entry_ops"] = {name: dict(counts) for name, counts in ops.items()}
    return rows


def keras_case(args: argparse.Namespace) -> list[dict]:
    """Keras 3 ``model.fit`` with and without ``guard.keras_callback()``, per batch (host mode)
    and with ``host_every`` (device mode), on the Keras backend of ``KERAS_BACKEND``
    (TensorFlow by default; floor rows on each). One round is one ``fit`` call
    over ``--steps`` batches."""
    import keras
    import numpy as np

    backend = keras.backend.backend()
    name = "keras" if backend == "tensorflow" else f"keras ({backend})"

    from numstab.guard import TrainingGuard

    # one fit() takes --steps consecutive batches of the pool, the next fit the next ones
    fits = max(POOL // args.steps, 1)
    xs, ys = teacher_batches(args.batch, fits * args.steps)
    data = [
        (xs[j * args.steps : (j + 1) * args.steps].reshape(-1, 32),
         ys[j * args.steps : (j + 1) * args.steps].reshape(-1, 1))
        for j in range(fits)
    ]  # fmt: skip

    class Tick(keras.callbacks.Callback):
        def __init__(self, tick):
            super().__init__()
            self.tick = tick

        def on_train_batch_end(self, batch, logs=None):
            self.tick()

    class Floor(keras.callbacks.Callback):
        """The floor of the device mode: the undo copy and the update norms alone; with
        ``gate``, also the undo any guard that can skip must branch to: ``tf.cond`` on
        isfinite(global update norm), putting the copy back when it is not finite."""

        def __init__(self, gate=False):
            super().__init__()
            self.gate = gate

        def on_train_begin(self, logs=None):
            import tensorflow as tf

            if hasattr(self, "fn"):
                return
            model, opt = self.model, self.model.optimizer
            if not opt.built:
                opt.build(model.trainable_variables)
            state = list(model.weights) + list(opt.variables) + list(model.metrics_variables)
            shadow = [tf.Variable(v.value, trainable=False) for v in state]
            n = len(model.trainable_variables)

            def undo():
                return tf.group([v.assign(s) for v, s in zip(state, shadow, strict=True)])

            def step():
                pairs = zip(state[:n], shadow[:n], strict=True)
                norms = tf.stack([tf.norm(v.value - s) for v, s in pairs])
                if self.gate:  # a decision that depends on every norm, and its undo
                    tf.cond(tf.math.is_finite(tf.norm(norms)), tf.no_op, undo)
                for v, s in zip(state, shadow, strict=True):  # ordered after the reads
                    s.assign(v.value)
                return norms

            # called as its concrete function, as the guard's: a tf.function call spends
            # ~140 us more dispatching with this many captured variables
            self.fn = tf.function(step, autograph=False).get_concrete_function()

        def on_train_batch_begin(self, batch, logs=None):
            self.fn()

    class JaxFloor(keras.callbacks.Callback):
        """The floor of the device mode on Keras' JAX backend, in the guard's own form (one
        jit of the check and Keras' train step): the update norms, a gate on their global
        norm being finite (``where`` per variable) and the undo copy, without the decision;
        ``model.train_function`` wrapped for the length of a ``fit``, as the guard's."""

        def on_train_begin(self, logs=None):
            import jax
            import jax.numpy as jnp

            model = self.model
            n = len(model.trainable_variables)
            self.undo = None

            def step(state, data, undo):
                flat = [x for part in state for x in part]
                deltas = [v - u for v, u in zip(flat[:n], undo[:n], strict=True)]
                norms = jnp.stack([jnp.linalg.norm(d) for d in deltas])
                ok = jnp.isfinite(jnp.linalg.norm(norms))
                kept = [jnp.where(ok, v, u) for v, u in zip(flat, undo, strict=True)]
                it = iter(kept)
                logs, state = model.train_step(tuple([next(it) for _ in p] for p in state), data)
                return logs, state, kept

            if not hasattr(self, "fused"):  # compiled once, as the guard's
                self.fused = jax.jit(step, donate_argnums=(0, 2))
            self.original = model.train_function

            def train_function(state, iterator):
                if self.undo is None:  # the first step of the fit: the copy starts after it
                    logs, state = self.original(state, iterator)
                    self.undo = [jnp.copy(x) for part in state for x in part]
                    return logs, state
                logs, state, self.undo = self.fused(state, next(iterator), self.undo)
                return logs, state

            model.train_function = train_function

        def on_train_end(self, logs=None):
            self.model.train_function = self.original

    class TorchFloor(keras.callbacks.Callback):
        """The floor of the device mode on Keras' torch backend, in the guard's own form (one
        inductor-compiled call at each batch's start, in place): the update norms, a gate
        on their global norm being finite (``where`` per variable) and the undo copy,
        without the decision."""

        def on_train_begin(self, logs=None):
            import torch

            from numstab.frameworks.torch.guard_compiled import compiled_or_eager

            model = self.model
            state = list(model.weights) + list(model.optimizer.variables)
            state += list(model.metrics_variables)
            n = len(model.trainable_variables)
            self.values = [v.value for v in state]
            self.undo = [t.clone() for t in self.values]
            k = len(self.values)

            def gate(*args):
                values, undo = args[:k], args[k:]
                norms = torch.stack([torch.linalg.vector_norm(v - u) for v, u in
                                     zip(values[:n], undo[:n], strict=True)])  # fmt: skip
                ok = torch.isfinite(torch.linalg.vector_norm(norms))
                for v, u in zip(values, undo, strict=True):
                    kept = torch.where(ok, v, u)
                    v.copy_(kept)
                    u.copy_(kept)

            with torch.no_grad():
                self.fn = compiled_or_eager("keras_floor", gate, [*self.values, *self.undo])
            self.started = False

        def on_train_batch_begin(self, batch, logs=None):
            import torch

            if self.started:  # the check of the step before, as the guard's
                with torch.no_grad():
                    self.fn(*self.values, *self.undo)
            self.started = True

    def loop(host_every=None, floor=None):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(args.width, activation="tanh") for _ in range(args.layers)]
        model = keras.Sequential([keras.Input((32,)), *layers, keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        floors = {"jax": JaxFloor, "torch": TorchFloor}
        make_floor = floors.get(backend, lambda: Floor(gate=floor == "gate"))
        callbacks = [] if floor is None else [make_floor()]
        run_guard = None
        if host_every is not None:
            guard = TrainingGuard(snapshot_every=args.snapshot_every, host_every=host_every)
            run_guard = guard.keras_callback()
            callbacks.append(run_guard)
        taken = [0]  # fit() calls so far: every loop sees the same batches in the same order

        def run(n, tick=None):
            extra = [] if tick is None else [Tick(tick)]
            for j in range(taken[0], taken[0] + max(1, n // args.steps)):
                x, y = data[j % fits]
                model.fit(
                    x,
                    y,
                    batch_size=args.batch,
                    shuffle=False,
                    verbose=0,
                    callbacks=callbacks + extra,
                )
                taken[0] += 1

        run.model, run.guard, run.taken = model, run_guard, taken
        return run

    loops = {"plain": loop(), "host": loop(1), "device": loop(args.host_every)}
    if backend == "tensorflow":
        loops["floor"] = loop(floor="copy")
        loops["floor_gate"] = loop(floor="gate")
    else:  # the guard's form there: JAX, inside Keras' step; torch, one compiled call
        loops["floor_gate"] = loop(floor="gate")
    for fn in loops.values():
        fn(args.steps)
    for other in loops:
        for a, b in zip(
            loops["plain"].model.get_weights(), loops[other].model.get_weights(), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    pairs = [
        (name, "host", "plain", "host"),
        (name, f"device (host_every={args.host_every})", "plain", "device"),
        (name, "floor: undo copy + update norms alone", "plain", "floor"),
        (name, "floor: undo copy + norms + gate", "plain", "floor_gate"),
        # the device mode against its floor, round by round: what the decision adds
        (name, "floor gap: device / gated floor", "floor_gate", "device"),
    ]
    pairs = [p for p in pairs if p[2] in loops and p[3] in loops]
    rows = _measure(backend, loops, pairs, args, lambda: None)
    runners = {  # fit() flushes the guard at its end
        name: (run.guard.runner, run.taken[0] * args.steps)
        for name, run in loops.items()
        if run.guard is not None
    }
    healthy(name, runners, rows, pairs)
    return rows


def _measure(framework: str, loops: dict, pairs: list, args, sync) -> list[dict]:
    """Median step times (interleaved rounds) and host reads per step of every loop; one
    row per (backend, mode, baseline loop, loop) of ``pairs``."""
    from _host_reads import counting, counting_cuda_syncs

    # past the spike windows' first fill (128 steps) and a read: the steady state
    settle = 128 + args.host_every
    for fn in loops.values():
        fn(settle)
    sync()
    progress(f"{framework}: settled; timing")
    times = _time(loops, args, sync)
    progress(f"{framework}: timed; counting host reads")
    cuda = framework == "torch" and args.device == "gpu"
    counters = {"host_reads": lambda: counting(framework)}
    if cuda:  # the GPU's own count: every host sync torch reports, C++ ones too
        counters["cuda_syncs"] = counting_cuda_syncs
    counts = {kind: ({}, {}) for kind in counters}  # kind -> (per step, per steady step)
    for name, fn in loops.items():
        # a whole read period (host_every steps, at least --steps): the reads per step
        # amortised over it, and the median step's reads (a steady step: no periodic read)
        n = max(args.steps, args.host_every)
        for kind, make_counter in counters.items():
            with make_counter() as counter:
                per_step = _ticks(fn, n, counter)
                total = counter.count  # before the sync, which is the benchmark's own
            sync()
            amortised, steady = counts[kind]
            amortised[name] = total / n
            steady[name] = statistics.median(
                b - a for a, b in zip([0, *per_step[:-1]], per_step, strict=True)
            )
    rows = []
    for backend, mode, base, name in pairs:
        # the ratio in each round (both loops ran within seconds of each other), then the
        # median over rounds: robust to the load of a shared machine drifting
        ratios = [g / p for g, p in zip(times[name], times[base], strict=True)]
        row = {
            "backend": backend,
            "mode": mode,
            "plain_ms": statistics.median(times[base]),
            "guard_ms": statistics.median(times[name]),
            "ratio": statistics.median(ratios),
            "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2],
        }
        extra = 0.0
        for kind, (amortised, steady) in counts.items():
            row[f"plain_{kind}_per_step"] = amortised[base]
            row[f"guard_{kind}_per_step"] = amortised[name]
            row[f"plain_{kind}_steady_step"] = steady[base]
            row[f"guard_{kind}_steady_step"] = steady[name]
            row[f"extra_{kind}_per_step"] = amortised[name] - amortised[base]
            row[f"extra_{kind}_steady_step"] = steady[name] - steady[base]
            extra = max(extra, steady[name] - steady[base])
        rows.append(judged(row, extra))
    return rows


def judged(row: dict, extra_reads: float) -> dict:
    """``row`` with its ``goal`` and ``meets_goal``: a floor (its mode starts with "floor")
    is a reference, goal and verdict None; another row meets GOAL when its ratio is at most
    GOAL and its steady step reads the host no more than the base loop's
    (``extra_reads <= 0``)."""
    goal = None if row["mode"].startswith("floor") else GOAL
    verdict = goal_row(row["mode"], row["ratio"], goal)["meets_goal"]
    meets = None if verdict is None else bool(verdict and extra_reads <= 0)
    return row | {"goal": goal, "meets_goal": meets}


def _ticks(fn, n: int, counter) -> list[int]:
    """Run ``n`` steps of ``fn``; the read count after each."""
    seen: list[int] = []
    fn(n, tick=lambda: seen.append(counter.count))
    return seen


def _time(loops: dict, args, sync) -> dict:
    """Ms per step of each loop in each round; each round runs every loop once, in an order
    that rotates from round to round."""
    names = list(loops)
    times = {name: [] for name in names}
    for r in range(args.warmup + args.repeats):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order if r % 2 == 0 else order[::-1]:
            gc.disable()
            t = time.perf_counter()
            loops[name](args.steps)
            sync()
            elapsed = time.perf_counter() - t
            gc.enable()
            if r >= args.warmup:
                times[name].append(1e3 * elapsed / args.steps)
    return times


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
    parser.add_argument(
        "--host-every", type=int, default=100, help="the device mode's host_every (k)"
    )
    parser.add_argument("--quick", action="store_true", help="a small model, few rounds")
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu", help="gpu: torch on CUDA, jax on its GPU"
    )
    args = parser.parse_args()
    backends = check_backends(parser, args.backends, list(CASES))
    if args.device == "gpu" and "keras" in backends:
        parser.error("--device gpu runs torch and jax; keras runs where its backend puts it")
    if args.device == "gpu":
        from _device import gpu_missing

        for name in backends:
            if why := gpu_missing(name.strip()):
                parser.error(f"--device gpu: {why}.")
    if args.quick:
        args.width, args.layers, args.batch = 256, 4, 64
        args.steps, args.repeats, args.warmup = 20, 11, 1
    print(
        f"MLP {args.layers}x{args.width}, batch {args.batch}, Adam; {args.steps} steps per "
        f"round, median of {args.repeats} rounds; torch threads {args.threads}; {args.device}"
    )
    rows = []
    for name in backends:
        for r in CASES[name.strip()](args):
            print(row_line(r))
            rows.append(r)
            write_json(args.json, args, rows)  # a run stopped part-way keeps the rows so far


def row_line(r: dict) -> str:
    """One printed row: times, the ratio [quartiles] against its goal (``-`` for a floor,
    which has none), the host reads (and CUDA syncs, where counted), the verdict."""
    verdict = {None: "floor", True: "meets goal", False: "MISSES goal"}[r["meets_goal"]]
    q = r["ratio_quartiles"]
    goal = "-" if r["goal"] is None else f"{r['goal']:g}"
    cuda = (
        f"; CUDA syncs per steady step {r['plain_cuda_syncs_steady_step']:.0f} -> "
        f"{r['guard_cuda_syncs_steady_step']:.0f}, amortised "
        f"{r['plain_cuda_syncs_per_step']:.2f} -> {r['guard_cuda_syncs_per_step']:.2f}"
        if "guard_cuda_syncs_per_step" in r
        else ""
    )
    return (
        f"{r['backend']:>6} {r['mode']:<34} base {r['plain_ms']:7.3f} ms/step, guarded "
        f"{r['guard_ms']:7.3f}, ratio {ratio_text(r['ratio'], r['goal'])} "
        f"[{q[0]:.2f}, {q[1]:.2f}] (goal {goal}); host reads per "
        f"steady step {r['plain_host_reads_steady_step']:.0f} -> "
        f"{r['guard_host_reads_steady_step']:.0f}, amortised "
        f"{r['plain_host_reads_per_step']:.2f} -> {r['guard_host_reads_per_step']:.2f}"
        f"{cuda} [{verdict}]"
    )


CASES = {"torch": torch_case, "jax": jax_case, "keras": keras_case}

if __name__ == "__main__":
    main()
