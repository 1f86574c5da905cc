"""The optax guard's snapshots are copies: donating the live params and optimizer state to a
jitted step (their buffers reused) leaves the snapshot, and a rollback to it, intact."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

from numstab.frameworks.jax.guard import guarded_step  # noqa: E402
from numstab.guard import TrainingGuard  # noqa: E402

TX = optax.adam(0.1)
GUARD = TrainingGuard(snapshot_every=2, rollback_after=1, lr_factor=0.5)


def loss_fn(p, x):
    return jnp.mean((x @ p["w"] + p["b"]) ** 2)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def step_fn(guard, params, opt_state, gstate, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return guarded_step(guard, TX, params, opt_state, gstate, loss, grads)


def test_snapshot_survives_donation_and_rollback_restores_it_bit_exactly():
    params = {"w": jnp.arange(12.0).reshape(4, 3) / 10, "b": jnp.ones(3)}
    opt_state = TX.init(params)
    og = GUARD.for_optax()
    gstate = og.init(params, opt_state)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    for _ in range(2):  # two good steps: a snapshot of the params after them
        params, opt_state, gstate, d = step_fn(GUARD, params, opt_state, gstate, x)
        params, opt_state, gstate = og.after_step(d, params, opt_state, gstate)
    kept = jax.device_get((params, opt_state))
    snap = og.runner.ring.latest().payload
    live = jax.tree.leaves((params, opt_state))
    copies = jax.tree.leaves(snap)
    assert all(
        a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
        for a, b in zip(live, copies, strict=True)
    )
    # a NaN batch: the step is skipped and (rollback_after=1) rolled back to the snapshot;
    # the live buffers are donated to the step first
    bad = x.at[0, 0].set(jnp.nan)
    params, opt_state, gstate, d = step_fn(GUARD, params, opt_state, gstate, bad)
    params, opt_state, gstate = og.after_step(d, params, opt_state, gstate)
    assert [e["event"] for e in og.events][-2:] == ["skip", "rollback"]
    got = jax.tree.leaves(jax.device_get((params, opt_state)))
    want = jax.tree.leaves(kept)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)
    # the restored state is a copy too: donating it keeps the snapshot usable
    restored = jax.tree.leaves((params, opt_state))
    assert all(
        a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
        for a, b in zip(restored, jax.tree.leaves(og.runner.ring.latest().payload), strict=True)
    )
