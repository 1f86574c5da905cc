"""Peak memory and time of fused_linear_cross_entropy against the unfused path, per backend.

What is measured
----------------
Forward + backward of a mean cross-entropy of ``hidden @ weight.T`` (hidden [tokens,
d_model], weight [vocab, d_model], integer labels with ~5% ``ignore_index`` rows), gradients
with respect to hidden and weight:

* unfused: ``numstab.cross_entropy(hidden @ weight.T, labels)`` (the full logits exist);
* fused: ``numstab.fused_linear_cross_entropy(hidden, weight, labels)`` (default chunk size).

torch runs eagerly (``loss.backward()``), jax under ``jax.jit`` around ``jax.value_and_grad``,
tensorflow under ``tf.function`` around a ``GradientTape``: the way each is normally trained.
jax and tensorflow return the loss and the gradients' norms from the compiled step (computed
eagerly, ``jnp.linalg.norm(dw)`` would hold a squared copy of the weight gradient and count it).
Default shapes: tokens 4096, d_model 1024, vocab 65536 on CPU (float32); 32768 x 4096 x 131072
in bfloat16 with ``--device gpu``; ``--quick``: 2048 x 128 x 32768.

How
---
* Every (backend, variant) runs in its own fresh subprocess, one after the other, so that no
  allocator cache, compiled program or freed-but-kept memory of one run can hide in another.
* CPU peak memory = the process's resident-set high-water mark (``VmHWM`` in
  /proc/self/status) after the first step, minus the resident set when that mark was reset
  (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) just before the step, after the framework
  import, the input creation and a tiny warm-up. Resetting matters: a plain ``ru_maxrss``
  difference would hide up to the size of freed input temporaries (the weight's, 256 MiB at the
  default shape) in the baseline. Where the reset is impossible ``ru_maxrss`` is used and the
  output says so. It counts everything the step allocates on top of its inputs: logits,
  softmax, their gradients and the gradients of hidden and weight. tracemalloc would be
  blind to the frameworks' native allocators, so it is not used.
* Compilation apart: jax.jit's program is lowered and compiled, and tf.function's graph
  traced, before the first step, under their own reset of the mark (``compile MiB``, paid
  once). Freed memory then goes back to the OS (glibc ``malloc_trim(0)``) and the mark is
  reset again before the first step, and once more before the timed steps, so that memory
  kept by the allocator cannot hide a step's own allocations. A run's step peak is the
  larger of the first step's and the timed steps'. TensorFlow on CPU: its allocator's own
  peak counter (``get_memory_info("CPU:0")``) over the timed steps, as its RSS keeps what the
  first step freed; its first step's RSS above that (tracing, graph optimisation, the
  executor) is its ``compile MiB``.
* GPU peak memory = the framework's own peak counter, reset before the step:
  ``torch.cuda.max_memory_allocated``, ``jax Device.memory_stats()["peak_bytes_in_use"]``,
  ``tf.config.experimental.get_memory_info("GPU:0")["peak"]``, minus the bytes in use before
  the step. JAX's counter cannot be reset, so after compiling it holds the compilation's
  peak (autotuning buffers): on a GPU a JAX step's peak is XLA's buffer assignment for one
  execution instead (``memory_analysis()``: temp + outputs not aliased to the arguments, the
  one block XLA allocates per call), and the counter's figure is kept as
  ``process_peak_bytes``.
* Time: the median of ``--repeats`` timed steps after the first, untimed, step, each ending
  with a device sync; the garbage collector is paused while timing. ``cpu ratio``: the same
  for the process's CPU time (all its threads), fused over unfused, which moves less than
  wall time when other processes share the cores (the goal is on wall time).
* Before the numbers are trusted, the fused loss and gradient norms are compared with the
  unfused ones (relative 1e-3; 2e-2 in bfloat16, whose unfused gradients round each product
  where the fused ones accumulate in float32): a fast but wrong kernel is reported as WRONG.
* Floor: a third run per backend, in plain framework ops, of one chunk of the fused
  algorithm at the fused path's chunk size: both gradients allocated (hidden's and weight's),
  one chunk of float32 logits, its softmax, and its products written into the gradients.
  Every chunked implementation holds at least that; measured the same way, in the same run.
  JAX's floors hold the gradients and the chunk together with an optimization barrier: XLA
  reorders a lone chunk's work so that they are never alive together (and it takes
  ``dhidden``'s norm from the chunk's rows alone), and a plain ``dweight + product`` loop
  holds a second ``dweight``-sized buffer on XLA:CPU (``one_chunk``). Their logits are the
  GEMM's output in the inputs' dtype, widened inside the softmax's fusions, as in the fused
  path (and the unfused one).
  For 16-bit inputs a second floor (``floor_f32``) sums ``dweight`` in float32 beside the
  chunk and casts it at the end: what a chunked path whose ``dweight`` matches the unfused
  GEMM's one rounding holds at least (the fused path does that). Printed under the table as
  ``fused/that floor``; ``--json``: ``f32_sum_floor_mib``, ``ratio_f32_sum_floor``,
  ``meets_goal_f32_sum_floor`` (``ratio`` stays over the first floor).
* Time floor (TensorFlow, torch): a fourth run, every chunk of the fused algorithm in plain
  ops, one chunk after the other at the same chunk size (logits, softmax gradient,
  ``dhidden`` rows, ``dweight += g.T @ h_chunk``; TensorFlow into a new buffer, torch with
  ``addmm_``): the work of any exact chunked path, without numstab's checks. Printed
  as its time over unfused (a chunked path's cost at that chunk; over 1.10 means the goal
  cannot be met there) and the fused time over it.

Goals (issue 20, goal 5): per framework, the fused step peak <= 1.10 x the floor's step
peak, and fused time <= 1.10 x unfused. Numbers are printed,
never asserted; --json rows carry ``ratio`` (fused / floor), ``goal``, ``meets_goal`` and
the time ratio with its own goal, and with a time floor ``time_floor_ratio`` (floor / unfused),
``fused_over_time_floor`` and ``time_floor_meets_goal``. ``--interleaved ROUNDS`` also times
unfused, fused and the time floor in one process, one step of each per round in rotating
order, and prints the median of the per-round ratios with quartiles (``interleaved`` in the
JSON rows): the runs above are separate processes for clean peaks, so a load that changes
between them moves their time ratios; interleaved rounds do not have that bias.
``--device gpu`` runs issue 20's GPU shape, 32768 tokens x d_model 4096 x vocab 131072 in
bfloat16 (``--dtype`` to change it), each framework's peak counter in place of the RSS.

Usage: python benchmarks/memory.py [--backends torch,jax,tensorflow] [--device cpu|gpu]
       [--quick] [--repeats 3] [--tokens N --d-model D --vocab V] [--chunk-size C]
       [--dtype float32|bfloat16] [--interleaved ROUNDS] [--json P]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

from _goals import check_backends, dump_json

BACKENDS = ("torch", "jax", "tensorflow")
VARIANTS = ("unfused", "fused", "floor")
#: for 16-bit inputs, a second memory floor: one whose dweight is summed in float32, as an
#: exact chunked path's must be to match the unfused GEMM's one rounding (the fused path's is)
F32_SUM_FLOOR = "floor_f32"
FLOORS = ("floor", F32_SUM_FLOOR)
#: a time floor, where the backend has one: every chunk of the fused algorithm in plain
#: framework ops, one after the other (see _tf_chunked_floor)
TIME_FLOORS = {"tensorflow": "chunked", "torch": "chunked"}
# issue 20, goal 5: fused per-step peak <= 1.10 x the floor measured in the same run, fused
# time <= 1.10 x unfused
MEMORY_GOAL, TIME_GOAL = 1.10, 1.10
DTYPES = ("float32", "bfloat16")


def _max_rss_bytes() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024  # Linux reports KiB


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_high_water_mark() -> tuple[str, int]:
    """Reset the RSS high-water mark to the current RSS where Linux allows it (writing 5 to
    /proc/self/clear_refs, Linux >= 4.0); return (method, baseline bytes)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return "VmHWM", _proc_status_bytes("VmRSS")
    except OSError:  # not Linux: ru_maxrss, which also counts earlier transient peaks
        return "ru_maxrss", _max_rss_bytes()


