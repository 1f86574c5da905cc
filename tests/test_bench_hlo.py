"""The kernel counts that benchmarks/guard.py prints for JAX programs (benchmarks/_hlo.py)
count what the entry computation launches, and only that."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _hlo import entry_ops, summary

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
