"""The tree functions under jax.export with a symbolic batch dimension: exported once, then
called at two batch sizes, they equal the eager calls (before, JAX's raw
InconclusiveDimensionOperation: the leaf sizes were read as Python ints)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

import numstab as ns  # noqa: E402

FUNCTIONS = {
    "global_norm": lambda g: ns.global_norm([g, g[:1]]),
    "clip_by_global_norm": lambda g: ns.clip_by_global_norm([g], 1.0)[0][0],
    "all_finite": lambda g: ns.all_finite([g]),
    "clip_by_value": lambda g: ns.clip_by_value([g], -0.5, 0.5)[0],
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_exported_with_a_symbolic_batch_equals_eager(name):
    fn = FUNCTIONS[name]
    (batch,) = export.symbolic_shape("b")
    exported = export.export(jax.jit(fn))(jax.ShapeDtypeStruct((batch, 4), jnp.float32))
    for rows in (3, 5):
        g = jnp.asarray(np.linspace(-2.0, 2.0, rows * 4, dtype=np.float32).reshape(rows, 4))
        got, want = np.asarray(exported.call(g)), np.asarray(fn(g))
        scale = max(float(np.max(np.abs(want))), 1.0)
        np.testing.assert_allclose(got, want, rtol=0, atol=8 * np.finfo(np.float32).eps * scale)
