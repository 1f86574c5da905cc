"""Overhead of numstab against the native calls it wraps, per backend and mode, in one run.

What is measured
----------------
1. ``import numstab``: wall time of the import alone (perf_counter around it), median of 5 fresh
   interpreters, and which frameworks the import pulled in (it should pull in none).
2. Large case: forward + backward of a mean cross-entropy over fp32 logits [tokens, classes]
   (default 4096x32768) and integer labels, numstab.cross_entropy against the native loss:

   ============  ======================================  ======================================
   backend       native, hard labels                     native, label smoothing 0.1
   ============  ======================================  ======================================
   torch         F.cross_entropy                         F.cross_entropy(label_smoothing=0.1)
   jax           optax.softmax_cross_entropy_with_       optax.softmax_cross_entropy(
                 integer_labels(...).mean()              smooth_labels(one_hot, 0.1)).mean()
   tensorflow    reduce_mean(sparse_softmax_cross_       reduce_mean(softmax_cross_entropy_with_
                 entropy_with_logits(...))               logits(smoothed one_hot)), no Keras
   ============  ======================================  ======================================

   Backward is loss.backward() (torch), jax.value_and_grad (jax), tf.GradientTape (tensorflow).
   Modes: eager; compiled, the same function under jax.jit / tf.function for both sides, and
   torch.compile (default inductor) only with --torch-compile, as it is slow to build on CPU.
   The smoothing rows exercise numstab's label-smoothing path, which differs from the hard one.
3. Tiny case: forward only on [8, 16] logits, median microseconds per call, numstab against the
   same native call: the fixed per-call price of numstab's validation and composition.
4. Dispatch: median microseconds of ``numstab.resolve_backend(x)`` alone on a tiny array.
5. Tree operations on a list of fp32 gradients (default 200 tensors, 20M parameters; --tree):
   global_norm, clip_by_global_norm, all_finite, the loss-scaler step (unscale + finite check
   + update) and find_nonfinite (eager only: it reads the host), each against what a user of
   the framework writes without numstab; the table of natives is in _overhead_tree.py. Same
   modes, interleaving, agreement check (rtol 2e-5) and goals as the large case. The
   loss-scaler rows also give the host reads per step of each side ("reads ns/nat", --json
   ``host_reads`` / ``native_host_reads``): device-to-host reads of one untimed call, mean of
   HOST_READ_CALLS, counted by benchmarks/_host_reads.py (on a GPU each is a host sync).

How
---
* numstab and native run in the same process, on the same inputs, interleaved: every round runs
  both, alternating which goes first (AB BA AB ...), so drift (clock, load, allocator state) hits
  both equally. Untimed warmup rounds come first; they also absorb jit / tf.function / inductor
  compilation. Each timed call ends with a device sync (block_until_ready, cuda synchronize,
  sync_devices) and the garbage collector is paused while the clock runs. Reported: the median
  over the timed rounds, ratio = numstab / native, and the quartiles of the per-round ratios
  ("rounds q1-q3"): on a shared 2-core machine a compiled row whose graphs are the same still
  moves by +-5-10% at 7 rounds (e.g. jax.jit global_norm 1.095 at 15 rounds in one run, 0.98
  against optax at 40 rounds in isolation), and the quartiles show it.
* Before any timing, numstab's loss and gradient are asserted equal to native's in the same mode
  (np.testing.assert_allclose, rtol 1e-5, atol 1e-6), so a fast but wrong kernel cannot win.
  Gradients are compared after scaling by tokens * classes: the entries of a mean-reduced
  gradient are about 1 / (tokens * classes), far below atol, and compared unscaled any gradient
  of that size, zero included, would pass. The scaled check implies the unscaled one.
* A round times each side ``calls`` times in a row (enough for ~0.1 s; one call for the
  large case), so a round's ratio averages over the machine's short stalls. Where the
  quartiles of a row's rounds straddle its goal, more rounds are run (up to --max-repeats).
* A row still over its goal also times native against itself, interleaved the same way, for
  as many rounds: the column "floor" is that ratio and its quartiles, the noise floor of the
  comparison in this run (identical work on both sides). A compiled row whose graph does the
  same work as native's (compared op by op in docs/semantics.md) misses its goal only by
  this noise.
* Timings are printed, never asserted. Goals: ratio <= 1.05 eager, <= 1.02 (about 1.00)
  compiled; tiny call overhead <= 10 us over the native loss in torch and JAX, <= 50 us in
  TensorFlow (as a ratio: goal = (native + overhead goal) / native); dispatch at most 10 us
  (as a ratio: ratio = resolve time / 10 us, goal 1). Each row says whether it meets its
  goal; --json rows carry ratio, goal and meets_goal. The JSON file is rewritten after each
  row is measured, so a run stopped part-way (a time limit) leaves the rows measured so far.

Usage: python benchmarks/overhead.py [--backends torch,jax,tensorflow] [--shape 4096x32768]
       [--tree 200x20000000 | --skip-tree] [--repeats 7] [--max-repeats 21] [--device cpu|gpu]
       [--torch-compile]
       [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

import numstab

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _overhead_tree
from _goals import dump_json, goal_row, ratio_text
from _host_reads import counting

BACKENDS = ("torch", "jax", "tensorflow")
ALIASES = {"tf": "tensorflow", "pytorch": "torch"}
DEFAULT_SHAPE = (4096, 32768)
QUICK_SHAPE = (1024, 8192)
TINY_SHAPE = (8, 16)
DEFAULT_TREE, QUICK_TREE = (200, 20_000_000), (50, 1_000_000)  # (tensors, parameters)
DEFAULT_REPEATS, QUICK_REPEATS = 7, 3
DEFAULT_WARMUP, QUICK_WARMUP = 2, 1
CASES = {"hard labels": 0.0, "label smoothing 0.1": 0.1}
RTOL, ATOL = 1e-5, 1e-6
EAGER_GOAL, COMPILED_GOAL, DISPATCH_GOAL_US = 1.05, 1.02, 10.0
IMPORT_SAMPLES = 5
LOAD_WARNING = 0.5  # 1-minute load average above which the report warns of CPU contention
BATCH_SECONDS = 0.05  # tiny calls are timed in batches of about this length
ROUND_SECONDS = 0.1  # a timed round of a large case or tree op lasts at least about this
HOST_READ_CALLS = 3  # untimed calls whose host reads are counted, per side of a scaler row
SCALER_OP = "scaler step"  # the loss-scaler rows: they also count host reads
#: tiny-call goal: microseconds over the native loss (issue 20, goal 2)
TINY_GOAL_US = {"torch": 10.0, "jax": 10.0, "tensorflow": 50.0}

Array = Any
LossFn = Callable[[Array, Array], Array]
Step = Callable[[], Any]  # one timed call; returns what the sync must wait for
StepBuilder = Callable[[LossFn, Array, Array], Step]


class DeviceUnavailableError(RuntimeError):
    """The requested --device is not usable by a requested backend."""


# -- framework harnesses -------------------------------------------------------------------


@dataclass
class Harness:
    """What the benchmark needs from one framework; built only for requested backends."""

    name: str
    version: str
    device: str
    inputs: Callable[[np.ndarray, np.ndarray, bool], tuple[Array, Array]]  # host -> device
    native_loss: Callable[[float], LossFn]  # label_smoothing -> native mean loss
    modes: dict[str, StepBuilder]  # mode -> (loss, logits, labels) -> fwd+bwd step
    sync: Callable[[Any], None]
    to_numpy: Callable[[Array], np.ndarray]


def torch_harness(device: str, with_compile: bool) -> Harness:
    import torch
    import torch.nn.functional as F

    if device == "gpu" and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"--device gpu: torch {torch.__version__} sees no CUDA device "
            "(torch.cuda.is_available() is False)."
        )
    dev = torch.device("cuda" if device == "gpu" else "cpu")

    def inputs(logits: np.ndarray, labels: np.ndarray, grad: bool) -> tuple[Array, Array]:
        x = torch.from_numpy(logits).to(dev).requires_grad_(grad)
        return x, torch.from_numpy(labels).to(dev, torch.int64)

    def native_loss(eps: float) -> LossFn:
        return lambda x, y: F.cross_entropy(x, y, label_smoothing=eps)

    def eager(loss: LossFn, x: Array, y: Array) -> Step:
        def step() -> tuple[Array, Array]:
            x.grad = None  # no accumulation: each step writes a fresh gradient
            value = loss(x, y)
            value.backward()
            return value, x.grad

        return step

    modes: dict[str, StepBuilder] = {"eager": eager}
    if with_compile:
        modes["torch.compile"] = lambda loss, x, y: eager(torch.compile(loss), x, y)

    def sync(_: Any) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    return Harness(
        "torch",
        torch.__version__,
        str(dev),
        inputs,
        native_loss,
        modes,
        sync,
        lambda t: t.detach().cpu().numpy(),
    )


def jax_harness(device: str) -> Harness:
    import jax
    import optax

    try:
        dev = jax.devices("gpu" if device == "gpu" else "cpu")[0]
    except RuntimeError as exc:
        raise DeviceUnavailableError(f"--device {device}: jax has no such device ({exc}).") from exc

    def inputs(logits: np.ndarray, labels: np.ndarray, grad: bool) -> tuple[Array, Array]:
        return jax.device_put(logits, dev), jax.device_put(labels.astype(np.int32), dev)

    def native_loss(eps: float) -> LossFn:
        if not eps:
            return lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

        def smoothed(x: Array, y: Array) -> Array:
            targets = optax.smooth_labels(jax.nn.one_hot(y, x.shape[-1]), eps)
            return optax.softmax_cross_entropy(x, targets).mean()

        return smoothed

    modes: dict[str, StepBuilder] = {
        "eager": lambda loss, x, y: partial(jax.value_and_grad(loss), x, y),
        "jax.jit": lambda loss, x, y: partial(jax.jit(jax.value_and_grad(loss)), x, y),
    }
    return Harness(
        "jax",
        jax.__version__,
        str(dev),
        inputs,
        native_loss,
        modes,
        jax.block_until_ready,
        np.asarray,
    )


def tensorflow_harness(device: str) -> Harness:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf

    if device == "gpu" and not tf.config.list_physical_devices("GPU"):
        raise DeviceUnavailableError(
            f"--device gpu: tensorflow {tf.__version__} sees no GPU "
            "(tf.config.list_physical_devices('GPU') is empty)."
        )
    placement = "/GPU:0" if device == "gpu" else "/CPU:0"

    def inputs(logits: np.ndarray, labels: np.ndarray, grad: bool) -> tuple[Array, Array]:
        with tf.device(placement):
            return tf.identity(logits), tf.identity(labels.astype(np.int32))

    def native_loss(eps: float) -> LossFn:
        if not eps:
            return lambda x, y: tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=x)
            )

        def smoothed(x: Array, y: Array) -> Array:
            k = x.shape[-1]
            targets = tf.one_hot(y, k, dtype=x.dtype) * (1.0 - eps) + eps / k
            return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(targets, x))

        return smoothed

    def value_and_grad(loss: LossFn) -> Callable[[Array, Array], tuple[Array, Array]]:
        def run(x: Array, y: Array) -> tuple[Array, Array]:
            with tf.GradientTape() as tape:
                tape.watch(x)
                value = loss(x, y)
            return value, tape.gradient(value, x)

        return run

    def placed(fn: Callable[[Array, Array], Any], x: Array, y: Array) -> Step:
        def step() -> Any:
            with tf.device(placement):
                return fn(x, y)

        return step

    modes: dict[str, StepBuilder] = {
        "eager": lambda loss, x, y: placed(value_and_grad(loss), x, y),
        "tf.function": lambda loss, x, y: placed(tf.function(value_and_grad(loss)), x, y),
    }

    def sync(_: Any) -> None:
        if device == "gpu":
            tf.test.experimental.sync_devices()

    return Harness(
        "tensorflow",
        tf.__version__,
        placement,
        inputs,
        native_loss,
        modes,
        sync,
        lambda t: t.numpy(),
    )


def make_harness(name: str, args: argparse.Namespace) -> Harness:
    if name == "torch":
        return torch_harness(args.device, args.torch_compile)
    if name == "jax":
        return jax_harness(args.device)
    return tensorflow_harness(args.device)


def numstab_loss(eps: float) -> LossFn:
    return lambda x, y: numstab.cross_entropy(x, y, label_smoothing=eps)


# -- timing --------------------------------------------------------------------------------


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect now, then keep the collector out of the timed region."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def seconds_per_call(step: Step, sync: Callable[[Any], None], calls: int) -> float:
    with gc_paused():
        start = time.perf_counter()
        for _ in range(calls):
            sync(step())
        return (time.perf_counter() - start) / calls


def interleaved_samples(
    a: Step, b: Step, sync: Callable[[Any], None], warmup: int, repeats: int, calls: int = 1
) -> tuple[list[float], list[float]]:
    """Seconds per call of ``a`` and ``b`` in each timed round, run in alternating order
    AB BA AB ..."""
    samples: tuple[list[float], list[float]] = ([], [])
    steps = (a, b)
    for round_ in range(warmup + repeats):
        for i in (0, 1) if round_ % 2 == 0 else (1, 0):
            elapsed = seconds_per_call(steps[i], sync, calls)
            if round_ >= warmup:
                samples[i].append(elapsed)
    return samples


def round_ratio_quartiles(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """First and third quartiles of the per-round ratios ours / theirs: how far the ratio of
    medians moves with the machine's noise (one round = one call of each, side by side)."""
    ratios = sorted(o / t for o, t in zip(ours, theirs, strict=True))
    if len(ratios) < 4:
        return ratios[0], ratios[-1]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return q1, q3