def _high_water_mark(method: str) -> int:
    return _proc_status_bytes("VmHWM") if method == "VmHWM" else _max_rss_bytes()


def _return_freed_memory() -> bool:
    """Hand the memory the allocator keeps after frees back to the OS (glibc ``malloc_trim``),
    so that a later step's allocations raise the RSS instead of hiding in it; False where
    there is no such call (then a later step's peak cannot be trusted)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


# -- worker: one (backend, variant) per process ------------------------------------------------
def _inputs(tokens, d_model, vocab, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((tokens, d_model), dtype=np.float32)
    weight = rng.standard_normal((vocab, d_model), dtype=np.float32) / d_model**0.5
    labels = rng.integers(0, vocab, tokens)
    labels[rng.random(tokens) < 0.05] = -100
    return hidden, weight, labels


def _torch_step(variant, hidden, weight, labels, chunk, gpu, dtype="float32"):
    import torch

    import numstab as ns
    from numstab.fused_cross_entropy import fused_linear_cross_entropy

    device = "cuda" if gpu else "cpu"
    dt = getattr(torch, dtype)
    h = torch.from_numpy(hidden).to(device, dt).requires_grad_(True)
    w = torch.from_numpy(weight).to(device, dt).requires_grad_(True)
    y = torch.from_numpy(labels).to(device)

    def loss_fn():
        if variant == "fused":
            return fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
        return ns.cross_entropy(h @ w.T, y)

    def chunk_softmax():  # one chunk of float32 logits turned into its softmax in place
        logits = torch.mm(h[:chunk], w.T).float()
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        return logits.div_(logits.sum(-1, keepdim=True))

    def floor_step():
        # what any chunked path holds at least: both gradients, one chunk's softmax, that
        # chunk's products written into them
        with torch.no_grad():
            dh, dw = torch.zeros_like(h), torch.zeros_like(w)
            logits = chunk_softmax()
            dh[:chunk] = torch.mm(logits.to(dt), w)
            dw.addmm_(logits.T.to(dt), h[:chunk])
        return logits.sum(), dh, dw

    def floor_f32_sum_step():
        # the floor of a path that sums a 16-bit dweight over chunks in float32 (to match the
        # unfused GEMM's one rounding): that sum beside the gradients and the chunk, then the
        # returned 16-bit dweight made from it once the chunk is gone
        with torch.no_grad():
            dh = torch.zeros_like(h)
            dw32 = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            logits = chunk_softmax()
            p = logits.to(dt)
            dh[:chunk] = torch.mm(p, w)
            if gpu:  # one tensor-core GEMM into float32, as the fused path's
                torch.addmm(dw32, p.T, h[:chunk], out_dtype=torch.float32, out=dw32)
            else:  # CPU has no 16-bit GEMM into float32: float32 operands, as the fused path's
                dw32.addmm_(p.T.float(), h[:chunk].float())
            loss = logits.sum()
            del logits, p
            return loss, dh, dw32.to(dt)

    def step():
        if variant in FLOORS:
            loss, dh, dw = floor_step() if variant == "floor" else floor_f32_sum_step()
        elif variant == "chunked":
            loss, dh, dw = _torch_chunked_floor(torch, h.detach(), w.detach(), y, chunk, gpu)
        else:
            loss = loss_fn()
            dh, dw = torch.autograd.grad(loss, [h, w])
        if gpu:
            torch.cuda.synchronize()
        return float(loss), _float32_norm(dh), _float32_norm(dw)

    def gpu_stats(reset):
        if reset:
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return torch.cuda.max_memory_allocated()

    return step, gpu_stats, None  # eager: nothing to compile


def _torch_chunked_floor(torch, h, w, y, chunk, gpu):
    """The time floor of a chunked torch path: every chunk in plain ops, no autograd, no
    checks: the logits (on CPU ``mm(w, h_c.T).T`` made contiguous, the layout MKL runs
    fastest and the fused path's), their softmax in place minus the one-hot, times the row
    scale (1/D, 0 on ignored rows), the ``dhidden`` rows and ``dweight.addmm_``."""
    counted = y != -100
    scale = counted.float() / counted.sum().clamp(min=1)
    labels = torch.where(counted, y, 0)
    with torch.no_grad():
        dh, dw = torch.empty_like(h), torch.zeros_like(w)
        total = torch.zeros((), device=h.device)
        for start in range(0, h.shape[0], chunk):
            hc, yc = h[start : start + chunk], labels[start : start + chunk, None]
            sc = scale[start : start + chunk, None]
            x = (torch.mm(hc, w.T) if gpu else torch.mm(w, hc.T).T.contiguous()).float()
            lse = torch.logsumexp(x, -1, keepdim=True)
            total += ((lse - x.gather(1, yc)) * sc).sum()
            g = x.sub_(lse).exp_()
            g.scatter_add_(1, yc, torch.full_like(yc, -1, dtype=g.dtype)).mul_(sc)
            g = g.to(h.dtype)
            dh[start : start + chunk] = g @ w
            dw.addmm_(g.T, hc)
    return total, dh, dw


def _float32_norm(t, rows: int = 1024) -> float:
    """The float32 norm of a torch tensor, ``rows`` at a time: ``t.float().norm()`` made a
    float32 copy of a bfloat16 ``dweight`` (2 GiB at the GPU shape), which was the floor's
    peak and counted in both runs'."""
    import torch

    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for start in range(0, t.shape[0], rows):
        total += t[start : start + rows].float().square().sum()
    return float(total.sqrt())


def jax_program(variant: str, chunk: int | None):
    """The JAX run's step, jitted: ``(hidden, weight, labels) -> (loss, |dhidden|,
    |dweight|)`` for ``variant`` (unfused, fused, floor, floor_f32); shared with
    ``benchmarks/xla_gpu_memory.py``, which plans it for a GPU it does not have."""
    import jax
    import jax.numpy as jnp

    import numstab as ns
    from numstab.fused_cross_entropy import fused_linear_cross_entropy

    def loss_fn(h, w, y):
        if variant == "fused":
            return fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
        return ns.cross_entropy(h @ w.T, y)

    def one_chunk(h, w, dw_dtype):
        """Both gradients and one chunk alive at once, what any chunk loop holds: one
        chunk's softmax and its products written into the gradients (``dweight`` that
        product, summed in ``dw_dtype``), held together by an optimization barrier. Without
        it XLA reorders a lone chunk's work so that they are never all alive (and takes
        ``dhidden``'s norm from the chunk's rows alone), planning less than a loop holds. A
        loop carrying ``dweight`` in plain ops is no floor on XLA:CPU, which cannot add a dot
        into its output: it holds the product beside ``dweight`` (866 MiB against the fused
        step's 372 at 4096 x 1024 x 65536), which the fused path's blocked update does not.
        The logits are the GEMM's output in the inputs' dtype, widened inside the softmax's
        fusions, as in the fused path (and the unfused one)."""
        size = min(chunk, h.shape[0])
        rows = h[:size]
        # the softmax's only reader is its 16-bit cast (a loss summed from it too would keep
        # a float32 chunk alive, which the fused path never holds)
        g = jax.nn.softmax(jnp.matmul(rows, w.T).astype(jnp.float32)).astype(h.dtype)
        dh = jnp.zeros_like(h).at[:size].set((g @ w).astype(h.dtype))
        dw = jnp.matmul(g.T, rows, preferred_element_type=dw_dtype)
        dh, dw, g = jax.lax.optimization_barrier((dh, dw, g))
        return g[0, 0].astype(jnp.float32), (dh, dw.astype(w.dtype))  # g read: kept alive

    @jax.jit
    def value_and_grad(h, w, y):  # the norms inside: eagerly, norm(dw) would square dw
        if variant in FLOORS:
            sum_dtype = w.dtype if variant == "floor" else jnp.float32
            loss, (dh, dw) = one_chunk(h, w, sum_dtype)
        else:
            loss, (dh, dw) = jax.value_and_grad(loss_fn, argnums=(0, 1))(h, w, y)
        return (
            loss,
            jnp.linalg.norm(dh.astype(jnp.float32)),
            jnp.linalg.norm(dw.astype(jnp.float32)),
        )

    return value_and_grad


def _jax_step(variant, hidden, weight, labels, chunk, gpu, dtype="float32"):
    import jax
    import jax.numpy as jnp

    device = jax.devices("gpu" if gpu else "cpu")[0]
    h, w = (jax.device_put(jnp.asarray(a, dtype), device) for a in (hidden, weight))
    y = jax.device_put(jnp.asarray(labels), device)
    value_and_grad = jax_program(variant, chunk)

    program = [value_and_grad]

    def compile_():
        """Compiled ahead of the first step, so that its memory is measured apart; returns
        the bytes XLA's buffer assignment gives one execution beyond its arguments (temp +
        outputs not aliased to them), what a GPU allocates for the step."""
        program[0] = value_and_grad.lower(h, w, y).compile()
        plan = program[0].memory_analysis()
        return plan.temp_size_in_bytes + plan.output_size_in_bytes - plan.alias_size_in_bytes

    def step():
        return tuple(float(v) for v in program[0](h, w, y))

    def gpu_stats(reset):
        stats = device.memory_stats()
        return stats["bytes_in_use"] if reset else stats["peak_bytes_in_use"]

    return step, gpu_stats, compile_


def _tensorflow_step(variant, hidden, weight, labels, chunk, gpu, dtype="float32"):
    import tensorflow as tf

    import numstab as ns
    from numstab.fused_cross_entropy import fused_linear_cross_entropy

    name = "/GPU:0" if gpu else "/CPU:0"
    with tf.device(name):
        h, w = (tf.cast(tf.constant(a), dtype) for a in (hidden, weight))
        y = tf.constant(labels)

    def floor_fn(h, w):  # both gradients and one chunk of float32 logits (see _torch_step)
        logits = tf.cast(tf.matmul(h[:chunk], w, transpose_b=True), tf.float32)
        p = tf.cast(tf.nn.softmax(logits), h.dtype)
        dh = tf.pad(tf.matmul(p, w), [[0, h.shape[0] - chunk], [0, 0]])
        return tf.reduce_sum(logits), dh, tf.matmul(p, h[:chunk], transpose_a=True)

    def floor_f32_sum_fn(h, w):  # dweight summed in float32, then cast (see _torch_step)
        logits = tf.cast(tf.matmul(h[:chunk], w, transpose_b=True), tf.float32)
        p = tf.nn.softmax(logits)
        dh = tf.pad(tf.matmul(tf.cast(p, h.dtype), w), [[0, h.shape[0] - chunk], [0, 0]])
        dw32 = tf.matmul(p, tf.cast(h[:chunk], tf.float32), transpose_a=True)
        return tf.reduce_sum(logits), dh, tf.cast(dw32, w.dtype)

    @tf.function
    def value_and_grad(h, w):
        if variant in (*FLOORS, "chunked"):
            fns = {"floor": floor_fn, F32_SUM_FLOOR: floor_f32_sum_fn}
            fn = fns[variant] if variant in fns else _tf_chunked_floor(tf, y, chunk)
            loss, dh, dw = fn(h, w)
            return loss, tf.norm(tf.cast(dh, tf.float32)), tf.norm(tf.cast(dw, tf.float32))
        with tf.GradientTape() as tape:
            tape.watch([h, w])
            if variant == "fused":
                loss = fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
            else:
                loss = ns.cross_entropy(tf.matmul(h, w, transpose_b=True), y)
        dh, dw = tape.gradient(loss, [h, w])
        return loss, tf.norm(tf.cast(dh, tf.float32)), tf.norm(tf.cast(dw, tf.float32))

    def step():
        with tf.device(name):
            return tuple(float(v) for v in value_and_grad(h, w))

    def gpu_stats(reset):
        if reset:
            tf.config.experimental.reset_memory_stats(name[1:])
            return tf.config.experimental.get_memory_info(name[1:])["current"]
        return tf.config.experimental.get_memory_info(name[1:])["peak"]

    def trace():
        value_and_grad.get_concrete_function(h, w)

    return step, gpu_stats, trace


def _tf_chunked_floor(tf, y, chunk):
    """The time floor of a chunked TF path: the work any exact chunked implementation does, in
    plain ops, chunk after chunk (a while loop, one iteration at a time): per chunk the logits
    (BatchMatMulV2 with adj_y, TF's fastest CPU layout for them), the loss rows and softmax
    gradient (SparseSoftmaxCrossEntropyWithLogits), the row scale, ``dhidden`` rows and
    ``dweight += g.T @ h_chunk``, a new ``dweight`` each chunk (no memory saving: time only)."""
    counted = tf.cast(y != -100, tf.float32)
    scale = counted / tf.maximum(tf.reduce_sum(counted), 1.0)
    y_safe = tf.where(y == -100, tf.zeros_like(y), y)

    def fn(h, w):
        rows = h.shape[0]
        starts = tf.range(0, rows, chunk)

        def body(i, total, dw, dh):
            start = starts[i]
            size = tf.minimum(chunk, rows - start)
            hc, yc, sc = (
                h[start : start + size],
                y_safe[start : start + size],
                scale[start : start + size],
            )
            x = tf.raw_ops.BatchMatMulV2(x=hc, y=w, adj_y=True)
            nll, g = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=yc)
            g = g * tf.cast(sc, g.dtype)[:, None]
            dh = dh.write(i, tf.matmul(g, w))
            return (
                i + 1,
                total + tf.reduce_sum(tf.cast(nll, tf.float32) * sc),
                dw + tf.matmul(g, hc, transpose_a=True),
                dh,
            )

        dh = tf.TensorArray(h.dtype, size=starts.shape[0], infer_shape=False)
        start = (tf.constant(0), tf.constant(0.0), tf.zeros(w.shape, w.dtype), dh)
        _, total, dw, dh = tf.while_loop(
            lambda i, *_: i < starts.shape[0], body, start, parallel_iterations=1
        )
        return total, dh.concat(), dw

    return fn


