"""Step-time cost of ``numstab.numerics`` on a small transformer training step.

What is measured (CPU unless the framework sees more; float32)
----------------------------------------------------------------
The same decoder-only transformer in each framework (token + position embedding, ``--layers``
pre-LayerNorm blocks of causal self-attention and a GELU MLP, a vocabulary head, mean token
cross-entropy, one SGD update), written with the framework's usual tools: ``torch.nn``
modules and eager autograd; a ``jax.jit`` step with optax; a ``tf.function`` step with
``tf.GradientTape``. The causal mask uses -1e9 rather than -inf (mode="op" with ``inf=True``
would otherwise flag the mask itself, as TensorFlow's own check does).

Per backend, one step time for each configuration:

- ``off``: no checking;
- ``sentinel``: ``check_numerics(mode="sentinel")`` around all timed steps, with
  ``check()`` at the end of every step (the read that a training loop would do per step,
  so its host sync is included), each framework used the documented recommended way: torch
  records every module output, the gradient into it and every parameter gradient
  automatically; the JAX step computes ``finite_summary(loss)`` and ``finite_summary(grads)``
  inside its ``jax.jit`` and ``watch``-es the two small summaries it returns; TensorFlow
  ``watch``-es the loss and the gradients the ``tf.function`` step returns;
- JAX only, ``sentinel_arrays``: the jitted step returns the gradients and ``watch`` reduces
  them in a second compiled call (what ``watch`` does with any array tree);
- ``op``: ``check_numerics()`` (every op checked; compiled steps run op by op);
- torch only, ``sentinel_floor``: the sentinel's device work (a sum per module output and
  per parameter gradient, one stacked read a step) from bare hooks, without its bookkeeping:
  no module-hook sentinel can cost less; the sentinel's CPU ratio over it is printed;
- torch only, ``detect_anomaly``: ``torch.autograd.set_detect_anomaly(True)``, the anchor
  (users report 1.5x to 3x slower training).

How: configurations are interleaved round by round (A B C D, A B C D, ...) after untimed
warmup steps (which also compile); each run enters its context and does one untimed step
before timing (JAX's op mode clears JAX's caches on entry). Each timed step ends with the loss
read on the host, and the garbage collector is paused. Reported: the median wall and
process-CPU time of a step per configuration, each with its ratio to ``off`` measured in the
same run (the CPU-time ratio is less disturbed by other processes on a shared machine), and,
as a noise gauge, the median, min and max over rounds of the CPU ratio to the ``off`` run of
the same round (``--steps 1 --rounds 30`` alternates step by step). ``--configs`` picks
configurations (``off`` always runs); ``--pieces`` adds, for JAX, the sentinel's per-step pieces
timed in isolation. Intra-op threads are pinned to ``--threads``
(default 1). Goal: sentinel <= 1.05 (wall time over ``off``); the other configurations are
shown for context (no goal). ``--json PATH`` writes the rows (ratio, goal, meets_goal).

Usage: python benchmarks/check_numerics.py [--backends torch,jax,tensorflow] [--layers 2]
       [--width 256] [--seq 128] [--batch 8] [--vocab 1024] [--steps 8] [--rounds 5]
       [--threads 1] [--configs sentinel,op] [--pieces] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from _goals import EAGER_GOAL, add_json_option, check_backends, goal_row, print_rows, write_json

from numstab.numerics import check_numerics, finite_summary

MASK = -1e9


def data(args, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def init_params(args, seed=0) -> dict[str, np.ndarray]:
    """One set of float32 weights, shared by the three implementations."""
    rng = np.random.default_rng(seed)
    d, v, t = args.width, args.vocab, args.seq

    def w(*shape):
        return (rng.normal(0, 1 / math.sqrt(shape[0]), shape)).astype(np.float32)

    p = {"tok": w(v, d) * 0.1, "pos": w(t, d) * 0.1, "head": w(d, v)}
    for i in range(args.layers):
        p |= {
            f"b{i}.ln1": np.ones(d, np.float32),
            f"b{i}.qkv": w(d, 3 * d),
            f"b{i}.proj": w(d, d),
            f"b{i}.ln2": np.ones(d, np.float32),
            f"b{i}.fc1": w(d, 4 * d),
            f"b{i}.fc2": w(4 * d, d),
        }
    return p


# -- torch -------------------------------------------------------------------------------------


def torch_step(args) -> dict[str, Callable[[], float]]:
    import torch
    import torch.nn.functional as F

    params = init_params(args)
    heads, d = args.heads, args.width

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
            self.proj = torch.nn.Linear(d, d, bias=False)
            self.fc1 = torch.nn.Linear(d, 4 * d, bias=False)
            self.fc2 = torch.nn.Linear(4 * d, d, bias=False)
            with torch.no_grad():
                for name in ("qkv", "proj", "fc1", "fc2"):
                    getattr(self, name).weight.copy_(torch.from_numpy(params[f"b{i}.{name}"]).T)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            q, k, v = (y.transpose(1, 2) for y in (q, k, v))
            scores = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            att = scores.masked_fill(mask, MASK).softmax(-1) @ v
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(args.vocab, d)
            self.pos = torch.nn.Parameter(torch.from_numpy(params["pos"]))
            self.blocks = torch.nn.ModuleList(Block(i) for i in range(args.layers))
            self.ln = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, args.vocab, bias=False)
            with torch.no_grad():
                self.tok.weight.copy_(torch.from_numpy(params["tok"]))
                self.head.weight.copy_(torch.from_numpy(params["head"]).T)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens, targets = (torch.from_numpy(a) for a in data(args))

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).reshape(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    @contextlib.contextmanager
    def anomaly():
        with torch.autograd.set_detect_anomaly(True):
            yield None

    return {
        "off": _plain(step),
        "sentinel": _checked(step, "sentinel", "torch"),
        "sentinel_floor": _sums_only(step, model),
        "op": _checked(step, "op", "torch"),
        "detect_anomaly": _plain(step, anomaly),
    }


# -- jax ---------------------------------------------------------------------------------------


def jax_step(args) -> dict[str, Callable[[], float]]:
    parts = _jax_parts(args)
    return {
        "off": _plain(parts["step"]),
        "sentinel": _checked(parts["checked_step"], "sentinel", "jax", pass_context=True),
        "sentinel_arrays": _checked(parts["arrays_step"], "sentinel", "jax", pass_context=True),
        "op": _checked(parts["step"], "op", "jax"),
    }


def jax_pieces(args) -> None:
    """The sentinel's per-step pieces in isolation (process CPU time, median of 200): the
    host side of each way to watch, and the reductions the recommended way adds to the jit."""
    import jax

    parts = _jax_parts(args)
    p, s = parts["box"]["p"], parts["box"]["s"]
    _, _, loss, grads = jax.block_until_ready(parts["train_returning_grads"](p, s))
    _, _, _, (loss_ok, grads_ok) = jax.block_until_ready(parts["train_checked"](p, s))
    summarize = jax.jit(finite_summary)

    def cpu_ms(f, n=200) -> float:
        for _ in range(3):
            f()
        times = []
        for _ in range(n):
            c0 = time.process_time()
            f()
            times.append(time.process_time() - c0)
        return statistics.median(times) * 1e3

    with check_numerics(mode="sentinel", backend="jax") as cn:
        pieces = {
            "watch 2 FiniteSummary + check()": lambda: (
                cn.watch(loss_ok, "loss"),
                cn.watch(grads_ok, "grads"),
                cn.check(),
            ),
            "watch loss + grads arrays + check()": lambda: (
                cn.watch(loss, "loss"),
                cn.watch(grads, "grads"),
                cn.check(),
            ),
            "the reductions alone (jit, blocked)": lambda: jax.block_until_ready(summarize(grads)),
        }
        print("\njax: sentinel pieces per step, in isolation (CPU ms, median of 200)")
        for label, f in pieces.items():
            print(f"  {label:40s} {cpu_ms(f):8.3f}")


def _jax_parts(args) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    heads, d = args.heads, args.width
    params = {k: jnp.asarray(v) for k, v in init_params(args).items()}
    tokens, targets = (jnp.asarray(a) for a in data(args))
    opt = optax.sgd(1e-3)

    def layer_norm(x, g):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g

    def forward(p, tokens):
        x = p["tok"][tokens] + p["pos"]
        b, t, _ = x.shape
        mask = jnp.triu(jnp.ones((t, t), bool), 1)
        for i in range(args.layers):
            qkv = (layer_norm(x, p[f"b{i}.ln1"]) @ p[f"b{i}.qkv"]).reshape(b, t, 3, heads, -1)
            q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
            scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads)
            att = jax.nn.softmax(jnp.where(mask, MASK, scores), -1) @ v
            x = x + att.transpose(0, 2, 1, 3).reshape(b, t, d) @ p[f"b{i}.proj"]
            h = jax.nn.gelu(layer_norm(x, p[f"b{i}.ln2"]) @ p[f"b{i}.fc1"], approximate=False)
            x = x + h @ p[f"b{i}.fc2"]
        return x @ p["head"]

    def loss_fn(p):
        logits = forward(p, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def update(p, state):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss, grads

    @jax.jit
    def train(p, state):  # the step without checking
        return update(p, state)[:3]

    @jax.jit
    def train_checked(p, state):  # the recommended sentinel step: summaries made in the jit
        p, state, loss, grads = update(p, state)
        return p, state, loss, (finite_summary(loss), finite_summary(grads))

    @jax.jit
    def train_returning_grads(p, state):  # watch() on the returned arrays instead
        return update(p, state)

    box = {"p": params, "s": opt.init(params)}

    def step() -> float:
        box["p"], box["s"], loss = train(box["p"], box["s"])
        return float(loss)

    def checked_step(cn) -> float:
        box["p"], box["s"], loss, (loss_ok, grads_ok) = train_checked(box["p"], box["s"])
        cn.watch(loss_ok, "loss")
        cn.watch(grads_ok, "grads")
        return float(loss)

    def arrays_step(cn) -> float:
        box["p"], box["s"], loss, grads = train_returning_grads(box["p"], box["s"])
        cn.watch(loss, "loss")
        cn.watch(grads, "grads")
        return float(loss)

    return {
        "step": step,
        "checked_step": checked_step,
        "arrays_step": arrays_step,
        "train_checked": train_checked,
        "train_returning_grads": train_returning_grads,
        "box": box,
    }


# -- tensorflow --------------------------------------------------------------------------------


def tensorflow_step(args) -> dict[str, Callable[[], float]]:
    import tensorflow as tf

    heads, d = args.heads, args.width
    params = {k: tf.Variable(v, name=k.replace(".", "_")) for k, v in init_params(args).items()}
    tokens, targets = (tf.constant(a) for a in data(args))

    def layer_norm(x, g):
        mu, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mu) * tf.math.rsqrt(var + 1e-5) * g

    def forward(p, tokens):
        x = tf.gather(p["tok"], tokens) + p["pos"]
        b, t = x.shape[0], x.shape[1]
        mask = tf.linalg.band_part(tf.ones((t, t)), 0, -1) - tf.eye(t) > 0
        for i in range(args.layers):
            qkv = tf.reshape(layer_norm(x, p[f"b{i}.ln1"]) @ p[f"b{i}.qkv"], (b, t, 3, heads, -1))
            q, k, v = (tf.transpose(qkv[:, :, j], (0, 2, 1, 3)) for j in range(3))
            scores = q @ tf.transpose(k, (0, 1, 3, 2)) / math.sqrt(d // heads)
            att = tf.nn.softmax(tf.where(mask, MASK, scores), -1) @ v
            x = x + tf.reshape(tf.transpose(att, (0, 2, 1, 3)), (b, t, d)) @ p[f"b{i}.proj"]
            h = tf.nn.gelu(layer_norm(x, p[f"b{i}.ln2"]) @ p[f"b{i}.fc1"])
            x = x + h @ p[f"b{i}.fc2"]
        return x @ p["head"]

    names = list(params)

    @tf.function
    def train():
        with tf.GradientTape() as tape:
            logits = forward(params, tokens)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, [params[k] for k in names])]
        for k, g in zip(names, grads, strict=True):
            params[k].assign_sub(1e-3 * g)
        return loss, grads

    def step(cn=None) -> float:
        loss, grads = train()
        if cn is not None:
            cn.watch(loss, "loss")
            cn.watch(grads, "grads")
        return float(loss)

    return {
        "off": _plain(step),
        "sentinel": _checked(step, "sentinel", "tensorflow", pass_context=True),
        "op": _checked(step, "op", "tensorflow"),
    }


# -- timing ------------------------------------------------------------------------------------


def _plain(step, context=contextlib.nullcontext):
    def run(n: int) -> list[float]:
        with context():
            return _timed(step, n)

    return run


def _sums_only(step, model):
    """The torch sentinel's floor: its device work with the least host work around it. A
    global forward hook sums each module's floating output (once where a container returns
    its last child's), a post-accumulate hook sums each parameter's gradient, and after the
    step one stacked read checks them: what any module-hook sentinel must do, with none of
    its bookkeeping (names, slots, flags per record)."""
    import torch

    sums, last = [], [None]

    def forward(module, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out is not last[0]:
            last[0] = out
            sums.append(out.detach().sum())

    def one():
        step()
        last[0] = None
        assert torch.stack(sums).isfinite().all().item()
        sums.clear()

    def run(n: int) -> list[float]:
        register = torch.nn.modules.module.register_module_forward_hook
        handles = [register(forward)] + [
            p.register_post_accumulate_grad_hook(lambda p: sums.append(p.grad.sum()))
            for p in model.parameters()
        ]
        try:
            return _timed(one, n)
        finally:
            for handle in handles:
                handle.remove()

    return run


def _checked(step, mode, backend, pass_context=False):
    def one(cn):
        step(cn) if pass_context else step()
        if mode == "sentinel":
            cn.check()

    def run(n: int) -> list[float]:
        with check_numerics(mode=mode, backend=backend) as cn:
            return _timed(lambda: one(cn), n)

    return run


def _timed(step, n: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of ``n`` steps, after one untimed step: entering a context is not
    timed (JAX's op mode clears JAX's caches on entry, so its first step compiles again, and
    so does the first step of the configuration run after it)."""
    step()
    times = []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def _limit_threads(n: int, backends: list[str]) -> None:
    """Pin intra-op threads (spinning thread pools on a shared CPU make timings noisy)."""
    eigen = "true" if n > 1 else "false"
    os.environ.setdefault("XLA_FLAGS", f"--xla_cpu_multi_thread_eigen={eigen}")
    if "torch" in backends:
        import torch

        torch.set_num_threads(n)
    if "tensorflow" in backends:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(n)