def median_per_call(step: Step, sync: Callable[[Any], None], warmup: int, repeats: int) -> float:
    calls = calls_per_batch(step, sync)
    for _ in range(warmup):
        seconds_per_call(step, sync, calls)
    return statistics.median(seconds_per_call(step, sync, calls) for _ in range(repeats))


def calls_per_batch(step: Step, sync: Callable[[Any], None]) -> int:
    """Enough calls of a fast step for a batch of about BATCH_SECONDS."""
    sync(step())
    once = min(seconds_per_call(step, sync, 1) for _ in range(3))
    return max(1, min(100_000, int(BATCH_SECONDS / max(once, 1e-9))))


# -- correctness ---------------------------------------------------------------------------


def assert_close(got: np.ndarray, want: np.ndarray, scale: float, what: str) -> None:
    np.testing.assert_allclose(
        np.asarray(got, np.float64) * scale,
        np.asarray(want, np.float64) * scale,
        rtol=RTOL,
        atol=ATOL,
        err_msg=f"{what}: numstab differs from native",
    )


def assert_same_step(h: Harness, ours: Step, theirs: Step, scale: float, where: str) -> None:
    """numstab's (loss, gradient) equals native's; the gradient compared times ``scale``."""
    (loss_a, grad_a), (loss_b, grad_b) = ours(), theirs()
    assert_close(h.to_numpy(loss_a), h.to_numpy(loss_b), 1.0, f"{where} loss")
    assert_close(h.to_numpy(grad_a), h.to_numpy(grad_b), scale, f"{where} gradient")