def _tiny_warmup(backend, gpu):
    """Touch the framework's kernels once on tiny inputs, so that their one-off memory (thread
    pools, code pages) falls into the baseline rather than into either variant."""
    import numstab as ns

    hidden, weight, labels = _inputs(8, 4, 16)
    step, _, _ = STEPS[backend]("unfused", hidden, weight, labels, None, gpu)
    step()
    del ns


STEPS = {"torch": _torch_step, "jax": _jax_step, "tensorflow": _tensorflow_step}


def worker(args) -> dict:
    gpu = args.device == "gpu"
    _tiny_warmup(args.backend, gpu)
    hidden, weight, labels = _inputs(args.tokens, args.d_model, args.vocab)
    chunk = _chunk_of(args, args.variant)
    step, gpu_stats, compile_ = STEPS[args.backend](
        args.variant, hidden, weight, labels, chunk, gpu, args.dtype
    )
    del hidden, weight, labels  # the framework holds its own copies
    gc.collect()
    method, baseline = _reset_high_water_mark()
    before = gpu_stats(reset=True) if gpu else 0
    # jit / tf.function: traced (and compiled) apart from the step; JAX: XLA's planned bytes
    planned = compile_() if compile_ is not None else None
    compile_peak = _peak(gpu, gpu_stats, method, baseline, before)
    gc.collect()
    trimmed = gpu or _return_freed_memory()
    method, baseline = _reset_high_water_mark()
    before = gpu_stats(reset=True) if gpu else 0
    values = step()  # the first step (for TF: with graph optimisation); its peak counts
    peak = _peak(gpu, gpu_stats, method, baseline, before)
    # the timed steps' peak (JAX's GPU peak counter cannot be reset, and without malloc_trim
    # freed memory would hide the step's own allocations: no number then)
    gc.collect()
    per_step = not (gpu and args.backend == "jax") and (gpu or _return_freed_memory())
    if per_step:
        method, baseline = _reset_high_water_mark()
        before = gpu_stats(reset=True) if gpu else 0
    # TensorFlow's CPU allocator keeps what it freed (the timed steps' RSS barely moves): its
    # own counter gives the step's tensors, the graph and executor memory left out
    counted = not gpu and args.backend == "tensorflow"
    held = gpu_stats(reset=True) if counted else 0
    times, cpu_times = [], []
    gc.disable()
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    gc.enable()
    step_peak = _peak(gpu, gpu_stats, method, baseline, before) if per_step else None
    allocator_peak = gpu_stats(reset=False) - held if counted else None
    process_peak = None
    if gpu and args.backend == "jax":  # its peak counter has the compilation's autotuning in it
        process_peak, peak, method = peak, planned, "XLA buffer assignment (temp + outputs)"
    elif gpu:
        method = "framework peak counter"
    return {
        "backend": args.backend,
        "variant": args.variant,
        "chunk": chunk,  # None: the fused path's default
        "peak_bytes": peak,  # the first step, after compiling
        "step_peak_bytes": step_peak,  # the timed steps
        "compile_peak_bytes": compile_peak,
        "allocator_step_peak_bytes": allocator_peak,  # TensorFlow on CPU only
        "xla_planned_bytes": planned,  # JAX: temp + outputs of one execution
        "process_peak_bytes": process_peak,  # JAX on a GPU: the counter's, compile included
        "trimmed": trimmed,
        "baseline_rss_bytes": baseline,
        "memory_method": method,
        "seconds": statistics.median(times),
        "cpu_seconds": statistics.median(cpu_times),  # all the process's threads
        "loss": values[0],
        "grad_norms": values[1:],
    }