BUILDERS = {"torch": torch_step, "jax": jax_step, "tensorflow": tensorflow_step}


def measure(name: str, args) -> list[dict]:
    configs = BUILDERS[name](args)
    if args.configs:
        wanted = {"off", *(c.strip() for c in args.configs.split(","))}
        configs = {k: run for k, run in configs.items() if k in wanted}
    steps = {k: (max(1, args.steps // 4) if k == "op" and name != "torch" else args.steps)
             for k in configs}  # fmt: skip
    for run in configs.values():  # warmup: compiles, first hooks, first trace
        run(args.warmup)
    rounds: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in configs}
    gc.disable()
    try:
        for _ in range(args.rounds):
            for k, run in configs.items():
                rounds[k].append(run(steps[k]))
    finally:
        gc.enable()
    samples = {k: [t for r in per_round for t in r] for k, per_round in rounds.items()}
    base = [statistics.median(t[i] for t in samples["off"]) for i in (0, 1)]
    print(f"\n{name}: median step time over {args.rounds} interleaved rounds")
    rows = []
    for k, times in samples.items():
        wall, cpu = (statistics.median(t[i] for t in times) for i in (0, 1))
        per_round = sorted(_cpu_ratio(r, o) for r, o in zip(rounds[k], rounds["off"], strict=True))
        rows.append(
            goal_row(
                f"{name}: {k}",
                wall / base[0],
                EAGER_GOAL if k == "sentinel" else None,
                wall_ms=wall * 1e3,
                cpu_ms=cpu * 1e3,
                cpu_ratio=cpu / base[1],
                steps=len(times),
                round_cpu_ratios=[statistics.median(per_round), per_round[0], per_round[-1]],
            )
        )
    columns = [("wall_ms", ".2f"), ("cpu_ms", ".2f"), ("cpu_ratio", ".3f"), ("steps", "d")]
    print_rows(rows, columns)
    print("ratio: wall time over off; cpu ratio per round (median [min, max]):")
    for row in rows:
        middle, low, high = row["round_cpu_ratios"]
        print(f"  {row['case']:28s} {middle:.3f} [{low:.3f}, {high:.3f}]")
    if "sentinel_floor" in rounds and "sentinel" in rounds:
        over = [_cpu_ratio(a, b) for a, b in zip(rounds["sentinel"], rounds["sentinel_floor"],
                                                 strict=True)]  # fmt: skip
        rows[list(samples).index("sentinel")]["cpu_ratio_over_floor"] = statistics.median(over)
        print(f"  sentinel over its floor (CPU, median per round): {statistics.median(over):.3f}")
    return rows


def _cpu_ratio(times, off_times) -> float:
    """Median CPU time of one round over the median of the ``off`` round next to it."""
    return statistics.median(t[1] for t in times) / statistics.median(t[1] for t in off_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="torch,jax,tensorflow")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per framework")
    parser.add_argument("--configs", default="", help="e.g. sentinel,op (off always runs)")
    parser.add_argument("--pieces", action="store_true", help="jax: time the sentinel's pieces")
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    add_json_option(parser)
    args = parser.parse_args()
    backends = check_backends(parser, args.backends, list(BUILDERS))
    _limit_threads(args.threads, backends)
    if args.quick:
        args.width, args.seq, args.vocab, args.steps, args.rounds = 128, 64, 512, 3, 3
    print(
        f"model: {args.layers} blocks, width {args.width}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, vocab {args.vocab}; {args.steps} steps x {args.rounds} rounds"
    )
    rows = []
    for name in backends:
        rows += measure(name, args)
        if name == "jax" and args.pieces:
            jax_pieces(args)
    write_json(args.json, args, rows)


if __name__ == "__main__":
    main()