# -- measurements --------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    backend: str
    mode: str
    numstab_ms: float
    native_ms: float
    ratio: float
    goal: float
    meets_goal: bool
    round_ratios_q1_q3: tuple[float, float]
    rounds: int = 0
    calls_per_round: int = 1
    # rows over their goal: native against itself, interleaved the same way (identical work):
    # the noise floor of the comparison in this run, median and quartiles of its rounds
    floor: float | None = None
    floor_q1_q3: tuple[float, float] | None = None
    # loss-scaler rows: device-to-host reads per call of each side (benchmarks/_host_reads.py)
    host_reads: float | None = None
    native_host_reads: float | None = None


def host_reads_per_call(framework: str, step: Step, calls: int = HOST_READ_CALLS) -> float:
    """Mean device-to-host reads of one call of ``step`` (``framework``'s arrays), counted by
    benchmarks/_host_reads.py over ``calls`` calls; no sync is counted, only the call."""
    with counting(framework) as reads:
        for _ in range(calls):
            step()
    return reads.count / calls


def rounds_and_calls(step: Step, sync: Callable[[Any], None]) -> int:
    """Calls per timed round: enough for about ROUND_SECONDS (one for slow steps), so that a
    round's ratio averages over the machine's short stalls."""
    start = time.perf_counter()
    sync(step())
    once = time.perf_counter() - start
    return max(1, min(1000, int(ROUND_SECONDS / max(once, 1e-9))))