def _chunk_of(args, variant: str) -> int | None:
    """The chunk a run uses: ``--chunk-size``, else None for the fused path (its default)
    and, for the floors, the chunk the fused path chooses."""
    if args.chunk is not None or variant not in (*FLOORS, "chunked"):
        return args.chunk
    from numstab.backends import load_backend
    from numstab.fused_cross_entropy import default_chunk_size

    be = load_backend(args.backend)
    budget = be.fused_chunk_bytes_gpu if args.device == "gpu" else be.fused_chunk_bytes
    return default_chunk_size(args.tokens, args.vocab, budget)


def interleaved_worker(args) -> dict:
    """Time only, in one process: unfused, fused and (where the backend has one) the time
    floor, one step each per round in an order rotating from round to round, ``--interleaved``
    rounds after an untimed step each. Per-round ratios over that round's unfused step, so
    a load that drifts between rounds moves both sides of each ratio."""
    gpu = args.device == "gpu"
    hidden, weight, labels = _inputs(args.tokens, args.d_model, args.vocab)
    floor = TIME_FLOORS.get(args.backend)
    variants = ("unfused", "fused", *([floor] if floor else []))
    steps = {}
    for variant in variants:
        step = STEPS[args.backend](
            variant, hidden, weight, labels, _chunk_of(args, variant), gpu, args.dtype
        )[0]
        step()  # traced, compiled, warm
        steps[variant] = step
    seconds = {variant: [] for variant in variants}
    gc.disable()
    for i in range(args.interleaved):
        for variant in variants[i % len(variants) :] + variants[: i % len(variants)]:
            start = time.perf_counter()
            steps[variant]()
            seconds[variant].append(time.perf_counter() - start)
    gc.enable()
    return {"backend": args.backend, "variant": "interleaved", "seconds": seconds}


