"""Fused linear cross-entropy and the data firewall on 4 CPU devices, in a subprocess:
inside ``shard_map`` (check_vma on, Auto and Explicit meshes) and under jit and eagerly on a
mesh with Explicit axes (jax >= 0.7's sharding in types; jax.make_mesh's default since 0.9).

XLA_FLAGS=--xla_force_host_platform_device_count=4 only takes effect before jax is imported,
so the checks run in a fresh interpreter (as tests/test_distributed_jax.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.jax_devices import cpu_devices_env

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
if not hasattr(jax, "shard_map") or not hasattr(jax.sharding, "AxisType"):
    pytest.skip("needs jax.shard_map and explicit sharding (jax >= 0.7)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import numstab as ns

    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    T, D, V = 64, 16, 40
    h = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(V, D)) * 0.3, jnp.float32)
    y = jnp.asarray(rng.integers(0, V, T)).at[5].set(-100).at[33].set(-100)
    EPS = float(jnp.finfo(jnp.float32).eps)


    def unfused(h, W, y, reduction="mean", **kw):
        return ns.cross_entropy(h @ W.T, y, reduction=reduction, **kw)


    def close(got, want, what, ulps=64):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(float(np.abs(want).max()), 1.0)  # relative to the quantity's own size
        err = float(np.abs(got - want).max()) / scale
        assert err <= ulps * EPS, (what, err)
    """
)

SHARD_MAP = textwrap.dedent(
    """
    import sys

    mode = sys.argv[1]
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,))
    rows, replicated = jax.NamedSharding(mesh, P("data")), jax.NamedSharding(mesh, P())
    hs, ys, Wr = jax.device_put(h, rows), jax.device_put(y, rows), jax.device_put(W, replicated)

    for reduction in ("sum", "none"):
        for chunk in (4, 5, None):  # 16 local rows: 4 chunks, 3 chunks and a tail, 1 chunk
            kw = dict(reduction=reduction, chunk_size=chunk, label_smoothing=0.1, z_loss=1e-3)

            def local(h, y, W):
                return jax.lax.psum(jnp.sum(ns.fused_linear_cross_entropy(h, W, y, **kw)), "data")

            def loss(W, h, y):
                return jax.shard_map(
                    local, mesh=mesh, in_specs=(P("data"), P("data"), P()), out_specs=P()
                )(h, y, W)

            def ref(W, h):
                kw2 = dict(label_smoothing=0.1, z_loss=1e-3)
                return jnp.sum(unfused(h, W, y, reduction=reduction, **kw2))

            with jax.set_mesh(mesh):
                value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(Wr, hs, ys)
            want, want_grads = jax.value_and_grad(ref, argnums=(0, 1))(W, h)
            what = (mode, reduction, chunk)
            close(value, want, what)
            close(grads[0], want_grads[0], (*what, "dW"))
            close(grads[1], want_grads[1], (*what, "dh"))
    print("OK")
    """
)

EXPLICIT = textwrap.dedent(
    """
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        hs, ys = jax.device_put(h, P("data")), jax.device_put(y, P("data"))
        Wr = jax.device_put(W, P())
        want, want_grads = jax.value_and_grad(
            lambda W, h: unfused(h, W, y, label_smoothing=0.1), argnums=(0, 1)
        )(W, h)
        for chunk in (None, 8, 5):  # one chunk, 8 chunks, 12 chunks and a tail

            def loss(W, h, y, chunk=chunk):
                return ns.fused_linear_cross_entropy(
                    h, W, y, chunk_size=chunk, label_smoothing=0.1
                )

            value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(Wr, hs, ys)
            close(value, want, chunk)
            close(grads[0], want_grads[0], (chunk, "dW"))
            close(grads[1], want_grads[1], (chunk, "dh"))
            assert grads[1].sharding.is_equivalent_to(hs.sharding, 2), grads[1].sharding
            close(loss(Wr, hs, ys), want, (chunk, "eager"))
            eager_grads = jax.grad(loss, argnums=(0, 1))(Wr, hs, ys)  # jax.grad without jit
            close(eager_grads[0], want_grads[0], (chunk, "eager dW"))

        x = np.asarray(rng.normal(size=(T, 3)), np.float32)
        x[3, 1] = np.nan
        batch = {"x": jax.device_put(x, P("data")), "y": ys}
        (kept,) = list(ns.data.protect([batch], policy="drop"))
        assert kept["x"].shape == (T - 1, 3) and kept["y"].shape == (T - 1,)
        np.testing.assert_array_equal(np.asarray(kept["x"]), np.delete(x, 3, axis=0))
        np.testing.assert_array_equal(np.asarray(kept["y"]), np.delete(np.asarray(y), 3))
    print("OK")
    """
)


def _run(script: str, *args: str) -> None:
    env = cpu_devices_env(4)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_fused_cross_entropy_inside_shard_map(mode):
    """Per-device chunks (one or several, with a tail) inside shard_map with check_vma: the
    scan's zero buffers vary over the manual axis as the chunk results do, and the replicated
    weight's gradient is the psum of the per-device ones; loss and gradients equal unfused."""
    _run(SHARD_MAP, mode)


def test_fused_cross_entropy_and_firewall_on_an_explicit_mesh():
    """Rows sharded over an Explicit mesh axis: the weight gradient contracts the sharded rows
    (an all-reduce), chunks that do not divide the mesh run, the hidden gradient keeps the
    hidden's sharding, eagerly too; protect(policy="drop") returns a batch of 63 rows."""
    _run(EXPLICIT)
