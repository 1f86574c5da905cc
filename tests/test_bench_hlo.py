"""The kernel counts that benchmarks/guard.py prints for JAX programs (benchmarks/_hlo.py)
count what the entry computation launches, and only that."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _hlo import big_ops, entry_ops, summary

TEXT = """\
HloModule jit_f

%fused_computation (p: f32[8]) -> f32[] {
  %p = f32[8]{0} parameter(0)
  ROOT %r = f32[] fusion(%p), kind=kLoop, calls=%inner
}

ENTRY %main.3 (a.1: f32[8], b.1: f32[8,8]) -> (f32[], (f32[8], s32[])) {
  %a.1 = f32[8]{0} parameter(0), metadata={op_name="a"}
  %b.1 = f32[8,8]{1,0} parameter(1)
  %c = f32[] constant(0)
  %fusion.1 = f32[] fusion(%a.1), kind=kLoop, calls=%fused_computation
  %pair = (f32[8]{0}, s32[]) fusion(%a.1, %c), kind=kLoop, calls=%fused_computation
  %dot.2 = f32[8]{0} dot(%b.1, %a.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy.3 = f32[8]{0} copy(%dot.2)
  %gte = f32[8]{0} get-tuple-element(%pair), index=0
  %bc = f32[8]{0} bitcast(%copy.3)
  ROOT %tuple.1 = (f32[], (f32[8]{0}, s32[])) tuple(%fusion.1, %pair)
}
"""


def test_entry_ops_counts_launches_of_the_entry_computation_only():
    counts = entry_ops(TEXT)
    # the nested computation's fusion and the trivial ops are not counted
    assert counts == {"fusion": 2, "dot": 1, "copy": 1}
    assert summary(counts).startswith("2 fusions, 4 ops")


def test_entry_ops_of_a_compiled_program():
    """On XLA's real text (metadata, backend configs): every fusion line of the entry
    computation is counted, and nothing trivial."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    fn = jax.jit(lambda a: (jnp.tanh(a).sum(), (a * a).max(axis=0), a @ a))
    text = fn.lower(jnp.ones((64, 64))).compile().as_text()
    entry = text[text.index("\nENTRY ") :].split("\n}")[0]
    counts = entry_ops(text)
    assert counts["fusion"] == entry.count(" fusion(") >= 1
    assert not {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"} & set(counts)


def test_jax_global_norm_compiles_to_optax_kernels():
    """benchmarks/overhead.py times ``global_norm`` under ``jax.jit`` against optax's: the
    compiled programs launch the same kernels (one reduction per leaf, then one over their
    vector), and p = 1 and p = inf those of the same reductions written by hand; a norm of
    per-leaf norms launched a root and a power per leaf more."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import numpy as np

    import numstab

    jnp = jax.numpy
    rng = np.random.default_rng(0)
    tree = [jnp.asarray(rng.standard_normal(n, dtype=np.float32)) for n in (3, 40, 5000) * 4]

    def launches(fn):
        return entry_ops(jax.jit(fn).lower(tree).compile().as_text())

    assert launches(numstab.global_norm) == launches(optax.global_norm)
    l1 = launches(lambda t: jnp.sum(jnp.stack([jnp.sum(jnp.abs(x)) for x in t])))
    assert launches(lambda t: numstab.global_norm(t, 1.0)) == l1
    linf = launches(lambda t: jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in t])))
    assert launches(lambda t: numstab.global_norm(t, float("inf"))) == linf


def test_big_ops_lists_the_launches_that_touch_a_big_buffer():
    """A launch counts when its output or one of its operands has the size asked; the
    trivial ops (parameters, bitcasts) never do."""
    assert big_ops(TEXT, 64) == ["dot"]  # reads b.1, f32[8,8]
    assert big_ops(TEXT, 8) == ["fusion", "fusion", "dot", "copy"]
    assert big_ops(TEXT, 65) == []


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_jax_hard_label_cross_entropy_makes_optaxs_passes_over_the_logits(grad):
    """benchmarks/overhead.py times hard-label ``cross_entropy`` under ``jax.jit`` against
    ``optax.softmax_cross_entropy_with_integer_labels(...).mean()``: the compiled programs
    touch the [tokens, classes] logits (or their gradient) in the same number of launches;
    numstab's further launches (ignore_index's count, the label checks) are on [tokens]."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")

    import numstab

    jnp = jax.numpy
    logits, labels = jnp.ones((256, 2048), jnp.float32), jnp.zeros((256,), jnp.int32)

    def passes(loss):
        fn = jax.value_and_grad(loss) if grad else loss
        return big_ops(jax.jit(fn).lower(logits, labels).compile().as_text(), logits.size)

    ours = passes(numstab.cross_entropy)
    native = passes(lambda x, y: optax.softmax_cross_entropy_with_integer_labels(x, y).mean())
    assert ours == native and len(native) >= (6 if grad else 3)


