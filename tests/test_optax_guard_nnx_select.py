"""``og.select`` with Flax NNX state. ``nnx.state(model, nnx.BatchStat)`` holds the model's
live ``Variable`` objects, which the forward pass overwrites: a "before" copy taken so
already held the new statistics, the select chose between equal trees and a skipped NaN batch
left NaN statistics. The select now refuses two sides holding the same ``Variable`` and takes
a pure "before" (``nnx.as_pure``) against live or pure new state."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

import numstab as ns  # noqa: E402

TX = optax.adam(1e-2)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.fc(x))


def stats_of(model):
    return nnx.state(model, nnx.BatchStat)


def make_step(og, before, after):
    @nnx.jit
    def step(model, opt_state, gstate, x):
        stats = before(stats_of(model))  # taken before the forward pass
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        params = nnx.state(model, nnx.Param)
        params, opt_state, gstate, d = og.step(TX, params, opt_state, gstate, loss, grads)
        nnx.update(model, params)
        nnx.update(model, og.select(d, after(stats_of(model)), stats))
        return opt_state, gstate, d

    return step


def run(before, after, guard=None, nan_steps=(2,), steps=3, on_step=None):
    model = Net(nnx.Rngs(0))
    og = (guard or ns.TrainingGuard()).for_optax()
    opt_state = TX.init(nnx.state(model, nnx.Param))
    gstate = og.init(nnx.state(model, nnx.Param), opt_state, extra=stats_of(model))
    step = make_step(og, before, after)
    means = []
    for i in range(steps):
        x = jnp.ones((8, 4)) * (i + 1)
        if i in nan_steps:
            x = x.at[0, 0].set(jnp.nan)
        opt_state, gstate, d = step(model, opt_state, gstate, x)
        params, opt_state, gstate, extra = og.after_step(
            d, nnx.state(model, nnx.Param), opt_state, gstate, extra=stats_of(model)
        )
        nnx.update(model, params)
        nnx.update(model, extra)
        means.append((bool(d.apply), np.asarray(model.bn.mean[...])))
        if on_step is not None:
            on_step(i, model)
    return og, model, means


def identity(tree):
    return tree


@pytest.mark.parametrize(
    "after", [identity, nnx.as_pure], ids=["new live Variables", "new pure too"]
)
def test_a_pure_before_keeps_the_statistics_of_a_skipped_step(after):
    # before: the live/pure mix raised JAX's pytree structure ValueError
    _, _, means = run(nnx.as_pure, after)
    assert [applied for applied, _ in means] == [True, True, False]
    assert np.all(np.isfinite(means[1][1])) and np.any(means[1][1] != 0)
    np.testing.assert_array_equal(means[2][1], means[1][1])  # a select: exact


def test_the_same_live_variables_on_both_sides_are_refused():
    # before: accepted, and the skipped NaN step left bn.mean NaN
    with pytest.raises(ns.InvalidArgumentError, match=r"nnx\.as_pure.*\['bn'\]\['mean'\]"):
        run(identity, identity)


def test_select_of_distinct_variables_keeps_new_form():
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    old = nnx.clone(bn)
    bn.mean[...] = jnp.array([5.0, 6.0])
    skip = ns.TrainingGuard().for_optax()  # select reads only decision.apply
    for apply, want in [(True, [5.0, 6.0]), (False, [0.0, 0.0])]:
        d = type("D", (), {"apply": jnp.array(apply)})()
        out = skip.select(d, stats_of(bn), stats_of(old))
        assert isinstance(out["mean"], nnx.BatchStat)
        np.testing.assert_array_equal(out["mean"].get_value(), want)


def test_snapshots_of_live_variables_are_copies():
    """``og.init``/``after_step(extra=nnx.state(...))`` with live Variables: the snapshot is
    a copy (``copy_tree``), so the forward passes that later overwrite those Variables do not
    change it, and a rollback restores the statistics of the snapshot's step (here init's)."""
    guard = ns.TrainingGuard(snapshot_every=100, rollback_after=2)
    init_mean = np.zeros(4, np.float32)
    og, _, means = run(nnx.as_pure, identity, guard, nan_steps=(2, 3), steps=4)
    assert [e["to_step"] for e in og.events if e["event"] == "rollback"] == [0]
    assert np.any(means[1][1] != init_mean)  # the live Variables did change meanwhile
    np.testing.assert_array_equal(means[3][1], init_mean)