def _interleaved_row(run: dict) -> dict:
    """Median and quartiles of the per-round ratios: fused / unfused, and with a time floor,
    floor / unfused and fused / floor."""
    t = run["seconds"]

    def ratios(a, b):
        per_round = [x / y for x, y in zip(t[a], t[b], strict=True)]
        q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        return statistics.median(per_round), q[0], q[2]

    row = {"backend": run["backend"], "rounds": len(t["unfused"])}
    row["time_ratio"], row["q1"], row["q3"] = ratios("fused", "unfused")
    row |= {"time_goal": TIME_GOAL, "meets_time_goal": row["time_ratio"] <= TIME_GOAL}
    floor = TIME_FLOORS.get(run["backend"])
    if floor in t:
        row["time_floor_ratio"] = ratios(floor, "unfused")[0]
        row["fused_over_time_floor"] = ratios("fused", floor)[0]
    return row


def _print_interleaved(row: dict) -> None:
    text = (
        f"{row['backend']}: interleaved ({row['rounds']} rounds, one process) fused/unfused "
        f"{row['time_ratio']:.3f} (q1-q3 {row['q1']:.2f}-{row['q3']:.2f}), "
        f"time {'ok' if row['meets_time_goal'] else 'OVER'}"
    )
    if "time_floor_ratio" in row:
        text += (
            f"; time floor/unfused {row['time_floor_ratio']:.3f}, "
            f"fused/time floor {row['fused_over_time_floor']:.3f}"
        )
    print(text)


