"""Peak memory and time of fused_linear_cross_entropy against the unfused path, per backend.

What is measured
----------------
Forward + backward of a mean cross-entropy of ``hidden @ weight.T`` (float32 hidden [tokens,
d_model], weight [vocab, d_model], integer labels with ~5% ``ignore_index`` rows), gradients
with respect to hidden and weight:

* unfused: ``numstab.cross_entropy(hidden @ weight.T, labels)`` (the full logits exist);
* fused: ``numstab.fused_linear_cross_entropy(hidden, weight, labels)`` (default chunk size).

torch runs eagerly (``loss.backward()``), jax under ``jax.jit`` around ``jax.value_and_grad``,
tensorflow under ``tf.function`` around a ``GradientTape``: the way each is normally trained.
jax and tensorflow return the loss and the gradients' norms from the compiled step (computed
eagerly, ``jnp.linalg.norm(dw)`` would hold a squared copy of the weight gradient and count it).
Default shapes: tokens 4096, d_model 1024, vocab 65536 on CPU; 32768 tokens and vocab 131072
with ``--device gpu``; ``--quick``: 2048 x 128 x 32768.

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
  softmax, their gradients, the gradients of hidden and weight, and jit / tf.function
  compilation memory (paid once, counted in full). tracemalloc would be blind to the
  frameworks' native allocators, so it is not used.
* ``per step``: the same ratio over the timed steps that follow, which is what a training
  loop holds at every step after the first. Before them the freed memory goes back to the OS
  (glibc ``malloc_trim(0)``) and the mark is reset again, so that memory kept by the
  allocator cannot hide the step's own allocations; without ``malloc_trim`` (and for JAX on
  GPU, whose peak counter cannot be reset) it prints n/a. The verdict uses the first step.
* GPU peak memory = the framework's own peak counter, reset before the step:
  ``torch.cuda.max_memory_allocated``, ``jax Device.memory_stats()["peak_bytes_in_use"]``,
  ``tf.config.experimental.get_memory_info("GPU:0")["peak"]``, minus the bytes in use before
  the step.
* Time: the median of ``--repeats`` timed steps after one untimed warm-up step (which also
  compiles), each ending with a device sync; the garbage collector is paused while timing.
* Before the numbers are trusted, the fused loss and gradient norms are compared with the
  unfused ones (relative 1e-3): a fast but wrong kernel would be reported as WRONG.

Goals on CPU: peak memory fused/unfused <= 1/8 (0.125), time fused/unfused <= 1.3. Numbers are
printed, never asserted. The ``floor`` column is the smallest ratio any implementation can reach:
the bytes of the two gradients every path must return (hidden's and weight's, float32) over the
unfused peak; where it exceeds 1/8 (a lean unfused path, few tokens per vocabulary row) the
memory goal is out of reach at that shape, and fused - floor is what the chunking still holds.

Usage: python benchmarks/memory.py [--backends torch,jax,tensorflow] [--device cpu|gpu]
       [--quick] [--repeats 3] [--tokens N --d-model D --vocab V] [--chunk-size C] [--json P]
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

BACKENDS = ("torch", "jax", "tensorflow")
VARIANTS = ("unfused", "fused")
MEMORY_GOAL, TIME_GOAL = 1 / 8, 1.3


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


def _torch_step(variant, hidden, weight, labels, chunk, gpu):
    import torch

    import numstab as ns
    from numstab.fused_cross_entropy import fused_linear_cross_entropy

    device = "cuda" if gpu else "cpu"
    h = torch.from_numpy(hidden).to(device).requires_grad_(True)
    w = torch.from_numpy(weight).to(device).requires_grad_(True)
    y = torch.from_numpy(labels).to(device)

    def loss_fn():
        if variant == "fused":
            return fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
        return ns.cross_entropy(h @ w.T, y)

    def step():
        loss = loss_fn()
        dh, dw = torch.autograd.grad(loss, [h, w])
        if gpu:
            torch.cuda.synchronize()
        return float(loss), float(dh.norm()), float(dw.norm())

    def gpu_stats(reset):
        if reset:
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return torch.cuda.max_memory_allocated()

    return step, gpu_stats


def _jax_step(variant, hidden, weight, labels, chunk, gpu):
    import jax
    import jax.numpy as jnp

    import numstab as ns
    from numstab.fused_cross_entropy import fused_linear_cross_entropy

    device = jax.devices("gpu" if gpu else "cpu")[0]
    h, w, y = (jax.device_put(jnp.asarray(a), device) for a in (hidden, weight, labels))

    def loss_fn(h, w):
        if variant == "fused":
            return fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
        return ns.cross_entropy(h @ w.T, y)

    @jax.jit
    def value_and_grad(h, w):  # the norms inside: eagerly, norm(dw) would square dw into a copy
        loss, (dh, dw) = jax.value_and_grad(loss_fn, argnums=(0, 1))(h, w)
        return loss, jnp.linalg.norm(dh), jnp.linalg.norm(dw)

    def step():
        return tuple(float(v) for v in value_and_grad(h, w))

    def gpu_stats(reset):
        stats = device.memory_stats()
        return stats["bytes_in_use"] if reset else stats["peak_bytes_in_use"]

    return step, gpu_stats


def _tensorflow_step(variant, hidden, weight, labels, chunk, gpu):
    import tensorflow as tf

    import numstab as ns
    from numstab.fused_cross_entropy import fused_linear_cross_entropy

    name = "/GPU:0" if gpu else "/CPU:0"
    with tf.device(name):
        h, w, y = (tf.constant(a) for a in (hidden, weight, labels))

    @tf.function
    def value_and_grad(h, w):
        with tf.GradientTape() as tape:
            tape.watch([h, w])
            if variant == "fused":
                loss = fused_linear_cross_entropy(h, w, y, chunk_size=chunk)
            else:
                loss = ns.cross_entropy(tf.matmul(h, w, transpose_b=True), y)
        dh, dw = tape.gradient(loss, [h, w])
        return loss, tf.norm(dh), tf.norm(dw)

    def step():
        with tf.device(name):
            return tuple(float(v) for v in value_and_grad(h, w))

    def gpu_stats(reset):
        if reset:
            tf.config.experimental.reset_memory_stats("GPU:0")
            return tf.config.experimental.get_memory_info("GPU:0")["current"]
        return tf.config.experimental.get_memory_info("GPU:0")["peak"]

    return step, gpu_stats


def _tiny_warmup(backend, gpu):
    """Touch the framework's kernels once on tiny inputs, so that their one-off memory (thread
    pools, code pages) falls into the baseline rather than into either variant."""
    import numstab as ns

    hidden, weight, labels = _inputs(8, 4, 16)
    step, _ = STEPS[backend]("unfused", hidden, weight, labels, None, gpu)
    step()
    del ns


STEPS = {"torch": _torch_step, "jax": _jax_step, "tensorflow": _tensorflow_step}


def worker(args) -> dict:
    gpu = args.device == "gpu"
    _tiny_warmup(args.backend, gpu)
    hidden, weight, labels = _inputs(args.tokens, args.d_model, args.vocab)
    step, gpu_stats = STEPS[args.backend](args.variant, hidden, weight, labels, args.chunk, gpu)
    del hidden, weight, labels  # the framework holds its own copies
    gc.collect()
    method, baseline = _reset_high_water_mark()
    before = gpu_stats(reset=True) if gpu else 0
    values = step()  # warm-up, also compiles; its peak counts
    peak = (gpu_stats(reset=False) - before) if gpu else (_high_water_mark(method) - baseline)
    # the timed steps' peak: what every later step holds, without the one-off compilation
    # (JAX's GPU peak counter cannot be reset, and without malloc_trim freed memory would
    # hide the step's own allocations: no number then)
    gc.collect()
    per_step = not (gpu and args.backend == "jax") and (gpu or _return_freed_memory())
    if per_step:
        method, baseline = _reset_high_water_mark()
        before = gpu_stats(reset=True) if gpu else 0
    times = []
    gc.disable()
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    gc.enable()
    step_peak = None
    if per_step:
        step_peak = gpu_stats(reset=False) - before if gpu else _high_water_mark(method) - baseline
    return {
        "backend": args.backend,
        "variant": args.variant,
        "peak_bytes": peak,
        "step_peak_bytes": step_peak,
        "baseline_rss_bytes": baseline,
        "memory_method": "framework peak counter" if gpu else method,
        "seconds": statistics.median(times),
        "loss": values[0],
        "grad_norms": values[1:],
    }


# -- parent: one subprocess per run, then the table ---------------------------------------------
def _run_worker(args, backend, variant) -> dict:
    command = [
        sys.executable, __file__, "--worker", "--backend", backend, "--variant", variant,
        "--device", args.device, "--tokens", str(args.tokens), "--d-model", str(args.d_model),
        "--vocab", str(args.vocab), "--repeats", str(args.repeats),
    ]  # fmt: skip
    if args.chunk is not None:
        command += ["--chunk-size", str(args.chunk)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               TF_FORCE_GPU_ALLOW_GROWTH="true")  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"backend": backend, "variant": variant, "error": done.stderr.strip()[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _agree(a: dict, b: dict) -> bool:
    pairs = [(a["loss"], b["loss"]), *zip(a["grad_norms"], b["grad_norms"], strict=True)]
    return all(abs(x - y) <= 1e-3 * max(abs(y), 1e-12) for x, y in pairs)


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
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (2048, 128, 32768) if args.quick else (4096, 1024, 65536)
    if args.device == "gpu" and not args.quick:
        defaults = (32768, 1024, 131072)
    args.tokens = args.tokens or defaults[0]
    args.d_model = args.d_model or defaults[1]
    args.vocab = args.vocab or defaults[2]
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    how = (
        "framework peak counter (bytes above those in use before the step)"
        if args.device == "gpu"
        else "process RSS high-water mark (VmHWM, reset via /proc/self/clear_refs just before "
        "the step; ru_maxrss where that is unavailable) minus the RSS at the reset"
    )
    print(
        f"fused vs unfused linear cross-entropy, fwd+bwd (grads of hidden and weight), float32, "
        f"tokens={args.tokens} d_model={args.d_model} vocab={args.vocab} "
        f"chunk_size={args.chunk or 'default'}, device={args.device}, "
        f"median of {args.repeats}; python {platform.python_version()}"
    )
    print(f"peak memory: {how}; one subprocess per row")
    print("modes: torch eager, jax.jit, tf.function\n")
    header = (
        f"{'backend':<11}{'unfused MiB':>12}{'fused MiB':>11}{'mem ratio':>11}{'floor':>7}"
        f"{'per step':>10}{'unfused s':>11}{'fused s':>9}{'time ratio':>12}  verdict"
    )
    print(header)
    print("-" * len(header))
    results, failed = [], False
    for backend in args.backends.split(","):
        runs = {variant: _run_worker(args, backend, variant) for variant in VARIANTS}
        results += list(runs.values())
        errors = [r for r in runs.values() if "error" in r]
        if errors:
            failed = True
            for r in errors:
                print(f"{backend:<11}{r['variant']} FAILED:\n{r['error']}")
            continue
        u, f = runs["unfused"], runs["fused"]
        mem = f["peak_bytes"] / max(u["peak_bytes"], 1)
        floor = 4 * args.d_model * (args.tokens + args.vocab) / max(u["peak_bytes"], 1)
        speed = f["seconds"] / u["seconds"]
        steady = "n/a"
        if u["step_peak_bytes"] and f["step_peak_bytes"] is not None:
            steady = f"{f['step_peak_bytes'] / u['step_peak_bytes']:.3f}"
        if not _agree(f, u):
            verdict, failed = f"WRONG: fused {f['loss']}, {f['grad_norms']} vs {u}", True
        else:
            met = [f"memory {'ok' if mem <= MEMORY_GOAL else 'OVER'}"]
            met.append(f"time {'ok' if speed <= TIME_GOAL else 'OVER'}")
            verdict = ", ".join(met)
        print(
            f"{backend:<11}{u['peak_bytes'] / 2**20:>12.0f}{f['peak_bytes'] / 2**20:>11.0f}"
            f"{mem:>11.3f}{floor:>7.3f}{steady:>10}{u['seconds']:>11.3f}{f['seconds']:>9.3f}"
            f"{speed:>12.2f}"
            f"  {verdict}"
        )
    print(f"\ngoals (CPU): mem ratio <= {MEMORY_GOAL:.3f}, time ratio <= {TIME_GOAL}")
    print("floor: (grad of hidden + grad of weight, float32) / unfused peak, the least possible")
    print(
        "per step: the same ratio over the timed steps, after the first (compiling) one, with "
        "freed memory returned to the OS first; the verdict uses the first step's"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