def test_xla_gpu_kernels_counts_every_program_and_packing_saves_launches():
    """benchmarks/xla_gpu_kernels.py on XLA:CPU (the GPU target needs JAX's CUDA plugin): the
    guard state packed in 2 arrays leaves the guarded step with fewer launches than the
    11-array state (one kernel per output buffer at least), and the floor is not above it."""
    pytest.importorskip("optax")
    import argparse

    from xla_gpu_kernels import kernel_counts

    args = argparse.Namespace(
        platform="cpu", width=16, layers=2, batch=8, snapshot_every=10, host_every=10
    )
    kernels = {name: sum(ops.values()) for name, ops in kernel_counts(args).items()}
    packed, plain = kernels["guarded step, packed state"], kernels["guarded step, 11-array state"]
    assert kernels["plain step"] < kernels["floor: norms + skip select"] <= packed < plain
    assert kernels["policy.decide alone"] > 0


def test_memory_jax_programs_run_and_the_fused_one_matches_unfused():
    """benchmarks/memory.py's JAX runs, which benchmarks/xla_gpu_memory.py plans for a GPU:
    every variant compiles and runs; fused equals unfused; the loop floors produce both
    products of one chunk's softmax (dweight summed in bfloat16 and in float32), the chunk
    read after them (what keeps it alive beside the gradients)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import numpy as np
    from memory import F32_SUM_FLOOR, jax_program

    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((64, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 16)) / 4, jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, 96, 64))
    out = {v: jax_program(v, 16)(h, w, y) for v in ("unfused", "fused", "floor", F32_SUM_FLOOR)}
    # bfloat16: the unfused gradients round each product, the fused ones sum in float32
    np.testing.assert_allclose(out["fused"], out["unfused"], rtol=2e-2)
    rows, weight = np.asarray(h[:16], np.float32), np.asarray(w, np.float32)
    logits = rows @ weight.T
    g = np.exp(logits - logits.max(-1, keepdims=True))
    g /= g.sum(-1, keepdims=True)
    want = (g[0, 0], np.linalg.norm(g @ weight), np.linalg.norm(g.T @ rows))
    for floor in ("floor", F32_SUM_FLOOR):  # bfloat16: each product and the chunk rounded
        np.testing.assert_allclose([float(x) for x in out[floor]], want, rtol=3e-2)


def test_memory_torch_time_floor_computes_the_unfused_loss_and_gradients():
    """benchmarks/memory.py's torch time floor (every chunk in plain ops) is a floor of the
    same computation: its loss and gradient norms equal the unfused path's, with ignored rows
    and a short last chunk."""
    pytest.importorskip("torch")
    import numpy as np
    from memory import _inputs, _torch_step

    hidden, weight, labels = _inputs(300, 16, 50)
    assert (labels == -100).any()
    out = {
        v: _torch_step(v, hidden, weight, labels, 64, False)[0]() for v in ("unfused", "chunked")
    }
    np.testing.assert_allclose(out["chunked"], out["unfused"], rtol=1e-5)