def straddles(ours: list[float], theirs: list[float], goal: float) -> bool:
    """True while the quartiles of the per-round ratios lie on both sides of ``goal``."""
    q1, q3 = round_ratio_quartiles(ours, theirs)
    return q1 <= goal < q3


def timed_row(
    h: Harness,
    case: str,
    mode: str,
    ours: Step,
    theirs: Step,
    warmup: int,
    repeats: int,
    max_repeats: int | None = None,
) -> Row:
    """One table row: medians of interleaved rounds, their ratio and its goal. While the
    rounds' quartiles straddle the goal, more rounds are run (up to ``max_repeats``); a row
    still over its goal then times native against itself, the floor noise sets."""
    goal = EAGER_GOAL if mode == "eager" else COMPILED_GOAL
    calls = rounds_and_calls(theirs, h.sync)
    t_ours, t_theirs = interleaved_samples(ours, theirs, h.sync, warmup, repeats, calls)
    max_repeats = max(max_repeats or repeats, repeats)
    while len(t_ours) < max_repeats and straddles(t_ours, t_theirs, goal):
        more = min(max(2, repeats // 2), max_repeats - len(t_ours))
        extra = interleaved_samples(ours, theirs, h.sync, 0, more, calls)
        t_ours += extra[0]
        t_theirs += extra[1]
    m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    ratio = m_ours / m_theirs
    spread = round_ratio_quartiles(t_ours, t_theirs)
    row = Row(
        case, h.name, mode, 1e3 * m_ours, 1e3 * m_theirs, ratio, goal, ratio <= goal, spread,
        len(t_ours), calls,
    )  # fmt: skip
    if not row.meets_goal:
        a, b = interleaved_samples(theirs, theirs, h.sync, 1, len(t_ours), calls)
        row.floor = statistics.median(a) / statistics.median(b)
        row.floor_q1_q3 = round_ratio_quartiles(a, b)
    return row


@dataclass
class TinyRow:
    backend: str
    numstab_us: float
    native_us: float
    overhead_us: float
    overhead_q1_q3_us: tuple[float, float]
    overhead_goal_us: float
    ratio: float  # numstab / native
    goal: float  # the ratio at which the overhead is overhead_goal_us
    meets_goal: bool


@dataclass
class DispatchRow:
    backend: str
    array_type: str
    resolve_us: float
    ratio: float  # resolve_us / DISPATCH_GOAL_US: the share of its budget
    goal: float  # 1.0: resolve_us at most DISPATCH_GOAL_US
    meets_goal: bool


def make_data(shape: tuple[int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(shape, dtype=np.float32) * 2.0
    labels = rng.integers(0, shape[1], size=shape[0])
    return logits, labels


def bench_large(
    h: Harness,
    data: tuple[np.ndarray, np.ndarray],
    warmup: int,
    repeats: int,
    most: int,
    done: Callable[[Row], Any] = lambda row: None,
) -> list[Row]:
    """The cross-entropy rows of ``h``, each handed to ``done`` once measured."""
    tokens, classes = data[0].shape
    x, y = h.inputs(*data, True)
    rows = []
    for case, eps in CASES.items():
        for mode, build in h.modes.items():
            where = f"{h.name} {mode} {case}"
            print(f"  {where} ...", flush=True)
            ours = build(numstab_loss(eps), x, y)
            theirs = build(h.native_loss(eps), x, y)
            assert_same_step(h, ours, theirs, float(tokens * classes), where)
            rows.append(timed_row(h, case, mode, ours, theirs, warmup, repeats, most))
            _print_done(rows[-1])
            done(rows[-1])
    return rows


def _print_done(row: Row) -> None:
    """The row's ratio as soon as it is measured: a run stopped at a time limit keeps it."""
    ratio = ratio_text(row.ratio, row.goal)
    print(f"    ratio {ratio} (goal {row.goal}, {row.rounds} rounds)", flush=True)


def bench_tree(
    h: Harness,
    host: list[np.ndarray],
    device: str,
    warmup: int,
    repeats: int,
    most: int,
    done: Callable[[Row], Any] = lambda row: None,
) -> list[Row]:
    """The tree operations of _overhead_tree, in every mode of the harness, each row handed
    to ``done`` once measured."""
    rows = []
    for mode in h.modes:
        pairs = _overhead_tree.PAIRS[h.name](host, device, compiled=mode != "eager")
        for op, (ours, theirs) in pairs.items():
            where = f"{h.name} {mode} {op}"
            print(f"  {where} ...", flush=True)
            _overhead_tree.assert_agree(where, _host(h, ours()), _host(h, theirs()))
            row = timed_row(h, op, mode, ours, theirs, warmup, repeats, most)
            if op == SCALER_OP:  # after the timing: compiled, warm
                row.host_reads = host_reads_per_call(h.name, ours)
                row.native_host_reads = host_reads_per_call(h.name, theirs)
            rows.append(row)
            _print_done(row)
            done(row)
    return rows


def _host(h: Harness, tree: Any) -> Any:
    """Every framework array of a (nested tuple/list) result as NumPy."""
    if isinstance(tree, tuple | list):
        return [_host(h, x) for x in tree]
    return tree if isinstance(tree, int | float | bool) else h.to_numpy(tree)


def bench_tiny(h: Harness, warmup: int, repeats: int) -> tuple[TinyRow, DispatchRow]:
    x, y = h.inputs(*make_data(TINY_SHAPE, seed=1), False)
    ours, theirs = partial(numstab_loss(0.0), x, y), partial(h.native_loss(0.0), x, y)
    assert_close(h.to_numpy(ours()), h.to_numpy(theirs()), 1.0, f"{h.name} tiny loss")
    calls = calls_per_batch(theirs, h.sync)
    s_ours, s_theirs = interleaved_samples(ours, theirs, h.sync, warmup, repeats, calls)
    t_ours, t_theirs = statistics.median(s_ours), statistics.median(s_theirs)
    overhead = sorted(1e6 * (o - t) for o, t in zip(s_ours, s_theirs, strict=True))
    quartiles = statistics.quantiles(overhead, n=4)[::2] if len(overhead) >= 4 else overhead
    goal_us = TINY_GOAL_US[h.name]
    tiny = TinyRow(
        h.name,
        1e6 * t_ours,
        1e6 * t_theirs,
        1e6 * (t_ours - t_theirs),
        (quartiles[0], quartiles[-1]),
        goal_us,
        t_ours / t_theirs,
        (t_theirs + 1e-6 * goal_us) / t_theirs,
        1e6 * (t_ours - t_theirs) <= goal_us,
    )
    return tiny, bench_dispatch(h.name, x, warmup, repeats)


def bench_dispatch(name: str, x: Array, warmup: int, repeats: int) -> DispatchRow:
    seconds = median_per_call(partial(numstab.resolve_backend, x), lambda _: None, warmup, repeats)
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    row = goal_row(name, 1e6 * seconds / DISPATCH_GOAL_US, 1.0)
    return DispatchRow(name, kind, 1e6 * seconds, row["ratio"], row["goal"], row["meets_goal"])


IMPORT_SNIPPET = """\
import sys, time
start = time.perf_counter()
import numstab
elapsed = time.perf_counter() - start
print(elapsed)
print(",".join(m for m in ("numpy", "torch", "tensorflow", "jax") if m in sys.modules))
"""


def measure_import() -> dict[str, Any]:
    """Median ``import numstab`` time over fresh interpreters, and what it imported."""
    seconds, imported = [], ""
    for _ in range(IMPORT_SAMPLES):
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_SNIPPET], capture_output=True, text=True, check=True
        ).stdout.split("\n")
        seconds.append(float(out[0]))
        imported = out[1]
    return {
        "median_ms": 1e3 * statistics.median(seconds),
        "samples_ms": [1e3 * s for s in seconds],
        "modules_imported": imported.split(",") if imported else [],
    }


# -- report --------------------------------------------------------------------------------


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: text columns left-aligned, numeric ones right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return " | ".join(
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(cells, widths, numeric, strict=True)
        ).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


def ratio_table(first: str, rows: list[Row]) -> str:
    """The numstab-vs-native table; ``first`` names the first column (case or op). ``floor``:
    native timed against itself the same way, for rows over their goal (``-`` elsewhere).
    ``reads ns/nat``: host reads per call of numstab and native, where counted."""
    headers = [
        first, "backend", "mode", "numstab ms", "native ms", "ratio", "rounds q1-q3", "rounds",
        "goal", "meets", "floor (q1-q3)",
    ]  # fmt: skip
    reads = any(r.host_reads is not None for r in rows)
    return format_table(
        headers + ["reads ns/nat"] * reads,
        [
            [
                r.case,
                r.backend,
                r.mode,
                f"{r.numstab_ms:.2f}",
                f"{r.native_ms:.2f}",
                ratio_text(r.ratio, r.goal),
                _span(r.round_ratios_q1_q3),
                f"{r.rounds}x{r.calls_per_round}",
                f"<= {r.goal:.2f}",
                _mark(r.meets_goal),
                "-" if r.floor is None else f"{r.floor:.3f} ({_span(r.floor_q1_q3)})",
            ]
            + [_reads(r)] * reads
            for r in rows
        ],
    )


def _reads(r: Row) -> str:
    if r.host_reads is None or r.native_host_reads is None:
        return "-"
    return f"{r.host_reads:g}/{r.native_host_reads:g}"


def _span(pair: tuple[float, float] | None, digits: int = 2) -> str:
    if not pair:
        return "-"
    sep = " to " if min(pair) < 0 else "-"
    return f"{pair[0]:.{digits}f}{sep}{pair[1]:.{digits}f}"


def tiny_table(tiny: list[TinyRow]) -> str:
    return format_table(
        ["backend", "numstab us", "native us", "overhead us", "q1-q3 us", "ratio", "goal us",
         "meets"],
        [
            [
                t.backend,
                f"{t.numstab_us:.1f}",
                f"{t.native_us:.1f}",
                f"{t.overhead_us:.1f}",
                _span(t.overhead_q1_q3_us, 1),
                f"{t.ratio:.2f}",
                f"<= {t.overhead_goal_us:.0f}",
                _mark(t.meets_goal),
            ]
            for t in tiny
        ],
    )  # fmt: skip


def print_report(
    meta: dict[str, Any],
    imports: dict[str, Any],
    rows: list[Row],
    tiny: list[TinyRow],
    dispatch: list[DispatchRow],
    tree_rows: list[Row] = (),
) -> None:
    print()
    print(f"numstab {meta['numstab']} overhead | device {meta['device']} | {meta['machine']}")
    print(
        f"large shape {meta['shape']} fp32 | {meta['repeats']} timed rounds (up to "
        f"{meta['max_repeats']} where the quartiles straddle the goal) after "
        f"{meta['warmup']} warmup | frameworks: {meta['frameworks']}"
    )
    load = (meta["load_start"], meta["load_end"])
    print(f"load average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at end")
    if max(load) > LOAD_WARNING:
        print("warning: other processes were using the CPUs; timings, tiny ones most, are noisy")
    print()
    pulled = ", ".join(imports["modules_imported"]) or "none"
    print(
        f"import numstab: {imports['median_ms']:.1f} ms (median of {IMPORT_SAMPLES} fresh "
        f"interpreters); numpy/frameworks imported by it: {pulled}"
    )
    if rows:
        print("\nForward + backward, median per call (ratio = numstab / native):")
        print(ratio_table("case", rows))
    if tree_rows:
        print(
            f"\nTree operations on {meta['tree']} fp32 gradients, median per call "
            "(ratio = numstab / native; natives in benchmarks/_overhead_tree.py):"
        )
        print(ratio_table("op", tree_rows))
    if tiny:
        print(
            f"\nTiny forward, logits {TINY_SHAPE[0]}x{TINY_SHAPE[1]}, hard labels, eager, "
            "median per call (goal: microseconds over the native loss):"
        )
        print(tiny_table(tiny))
    print(
        "\nDispatch alone, numstab.resolve_backend(x), median per call "
        f"(ratio = resolve us / {DISPATCH_GOAL_US:.0f} us):"
    )
    print(
        format_table(
            ["backend", "array type", "resolve us", "ratio", "goal", "meets"],
            [
                [
                    d.backend,
                    d.array_type,
                    f"{d.resolve_us:.2f}",
                    ratio_text(d.ratio, d.goal),
                    f"<= {d.goal:.2f}",
                    _mark(d.meets_goal),
                ]
                for d in dispatch
            ],
        )
    )
    print_summary([*rows, *tree_rows], tiny, dispatch)


def print_summary(rows: list[Row], tiny: list[TinyRow], dispatch: list[DispatchRow]) -> None:
    every = [*rows, *tiny, *dispatch]
    met = sum(r.meets_goal for r in every)
    tiny_goals = ", ".join(f"{v:.0f} us {k}" for k, v in TINY_GOAL_US.items())
    print(
        f"\nGoal: ratio <= {EAGER_GOAL:.2f} eager, <= {COMPILED_GOAL:.2f} (about 1.00) "
        f"compiled; tiny call overhead <= {tiny_goals}; "
        f"dispatch <= {DISPATCH_GOAL_US:.0f} us. Met: {met} of {len(every)} rows."
    )
    for r in rows:
        if not r.meets_goal:
            noise = r.floor_q1_q3 is not None and r.floor_q1_q3[1] > r.goal
            print(
                f"  over budget: {r.case} | {r.backend} | {r.mode}: "
                f"ratio {ratio_text(r.ratio, r.goal)}; "
                f"native against itself {r.floor:.3f} (q1-q3 {_span(r.floor_q1_q3)})"
                + ("; within this run's noise" if noise else "")
            )
    for t in tiny:
        if not t.meets_goal:
            print(f"  over budget: tiny {t.backend}: {t.overhead_us:.1f} us over native")
    for d in dispatch:
        if not d.meets_goal:
            print(f"  over budget: dispatch {d.backend}: {d.resolve_us:.2f} us")


# -- command line --------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, int]:
    try:
        tokens, classes = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENSxCLASSES, got {text!r}") from None
    if tokens < 1 or classes < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return tokens, classes


def parse_backends(text: str) -> list[str]:
    names = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        name = ALIASES.get(part, part)
        if name not in BACKENDS:
            raise argparse.ArgumentTypeError(
                f"unknown backend {part!r}; choose from {', '.join(BACKENDS)}"
            )
        if name not in names:
            names.append(name)
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time numstab.cross_entropy against native cross-entropy, per backend."
    )
    parser.add_argument(
        "--backends",
        type=parse_backends,
        default=list(BACKENDS),
        help="comma-separated subset of torch,jax,tensorflow (default: all installed)",
    )
    parser.add_argument(
        "--shape",
        type=parse_shape,
        default=None,
        help="logits TOKENSxCLASSES (default 4096x32768; --quick: 1024x8192)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed rounds (default {DEFAULT_REPEATS}; --quick: {QUICK_REPEATS})",
    )
    parser.add_argument(
        "--max-repeats",
        type=int,
        default=None,
        help="rounds a row may grow to while its quartiles straddle its goal (default 3x "
        "--repeats)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed rounds first (default {DEFAULT_WARMUP}; --quick: {QUICK_WARMUP})",
    )
    parser.add_argument(
        "--tree",
        type=parse_shape,
        default=None,
        help="gradients for the tree ops, TENSORSxPARAMETERS (default 200x20000000; "
        "--quick: 50x1000000)",
    )
    parser.add_argument("--skip-tree", action="store_true", help="skip the tree operations")
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: torch on CUDA, jax and tensorflow on their GPU; an error if there is none",
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="also time torch.compile (inductor); slow to build on CPU",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small shape and few rounds, for smoke tests"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.shape = args.shape or (QUICK_SHAPE if args.quick else DEFAULT_SHAPE)
    args.tree = args.tree or (QUICK_TREE if args.quick else DEFAULT_TREE)
    args.repeats = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    args.max_repeats = max(args.max_repeats or 3 * args.repeats, args.repeats)
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def installed(requested: list[str]) -> list[str]:
    available = numstab.available_backends()
    for name in requested:
        if name not in available:
            print(f"skipping {name}: not installed (pip install 'numstab[{name}]')")
    return [name for name in requested if name in available]


def json_results(meta: dict, imports: dict, found: dict[str, list]) -> dict[str, Any]:
    """What --json writes: the run's settings, the import, then each section's rows."""
    rows = {section: [asdict(r) for r in found[section]] for section in found}
    return {"meta": meta, "import": imports, **rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_compile and "torch" not in args.backends:
        print("note: --torch-compile has no effect without the torch backend")
    try:
        harnesses = [make_harness(name, args) for name in installed(args.backends)]
    except DeviceUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = {
        "numstab": numstab.__version__,
        "device": args.device,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}",
        "shape": f"{args.shape[0]}x{args.shape[1]}",
        "tree": f"{args.tree[0]} tensors, {args.tree[1] / 1e6:g}M parameters,",
        "repeats": args.repeats,
        "max_repeats": args.max_repeats,
        "warmup": args.warmup,
        "load_start": os.getloadavg()[0],
        "frameworks": ", ".join(f"{h.name} {h.version} on {h.device}" for h in harnesses) or "none",
    }
    print("measuring import numstab ...", flush=True)
    imports = measure_import()
    data = make_data(args.shape)
    host = np.zeros(TINY_SHAPE, np.float32)
    grads = [] if args.skip_tree else _overhead_tree.make_grads(*args.tree)
    found: dict[str, list] = {"large": [], "tree": [], "tiny": [], "dispatch": []}

    def keep(section: str) -> Callable[[Any], None]:
        """Adds a row to ``section`` and rewrites the JSON: a run stopped part-way (a time
        limit) leaves the rows measured so far."""

        def add(row: Any) -> None:
            found[section].append(row)
            dump_json(args.json, json_results(meta, imports, found))

        return add

    keep("dispatch")(bench_dispatch("numpy", host, args.warmup, args.repeats))
    for h in harnesses:
        print(f"{h.name}:", flush=True)
        bench_large(h, data, args.warmup, args.repeats, args.max_repeats, keep("large"))
        if grads:
            bench_tree(
                h, grads, args.device, args.warmup, args.repeats, args.max_repeats, keep("tree")
            )
        tiny_row, dispatch_row = bench_tiny(h, args.warmup, args.repeats)
        keep("tiny")(tiny_row)
        keep("dispatch")(dispatch_row)
        gc.collect()
    meta["load_end"] = os.getloadavg()[0]
    print_report(meta, imports, found["large"], found["tiny"], found["dispatch"], found["tree"])
    if args.json:
        dump_json(args.json, json_results(meta, imports, found))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