def _peak(gpu, gpu_stats, method, baseline, before) -> int:
    return gpu_stats(reset=False) - before if gpu else _high_water_mark(method) - baseline


# -- parent: one subprocess per run, then the table ---------------------------------------------
def _run_worker(args, backend, variant) -> dict:
    command = [
        sys.executable, __file__, "--worker", "--backend", backend, "--variant", variant,
        "--device", args.device, "--tokens", str(args.tokens), "--d-model", str(args.d_model),
        "--vocab", str(args.vocab), "--repeats", str(args.repeats), "--dtype", args.dtype,
    ]  # fmt: skip
    if args.chunk is not None:
        command += ["--chunk-size", str(args.chunk)]
    if variant == "interleaved":
        command += ["--interleaved", str(args.interleaved)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               TF_FORCE_GPU_ALLOW_GROWTH="true")  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"backend": backend, "variant": variant, "error": done.stderr.strip()[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


#: relative agreement of the fused loss and gradient norms with the unfused ones: bfloat16's
#: unfused gradients are rounded per product, the fused ones accumulate in float32 (§11)
AGREEMENT = {"float32": 1e-3, "bfloat16": 2e-2}


def _agree(a: dict, b: dict, rtol: float = AGREEMENT["float32"]) -> bool:
    pairs = [(a["loss"], b["loss"]), *zip(a["grad_norms"], b["grad_norms"], strict=True)]
    return all(abs(x - y) <= rtol * max(abs(y), 1e-12) for x, y in pairs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="2048 tokens, d 128, vocab 32768")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--chunk-size", dest="chunk", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="float32 on cpu, bfloat16 on gpu"
    )
    parser.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time unfused, fused and the time floor in one process, interleaved",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.backends = ",".join(check_backends(parser, args.backends, BACKENDS))
    defaults = (2048, 128, 32768) if args.quick else (4096, 1024, 65536)
    if args.device == "gpu" and not args.quick:
        defaults = (32768, 4096, 131072)  # issue 20's GPU shape, in bfloat16
    args.dtype = args.dtype or ("bfloat16" if args.device == "gpu" else "float32")
    args.tokens = args.tokens or defaults[0]
    args.d_model = args.d_model or defaults[1]
    args.vocab = args.vocab or defaults[2]
    if args.worker:
        run = interleaved_worker if args.variant == "interleaved" else worker
        print(json.dumps(run(args)))
        return 0
    if args.device == "gpu":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _device import gpu_missing_in_subprocess

        if missing := gpu_missing_in_subprocess(args.backends.split(",")):
            parser.error("--device gpu: " + "; ".join(missing) + ".")

    how = (
        "framework peak counter (bytes above those in use before the step)"
        if args.device == "gpu"
        else "process RSS high-water mark (VmHWM, reset via /proc/self/clear_refs just before "
        "the step; ru_maxrss where that is unavailable) minus the RSS at the reset"
    )
    print(
        f"fused vs unfused linear cross-entropy, fwd+bwd (grads of hidden and weight), "
        f"{args.dtype}, tokens={args.tokens} d_model={args.d_model} vocab={args.vocab} "
        f"chunk_size={args.chunk or 'default'}, device={args.device}, "
        f"median of {args.repeats}; python {platform.python_version()}"
    )
    print(f"peak memory: {how}; one subprocess per run")
    print("modes: torch eager, jax.jit, tf.function\n")
    header = (
        f"{'backend':<11}{'unfused MiB':>12}{'fused MiB':>10}{'floor MiB':>10}{'fused/floor':>12}"
        f"{'compile MiB':>12}{'unfused s':>10}{'fused s':>9}{'time ratio':>11}{'cpu ratio':>10}"
        "  verdict"
    )
    print(header)
    print("-" * len(header))
    results, rows, failed = [], [], False
    for backend in args.backends.split(","):
        variants = (
            *VARIANTS,
            *([F32_SUM_FLOOR] if args.dtype != "float32" else []),
            *([TIME_FLOORS[backend]] if backend in TIME_FLOORS else []),
        )
        runs = {variant: _run_worker(args, backend, variant) for variant in variants}
        results += list(runs.values())
        errors = [r for r in runs.values() if "error" in r]
        if errors:
            failed = True
            for r in errors:
                print(f"{backend:<11}{r['variant']} FAILED:\n{r['error']}")
            continue
        row = _row(backend, runs, AGREEMENT[args.dtype])
        rows.append(row)
        failed |= not row["agree"]
        print(
            f"{backend:<11}{row['unfused_mib']:>12.0f}{row['fused_mib']:>10.0f}"
            f"{row['floor_mib']:>10.0f}{row['ratio']:>12.3f}{row['compile_mib']:>12.0f}"
            f"{row['unfused_s']:>10.3f}{row['fused_s']:>9.3f}{row['time_ratio']:>11.2f}"
            f"{row['cpu_time_ratio']:>10.2f}  {row['verdict']}"
        )
    for row in rows:
        _print_f32_sum_floor(row)
        _print_time_floor(row)
    for row in rows:
        if args.interleaved:
            run = _run_worker(args, row["backend"], "interleaved")
            results.append(run)
            if "error" in run:
                failed = True
                print(f"{row['backend']} interleaved FAILED:\n{run['error']}")
                continue
            row["interleaved"] = _interleaved_row(run)
            _print_interleaved(row["interleaved"])
    print(
        f"\ngoals (issue 20, goal 5): fused/floor <= {MEMORY_GOAL:.2f} (per-step peaks), "
        f"time ratio fused/unfused <= {TIME_GOAL:.2f}"
    )
    print(
        "MiB: each run's step peak, compilation apart (the larger of the first step's and the "
        "timed steps', freed memory returned to the OS before each; TensorFlow on CPU: its "
        "allocator's peak counter); floor: a run of one chunk "
        "of the fused algorithm in plain framework ops (both gradients allocated, one chunk of "
        "float32 logits, its softmax and products; JAX: held together by an optimization "
        "barrier), what any chunked path holds at least; "
        "compile MiB: the fused run's one-off memory (jit compilation; TensorFlow: its first "
        "step's RSS over its step peak)"
    )
    dump_json(args.json, {"args": vars(args), "rows": rows, "results": results})
    return 1 if failed else 0


