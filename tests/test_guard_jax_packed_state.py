"""The optax guard's state in two arrays (``PackedGuardState``, the default for parameters on an
accelerator): an exact round trip, and a guarded loop that runs identically with either form
through skips, spikes, rollbacks, deferred reads and a resume from disk."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

from numstab.backends import load_backend  # noqa: E402
from numstab.frameworks.jax.guard import guarded_step  # noqa: E402
from numstab.frameworks.jax.guard_state import (  # noqa: E402
    PackedGuardState,
    on_accelerator,
    unpacked,
)
from numstab.guard import SpikeDetector, TrainingGuard, policy  # noqa: E402

TX = optax.adam(0.05)
X = jax.random.normal(jax.random.PRNGKey(0), (64, 4))
Y = X @ jnp.arange(1.0, 5.0)[:, None]


def guard(host_every=1, directory=None):
    return TrainingGuard(
        loss_spikes=SpikeDetector(window=6, sigma=3.0, warmup=4),
        grad_norm_spikes=SpikeDetector(window=5, sigma=3.0, warmup=4),
        snapshot_every=4,
        rollback_after=2,
        rollback_window=3,
        host_every=host_every,
        snapshot_dir=None if directory is None else str(directory),
    )


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)


@functools.partial(jax.jit, static_argnums=0)
def step_fn(g, params, opt_state, gstate, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return guarded_step(g, TX, params, opt_state, gstate, loss, grads)


def batch(step):
    """Clean batches, but a loss spike at 14, NaN at 9 and 20-21 (a rollback), inf at 27."""
    i = (step % 4) * 16
    x, y = X[i : i + 16], Y[i : i + 16]
    if step == 14:
        y = y + 100.0
    if step in (9, 20, 21):
        x = x.at[0, 0].set(jnp.nan)
    if step == 27:
        y = y.at[0, 0].set(jnp.inf)
    return x, y


def run(packed, host_every=1, steps=32, directory=None, unpack_odd=False):
    g = guard(host_every, directory)
    og = g.for_optax()
    params = {"w": jnp.full((4, 8), 0.1), "v": jnp.full((8, 1), 0.1)}
    opt_state = TX.init(params)
    gstate = og.init(params, opt_state, packed=packed)
    assert isinstance(gstate, PackedGuardState) == packed
    for step in range(steps):
        if og.skip_batch():
            continue
        params, opt_state, gstate, d = step_fn(g, params, opt_state, gstate, *batch(step))
        if unpack_odd and step % 2:
            d = d.unpack()  # after_step takes either form
        params, opt_state, gstate = og.after_step(d, params, opt_state, gstate)
        assert isinstance(gstate, PackedGuardState) == packed
    params, opt_state, gstate = og.flush(params, opt_state, gstate)
    return params, opt_state, gstate, og


def untimed(events):
    return [{k: v for k, v in e.items() if k != "time"} for e in events]


def test_pack_unpack_round_trip_is_exact_and_two_leaves():
    g = guard()
    state = g.init_state("jax")
    for x in (1.0, 2.0, 1.5, math.nan, 3.0, 2.5, 1e30):  # fill and wrap the windows
        _, state = policy.decide(g, load_backend("jax"), state, jnp.float32(x), jnp.float32(x / 2))
    packed = PackedGuardState.pack(state)
    assert [leaf.dtype for leaf in jax.tree.leaves(packed)] == [jnp.float32, jnp.int32]
    assert packed.floats.shape == (6 + 5 + 1,) and packed.ints.shape == (4 + 3 + 3,)
    back = jax.jit(PackedGuardState.unpack)(packed)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert unpacked(state) is state and "lr_factor" in repr(packed)
    # the fields read as on a GuardState, and _replace keeps the form
    assert int(packed.step) == int(state.step) == 7
    np.testing.assert_array_equal(packed.loss_window.values, state.loss_window.values)
    halved = packed._replace(lr_factor=jnp.float32(0.5))
    assert isinstance(halved, PackedGuardState) and float(halved.lr_factor) == 0.5
    np.testing.assert_array_equal(halved.bad_flags, state.bad_flags)
    with pytest.raises(AttributeError):
        packed.not_a_field  # noqa: B018


@pytest.mark.parametrize("host_every", [1, 3])
def test_packed_and_plain_state_train_identically(host_every):
    plain = run(False, host_every)
    packed = run(True, host_every)
    for a, b in zip(jax.tree.leaves(plain[:2]), jax.tree.leaves(packed[:2]), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(plain[2]), jax.tree.leaves(unpacked(packed[2])), strict=True):
        np.testing.assert_array_equal(a, b)
    events = untimed(plain[3].events)
    assert events == untimed(packed[3].events)
    kinds = {e["event"] for e in events}
    assert {"skip", "rollback", "snapshot"} <= kinds
    reasons = {r for e in events if e["event"] == "skip" for r in e["reasons"]}
    assert {"nonfinite_loss", "loss_spike"} <= reasons
    assert float(unpacked(packed[2]).lr_factor) < 1.0  # the rollback's factor, carried packed


def test_resume_from_disk_gives_the_form_init_chose(tmp_path):
    params, opt_state, _, og = run(True, directory=tmp_path, steps=8)
    snap = og.runner.ring.latest()
    restored, _, g = og.load_snapshot(params, opt_state)
    assert isinstance(g, PackedGuardState)
    assert int(unpacked(g).step) == snap.guard_state.step == snap.step
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(snap.payload[0]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cpu_parameters_keep_the_plain_state():
    params = {"w": jnp.ones(3)}
    assert not on_accelerator(params)
    og = guard().for_optax()
    assert isinstance(og.init(params, TX.init(params)), policy.GuardState)


def test_deferred_reads_take_both_decision_forms():
    """With host_every > 1, a Decision among PackedDecisions failed to stack at the read
    (JAX's "pytree structure error")."""
    want = run(False, host_every=3)
    got = run(False, host_every=3, unpack_odd=True)
    for a, b in zip(jax.tree.leaves(want[:3]), jax.tree.leaves(got[:3]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [e["event"] for e in want[3].events] == [e["event"] for e in got[3].events]


def test_resume_from_a_file_that_does_not_fit_raises(tmp_path):
    """Fewer leaves gave JAX's "Too many leaves for PyTreeDef"; other shapes loaded silently;
    a file of a guard with other settings broke the next step."""
    run(packed=False, steps=8, directory=tmp_path)
    params = {"w": jnp.full((4, 8), 0.1), "v": jnp.full((8, 1), 0.1)}
    og = guard(directory=tmp_path).for_optax()
    og.init(params, TX.init(params))
    from numstab.errors import InvalidArgumentError

    short = {"w": params["w"]}
    with pytest.raises(InvalidArgumentError, match="Expected a snapshot of this params: 1 arrays"):
        og.load_snapshot(short, TX.init(short))
    wide = {"w": jnp.zeros((4, 9)), "v": jnp.zeros((9, 1))}
    with pytest.raises(InvalidArgumentError, match=r"params\['v'\]\" of shape \(9, 1\)"):
        og.load_snapshot(wide, TX.init(wide))
    other = TrainingGuard(snapshot_dir=str(tmp_path)).for_optax()
    other.init(params, TX.init(params))
    with pytest.raises(InvalidArgumentError, match=r"loss_window\.values of shape \(128,\)"):
        other.load_snapshot(params, TX.init(params))
    restored, _, _ = og.load_snapshot(params, TX.init(params))  # the file itself is fine
    assert jax.tree.structure(restored) == jax.tree.structure(params)
