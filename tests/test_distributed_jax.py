"""loss_scaled with axis_name under shard_map on 4 CPU devices, in a subprocess.

XLA_FLAGS=--xla_force_host_platform_device_count=4 only takes effect before jax is imported,
and the test process has imported jax already, so the checks run in a fresh interpreter.
Gradients are sharded (each device holds a slice, as after a reduce-scatter): an overflow on
one device's slice must make every device skip and back off identically, and the global norm
must equal the norm of the unsharded gradients.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.jax_devices import cpu_devices_env

pytest.importorskip("jax")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import numstab
    from numstab import LossScaler
    from numstab.integrations.optax import current_scale, loss_scaled

    try:
        shard_map = jax.shard_map
    except AttributeError:  # jax < 0.7
        from jax.experimental.shard_map import shard_map

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))  # axis type Auto


    def per_device(fn):
        # every input and output carries a leading device axis, one entry per device
        def local(*args):
            out = fn(*jax.tree.map(lambda a: a[0], args))
            return jax.tree.map(lambda a: a[None], out)

        return jax.jit(shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


    def stacked(full):  # {"w": (16, 8), "v": (8,)} -> each device's slice, stacked
        return {"w": full["w"].reshape(4, 4, 8), "v": full["v"].reshape(4, 2)}


    def unstacked(tree):
        return {"w": tree["w"].reshape(16, 8), "v": tree["v"].reshape(8)}


    def same_on_every_device(x):
        x = np.asarray(x)
        return bool(((x == x[0]) | (np.isnan(x) & np.isnan(x[0]))).all())


    scaler = LossScaler(init_scale=2.0**10, growth_interval=2)
    sharded_tx = loss_scaled(optax.adam(1e-2), scaler, max_norm=1.0, axis_name="d")
    local_tx = loss_scaled(optax.adam(1e-2), scaler, max_norm=1.0)  # no axis_name: the control
    full_tx = loss_scaled(optax.adam(1e-2), scaler, max_norm=1.0)  # unsharded reference

    key = jax.random.PRNGKey(0)
    params = {"w": jnp.zeros((16, 8)), "v": jnp.zeros(8)}
    init = per_device(sharded_tx.init)
    step = per_device(lambda g, s: sharded_tx.update(g, s))
    full_step = jax.jit(full_tx.update)
    state, full_state = init(stacked(params)), full_tx.init(params)

    # (step -> device holding the overflow, what it holds)
    poison = {2: (2, math.inf), 5: (0, math.nan), 6: (3, -math.inf)}
    finite_seq = []
    for i in range(9):
        key, sub = jax.random.split(key)
        true = {"w": jax.random.normal(sub, (16, 8)), "v": jnp.linspace(-3.0, 3.0, 8)}
        scale = float(current_scale(full_state))
        grads = jax.tree.map(lambda g: g * scale, true)  # as from the scaled loss
        if i in poison:
            device, value = poison[i]
            grads["w"] = grads["w"].at[4 * device + 1, 3].set(value)  # in that device's rows
        updates, state = step(stacked(grads), state)
        full_updates, full_state = full_step(grads, full_state)
        finite = i not in poison
        finite_seq.append(finite)

        # every device took the same decision, and it is the unsharded one
        for leaf in jax.tree.leaves((state.loss_scale, state.last_finite, state.grad_norm)):
            assert same_on_every_device(leaf), (i, leaf)
        assert same_on_every_device(state.inner_state[0].count)
        assert np.asarray(state.last_finite).tolist() == [finite] * 4, i
        assert float(state.loss_scale.scale[0]) == float(current_scale(full_state)), i
        assert int(state.inner_state[0].count[0]) == int(full_state.inner_state[0].count), i
        if finite:
            np.testing.assert_allclose(state.grad_norm[0], full_state.grad_norm, rtol=1e-6)
            np.testing.assert_allclose(
                state.grad_norm[0], numstab.global_norm(true), rtol=1e-6
            )
        else:
            assert not np.asarray(updates["w"]).any() and not np.asarray(updates["v"]).any()
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
            unstacked(updates),
            full_updates,
        )

    np_state = scaler.init(backend="numpy")
    for finite in finite_seq:
        np_state = scaler.update(np_state, finite)
    assert float(state.loss_scale.scale[0]) == float(np_state.scale)
    assert int(state.loss_scale.growth_tracker[0]) == int(np_state.growth_tracker)

    # the control: without axis_name only the device holding the overflow skips
    grads = stacked({"w": jnp.ones((16, 8)), "v": jnp.ones(8)})
    grads["w"] = grads["w"].at[2, 0, 0].set(jnp.inf)
    _, local_state = per_device(lambda g: local_tx.update(g, local_tx.init(g)))(grads)
    assert np.asarray(local_state.last_finite).tolist() == [True, True, False, True]

    # norms of every order, one compiled program: sharded == unsharded
    full = {"w": jax.random.normal(key, (16, 8)) * 3.0, "v": jnp.arange(8.0)}
    norm_types = (2.0, 1.0, math.inf, 3.0)
    txs = [
        loss_scaled(optax.identity(), LossScaler(init_scale=4.0), max_norm=0.5, norm_type=p,
                    axis_name="d")  # fmt: skip
        for p in norm_types
    ]

    def all_norms(g):
        return [tx.update(g, tx.init(g)) for tx in txs]

    g4 = stacked(jax.tree.map(lambda g: g * 4.0, full))
    for norm_type, (ups, st) in zip(norm_types, per_device(all_norms)(g4)):
        expected_norm = numstab.global_norm(full, norm_type)
        np.testing.assert_allclose(np.asarray(st.grad_norm), [expected_norm] * 4, rtol=1e-6)
        expected, _ = numstab.clip_by_global_norm(full, 0.5, norm_type=norm_type)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8),
            unstacked(ups),
            expected,
        )
    print("DISTRIBUTED-OK", jax.__version__, finite_seq)
    """
)


def test_one_device_overflow_skips_everywhere_under_shard_map(tmp_path):
    script = tmp_path / "distributed_check.py"
    script.write_text(SCRIPT)
    env = cpu_devices_env(4)
    env.pop("NUMSTAB_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "DISTRIBUTED-OK" in proc.stdout