def _step_peak(run: dict) -> int:
    """A step's peak: the larger of the first step's (compilation apart) and the timed
    steps'; for TensorFlow on CPU its allocator's peak over the timed steps (its RSS keeps
    what it freed, and its first step also builds the executor)."""
    if run.get("allocator_step_peak_bytes") is not None:
        return run["allocator_step_peak_bytes"]
    return max(run["peak_bytes"], run["step_peak_bytes"] or 0)


def _one_off(run: dict) -> int:
    """The fused run's one-off memory: jit compilation, or for TensorFlow on CPU its first
    step's RSS over its allocator's step peak (tracing, graph optimisation, executor)."""
    if run.get("allocator_step_peak_bytes") is not None:
        return max(run["peak_bytes"] - run["allocator_step_peak_bytes"], 0)
    return run["compile_peak_bytes"]


def _row(backend: str, runs: dict, rtol: float) -> dict:
    """One table row: fused per-step peak over the floor's, time over unfused, the goals."""
    u, f, fl = runs["unfused"], runs["fused"], runs["floor"]
    mem = _step_peak(f) / max(_step_peak(fl), 1)
    speed = f["seconds"] / u["seconds"]
    agree = _agree(f, u, rtol)
    if not agree:
        verdict = f"WRONG: fused {f['loss']}, {f['grad_norms']} vs {u}"
    else:
        verdict = (
            f"memory {'ok' if mem <= MEMORY_GOAL else 'OVER'}, "
            f"time {'ok' if speed <= TIME_GOAL else 'OVER'}"
        )
    return {
        "backend": backend,
        "unfused_mib": _step_peak(u) / 2**20,
        "fused_mib": _step_peak(f) / 2**20,
        "floor_mib": _step_peak(fl) / 2**20,
        "compile_mib": _one_off(f) / 2**20,
        "fused_over_unfused_memory": _step_peak(f) / max(_step_peak(u), 1),
        "ratio": mem,
        "goal": MEMORY_GOAL,
        "meets_goal": agree and mem <= MEMORY_GOAL,
        "unfused_s": u["seconds"],
        "fused_s": f["seconds"],
        "floor_s": fl["seconds"],
        "time_ratio": speed,
        "cpu_time_ratio": f["cpu_seconds"] / u["cpu_seconds"],
        "time_goal": TIME_GOAL,
        "meets_time_goal": agree and speed <= TIME_GOAL,
        "agree": agree,
        "verdict": verdict,
        **_f32_sum_floor(runs.get(F32_SUM_FLOOR), f, agree),
        **_time_floor(runs.get(TIME_FLOORS.get(backend)), u, f, rtol),
    }


