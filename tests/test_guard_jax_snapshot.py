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


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2, 3))
def step_donating_all(guard, params, opt_state, gstate, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return guarded_step(guard, TX, params, opt_state, gstate, loss, grads)


@pytest.mark.parametrize("host_every", [1, 2])
def test_donating_the_guard_state_too_survives_rollbacks(host_every):
    """The snapshots kept the loop's own guard-state arrays, and a rollback handed the
    snapshot's back: a step donating gstate deleted them (XLA's "buffer has been deleted or
    donated" at the next rollback, unpacked form)."""
    guard = TrainingGuard(snapshot_every=2, rollback_after=1, host_every=host_every)
    params = {"w": jnp.arange(12.0).reshape(4, 3) / 10, "b": jnp.ones(3)}
    opt_state = TX.init(params)
    og = guard.for_optax()
    gstate = og.init(params, opt_state, packed=False)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    for i in range(10):
        if og.skip_batch():
            continue
        batch = x.at[0, 0].set(jnp.nan) if i in (3, 7) else x
        params, opt_state, gstate, d = step_donating_all(guard, params, opt_state, gstate, batch)
        params, opt_state, gstate = og.after_step(d, params, opt_state, gstate)
    params, opt_state, gstate = og.flush(params, opt_state, gstate)
    assert [e["event"] for e in og.events].count("rollback") == 2
    assert np.isfinite(np.asarray(params["w"])).all()


def test_steps_stacked_by_scan_are_refused_by_name():
    from numstab.errors import InvalidArgumentError

    og = GUARD.for_optax()
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    opt_state = TX.init(params)
    gstate = og.init(params, opt_state)

    def body(carry, x):
        p, o, g = carry
        loss, grads = jax.value_and_grad(loss_fn)(p, x)
        p, o, g, d = guarded_step(GUARD, TX, p, o, g, loss, grads)
        return (p, o, g), d

    xs = jnp.ones((3, 2, 4))
    (params, opt_state, gstate), decisions = jax.lax.scan(body, (params, opt_state, gstate), xs)
    with pytest.raises(InvalidArgumentError, match=r"one step's decision.*shape \(3,\)"):
        og.after_step(decisions, params, opt_state, gstate)  # a raw TypeError before
