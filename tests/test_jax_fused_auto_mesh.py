"""Fused linear cross-entropy under ``jax.jit`` on an ordinary data-parallel mesh (Auto axes,
``Mesh(devices, ("d",))``) with the rows sharded ``P("d")``, 4 CPU devices in a subprocess:
with several chunks the rows stay sharded (strided chunks, ``fused.strided_count``), so the
compiled program gathers neither ``hidden`` nor ``dhidden`` and ``dhidden`` comes back
``P("d")``; values and gradients equal the unfused loss's. Before, contiguous chunks made
XLA all-gather the rows: every device computed every row and ``dhidden`` came back ``P()``.

XLA_FLAGS=--xla_force_host_platform_device_count=4 only takes effect before jax is imported,
so the checks run in a fresh interpreter (as tests/test_jax_fused_sharding.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.jax_devices import cpu_devices_env

jax = pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import numstab as ns

    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("d",))  # Auto axes: plain data parallelism
    rows = NamedSharding(mesh, P("d"))
    B, T, D, V = 8, 6, 16, 40
    h = jax.random.normal(jax.random.key(0), (B, T, D))
    W = jax.random.normal(jax.random.key(1), (V, D)) * 0.3
    y = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    y = jnp.where(y == 7, 8, y).at[1, 2].set(-100).at[6, 0].set(-100)  # class 7: masked
    bias = jnp.linspace(-1.0, 1.0, V).at[7].set(-jnp.inf)
    hs, ys = jax.device_put(h, rows), jax.device_put(y, rows)
    EPS = float(jnp.finfo(jnp.float32).eps)


    def close(got, want, what, ulps=64):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1.0)
        assert err <= ulps * EPS, (what, err)


    cases = [  # 48 rows: one chunk, 12 strided chunks of 4, 4 of 12, 3 of 16 (rows per chunk a
        # multiple of the 4 devices; ignored rows, a -inf bias)
        (None, "mean", {}),
        (5, "mean", {}),
        (12, "sum", dict(label_smoothing=0.1, z_loss=1e-3)),
        (16, "none", dict(label_smoothing=0.2)),
        (5, "mean", dict(bias=bias, label_smoothing=0.1)),
        (30, "mean", {}),  # one full chunk and a short tail asked for: 3 strided chunks of 16
    ]
    for chunk, reduction, kw in cases:
        what = (chunk, reduction, sorted(kw))

        def fused(h, W, y, chunk=chunk, reduction=reduction, kw=kw):
            out = ns.fused_linear_cross_entropy(
                h, W, y, chunk_size=chunk, reduction=reduction, **kw
            )
            return jnp.sum(out * jnp.arange(1.0, 1.0 + out.size).reshape(out.shape))

        def unfused(h, W, y, reduction=reduction, kw=kw):
            kw = dict(kw)
            b = kw.pop("bias", None)
            logits = h @ W.T if b is None else h @ W.T + b
            out = ns.cross_entropy(logits, y, reduction=reduction, **kw)
            return jnp.sum(out * jnp.arange(1.0, 1.0 + out.size).reshape(out.shape))

        step = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))
        value, (dh, dw) = step(hs, W, ys)
        want, (want_dh, want_dw) = jax.value_and_grad(unfused, argnums=(0, 1))(h, W, y)
        close(value, want, what)
        close(dh, want_dh, (*what, "dh"))
        close(dw, want_dw, (*what, "dW"))
        assert dh.sharding.spec == P("d"), (what, dh.sharding)
        text = step.lower(hs, W, ys).compile().as_text()
        for op in ("all-gather", "all-to-all", "collective-permute"):  # rows never move
            assert text.count(op) == 0, (what, op, text.count(op))
    print("OK")
    """
)


def test_rows_stay_sharded_on_an_auto_mesh():
    """Rows sharded over an Auto mesh axis, one chunk and several (5, 12, 16, 30 rows asked for),
    "mean", "sum", "none" (row order), smoothing, z-loss, ignored rows and a -inf bias: no
    all-gather in the compiled step, ``dhidden`` sharded ``P("d")``, values and gradients
    as the unfused loss's."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        env=cpu_devices_env(4),
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )


@pytest.mark.parametrize(
    ("rows", "chunk", "count"),
    [
        (48, 5, 12),  # 10 chunks would be needed: 12 divide 48 (11 and 12 in range)
        (4096, 1024, 4),  # the default chunk at 8 x 512 rows, vocab 8192: as it was
        (3000, 158, 20),  # 19 needed: 20 (of 19 to 23) divides 3000
        (48, 24, 3),  # 3 chunks of 16 rows keep more factors 2 than 2 chunks of 24
        (64, 4, 16),
        (8184, 128, 66),  # B * (T - 1) rows: 64 needed, 66 of 124 rows (not 93 of 88)
    ],
)
def test_strided_count_divides_the_rows(rows, chunk, count):
    from numstab.frameworks.jax import fused

    got = fused.strided_count(rows, chunk)
    assert got == count
    assert rows % got == 0 and rows // got <= chunk


def test_strided_count_is_none_without_a_divisor():
    """A prime number of rows: contiguous chunks (the last one short), as before."""
    from numstab.frameworks.jax import fused

    assert fused.strided_count(97, 10) is None
    assert fused.strided_count(2046, 128) is None  # 22 chunks of 93: too small (16 needed)