def _f32_sum_floor(t: dict | None, f: dict, agree: bool) -> dict:
    """For 16-bit inputs: the fused peak over the floor that sums dweight in float32."""
    if t is None:
        return {}
    ratio = _step_peak(f) / max(_step_peak(t), 1)
    return {
        "f32_sum_floor_mib": _step_peak(t) / 2**20,
        "ratio_f32_sum_floor": ratio,
        "meets_goal_f32_sum_floor": agree and ratio <= MEMORY_GOAL,
    }


def _print_f32_sum_floor(row: dict) -> None:
    if "f32_sum_floor_mib" not in row:
        return
    met = "met" if row["meets_goal_f32_sum_floor"] else "OVER"
    print(
        f"{row['backend']}: floor with dweight summed in float32 "
        f"{row['f32_sum_floor_mib']:.0f} MiB, fused/that floor "
        f"{row['ratio_f32_sum_floor']:.3f} (goal {MEMORY_GOAL:.2f}: {met})"
    )


def _time_floor(t: dict | None, u: dict, f: dict, rtol: float) -> dict:
    """The chunked time floor's columns (where the backend has one): its time over unfused
    (what any chunked path pays at that chunk) and the fused time over it."""
    if t is None:
        return {}
    return {
        "time_floor_chunk": t["chunk"],
        "time_floor_s": t["seconds"],
        "time_floor_ratio": t["seconds"] / u["seconds"],  # floor / unfused
        "time_floor_cpu_ratio": t["cpu_seconds"] / u["cpu_seconds"],
        "fused_over_time_floor": f["seconds"] / t["seconds"],
        "fused_over_time_floor_cpu": f["cpu_seconds"] / t["cpu_seconds"],
        "time_floor_meets_goal": t["seconds"] / u["seconds"] <= TIME_GOAL,
        "time_floor_agrees": _agree(t, u, rtol),
    }


def _print_time_floor(row: dict) -> None:
    if "time_floor_s" not in row:
        return
    print(
        f"{row['backend']}: time floor (every chunk in plain ops, {row['time_floor_chunk']} rows) "
        f"{row['time_floor_s']:.3f} s, floor/unfused {row['time_floor_ratio']:.2f} "
        f"(cpu {row['time_floor_cpu_ratio']:.2f}); fused/floor {row['fused_over_time_floor']:.2f} "
        f"(cpu {row['fused_over_time_floor_cpu']:.2f})"
        + ("" if row["time_floor_agrees"] else "; floor WRONG (disagrees with unfused)")
        + ("" if row["time_floor_meets_goal"] else f"; the floor itself is over {TIME_GOAL:.2f}")
    )


if __name__ == "__main__":
    sys.exit(main())
