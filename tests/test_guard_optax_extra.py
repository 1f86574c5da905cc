"""The optax guard with model state outside params and optimizer (``extra``): BatchNorm
statistics of a Flax linen model and an Equinox ``eqx.nn.State``. A NaN batch that the guard
skips must not write them, a rollback restores them with the params, and snapshot files hold
them. Before ``extra`` and ``select``, a skipped NaN batch left NaN running statistics and
every later evaluation NaN."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
linen = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402

import numstab as ns  # noqa: E402

TX = optax.sgd(1e-2)


class Net(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool):
        x = linen.Dense(8)(x)
        x = linen.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return linen.Dense(1)(jnp.tanh(x))


NET = Net()


def batch(step, nan_steps=()):
    x = jax.random.normal(jax.random.PRNGKey(step), (16, 4))
    if step in nan_steps:
        x = x.at[0, 0].set(jnp.nan)
    return x, jnp.sum(x, -1, keepdims=True)


def loss_fn(params, stats, x, y):
    out, updates = NET.apply(
        {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
    )
    return jnp.mean((out - y) ** 2), updates["batch_stats"]


@functools.partial(jax.jit, static_argnums=(0, 1))
def train_step(og, use_select, params, opt_state, stats, gstate, x, y):
    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x, y)
    params, opt_state, gstate, decision = og.step(TX, params, opt_state, gstate, loss, grads)
    stats = og.select(decision, new_stats, stats) if use_select else new_stats
    return params, opt_state, stats, gstate, decision


def start(guard, **init):
    variables = NET.init(jax.random.PRNGKey(0), batch(0)[0], train=False)
    params, stats = variables["params"], variables["batch_stats"]
    og = guard.for_optax()
    opt_state = TX.init(params)
    return og, params, opt_state, stats, og.init(params, opt_state, extra=stats, **init)


def run(guard, nan_steps, steps, use_select=True, on_step=None):
    og, params, opt_state, stats, gstate = start(guard)
    for step in range(steps):
        if og.skip_batch():
            continue
        x, y = batch(step, nan_steps)
        params, opt_state, stats, gstate, d = train_step(
            og, use_select, params, opt_state, stats, gstate, x, y
        )
        params, opt_state, gstate, stats = og.after_step(d, params, opt_state, gstate, extra=stats)
        if on_step is not None:
            on_step(step, params, stats)
    params, opt_state, gstate, stats = og.flush(params, opt_state, gstate, extra=stats)
    return og, params, stats


def finite(tree):
    return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree))


def same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("host_every", [1, 3])
def test_a_skipped_nan_batch_leaves_the_batchnorm_statistics(host_every):
    guard = ns.TrainingGuard(snapshot_every=1000, host_every=host_every)
    seen = {}
    _, params, stats = run(guard, {3}, 6, on_step=lambda s, p, st: seen.setdefault(s, st))
    assert finite(params) and finite(stats)
    same(seen[3], seen[2])  # the skipped step wrote nothing
    # without the select the guard keeps the params finite, but the statistics are NaN
    _, params, stats = run(guard, {3}, 6, use_select=False)
    assert finite(params) and not finite(stats)


@pytest.mark.parametrize("host_every", [1, 4])
def test_a_rollback_restores_the_statistics(host_every):
    # without the select, NaN batches 5 and 6 write NaN running statistics, which no later
    # batch can mend (momentum * NaN): only the rollback's restored copy makes them finite
    guard = ns.TrainingGuard(snapshot_every=4, rollback_after=2, host_every=host_every)
    og, params, stats = run(guard, {5, 6}, 12, use_select=False)
    assert [e["to_step"] for e in og.events if e["event"] == "rollback"] == [4]
    assert finite(stats) and finite(params)


def test_rollback_returns_exactly_the_snapshot_statistics():
    guard = ns.TrainingGuard(snapshot_every=2, rollback_after=2)
    og, params, opt_state, stats, gstate = start(guard)
    kept = {}
    for step in range(6):
        x, y = batch(step, {4, 5})
        params, opt_state, stats, gstate, d = train_step(
            og, False, params, opt_state, stats, gstate, x, y
        )
        kept[step] = stats
        params, opt_state, gstate, stats = og.after_step(d, params, opt_state, gstate, extra=stats)
    assert [e["to_step"] for e in og.events if e["event"] == "rollback"] == [4]
    same(stats, kept[3])  # the snapshot of step 4 holds what the loop had after step 3
    assert not finite(kept[5])


def test_snapshot_files_hold_the_statistics(tmp_path):
    guard = ns.TrainingGuard(snapshot_every=2, snapshot_dir=str(tmp_path), keep_snapshots=2)
    og, params, opt_state, stats, gstate = start(guard)
    for step in range(3):
        x, y = batch(step)
        params, opt_state, stats, gstate, d = train_step(
            og, True, params, opt_state, stats, gstate, x, y
        )
        if step == 1:
            at_snapshot = stats
        params, opt_state, gstate, stats = og.after_step(d, params, opt_state, gstate, extra=stats)
    zeros = jax.tree.map(jnp.zeros_like, stats)
    out = og.load_snapshot(params, opt_state, extra=zeros)
    assert len(out) == 4
    same(out[3], at_snapshot)

    # a guard without extra cannot load it as one with, and the other way round
    plain = guard.for_optax()
    plain.init(params, opt_state)
    with pytest.raises(ns.InvalidArgumentError, match="extra"):
        plain.load_snapshot(params, opt_state, extra=stats)


def test_extra_must_come_with_every_call_when_init_had_it():
    og, params, opt_state, stats, gstate = start(ns.TrainingGuard())
    x, y = batch(0)
    params, opt_state, stats, gstate, d = train_step(
        og, True, params, opt_state, stats, gstate, x, y
    )
    with pytest.raises(ns.InvalidArgumentError, match="extra= in every call"):
        og.after_step(d, params, opt_state, gstate)
    assert len(og.after_step(d, params, opt_state, gstate, extra=stats)) == 4
    with pytest.raises(ns.InvalidArgumentError, match=r"extra\['f'\]"):
        ns.TrainingGuard().for_optax().init(params, opt_state, extra={"f": print})


def test_equinox_state_with_its_bool_leaf():
    eqx = pytest.importorskip("equinox")
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", momentum=0.9, mode="ema")
    guard = ns.TrainingGuard(snapshot_every=1000)
    og = guard.for_optax()
    params = eqx.filter(model, eqx.is_array)
    opt_state = TX.init(params)
    gstate = og.init(params, opt_state, extra=state)

    @eqx.filter_jit
    def step(model, opt_state, state, gstate, x):
        def loss(m):
            out, new_state = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
                x, state
            )
            return jnp.mean(out**2), new_state

        (value, new_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        params, static = eqx.partition(model, eqx.is_array)
        params, opt_state, gstate, d = og.step(TX, params, opt_state, gstate, value, grads)
        return eqx.combine(params, static), opt_state, og.select(d, new_state, state), gstate, d

    for i in range(4):
        x = jax.random.normal(jax.random.PRNGKey(i), (8, 4))
        before = state
        model, opt_state, state, gstate, d = step(
            model, opt_state, state, gstate, x.at[0, 0].set(jnp.nan) if i == 2 else x
        )
        params, opt_state, gstate, state = og.after_step(
            d, eqx.filter(model, eqx.is_array), opt_state, gstate, extra=state
        )
        if i == 2:
            assert not bool(d.apply)
            same(state, before)
    assert finite(state)


def test_typed_prng_keys_round_trip_through_snapshot_files(tmp_path):
    """NNX keeps its dropout RNG as typed keys (``RngKey``); the file writer refused them
    ("Expected arrays, ... Received: tree['payload']['extra'][0] of type PRNGKeyArray")."""
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))
    params = {"w": jnp.ones(3)}
    rng_state = nnx.state(model, nnx.RngState)
    guard = ns.TrainingGuard(snapshot_dir=str(tmp_path), keep_snapshots=1)
    og = guard.for_optax()
    opt_state = (TX.init(params), {"key": jax.random.key(5, impl="rbg")})
    og.init(params, opt_state, extra=rng_state)
    is_key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    assert sum(map(is_key, jax.tree.leaves(rng_state))) == 1  # and its uint32 count
    other = jax.tree.map(lambda x: jax.random.key(0) if is_key(x) else x + 3, rng_state)
    *_, restored = og.load_snapshot(params, opt_state, extra=other)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(rng_state), strict=True):
        assert is_key(a) == is_key(b)
        if is_key(a):
            assert jax.random.key_impl(a) == jax.random.key_impl(b)
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    # a key of another implementation (other key data shape) is refused by name
    wrong = (opt_state[0], {"key": jax.random.key(5, impl="threefry2x32")})
    with pytest.raises(ns.InvalidArgumentError, match=r"opt_state\[1\]\['key'\]"):
        og.load_snapshot(params, wrong, extra=rng_state)
