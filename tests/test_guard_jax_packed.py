"""The optax guard's packed decision (3 leaves out of the jitted step instead of 10): the
same values as ``policy.Decision``, readable field by field under jit and on the host, and
``after_step`` still takes a plain ``Decision``."""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

from numstab.frameworks.jax.guard import PackedDecision, _check, check  # noqa: E402
from numstab.guard import SpikeDetector, TrainingGuard, policy  # noqa: E402

GUARD = TrainingGuard(
    loss_spikes=SpikeDetector(window=8, sigma=3.0, warmup=4),
    grad_norm_spikes=SpikeDetector(window=8, sigma=3.0, warmup=4),
    snapshot_every=3,
    rollback_after=2,
    rollback_window=4,
)


def _grads(scale):
    return {"a": jnp.full((3,), scale, jnp.float32), "b": jnp.full((2, 2), -scale, jnp.float32)}


def test_packed_decision_holds_the_policy_decision_exactly():
    state = GUARD.init_state("jax")
    packed_step = jax.jit(lambda s, loss, g: check(GUARD, s, loss, g))
    plain_step = jax.jit(lambda s, loss, g: _check(GUARD, s, loss, g))
    losses = [1.0, 1.1, 0.9, 1.0, 1.05, 50.0, math.nan, 1.0, math.inf, 1.0]
    seen = set()
    for i, loss in enumerate(losses):
        grads = _grads(1e30 if i == 7 else 1.0 + 0.01 * i)
        packed, new = packed_step(state, jnp.float32(loss), grads)
        d, want = plain_step(state, jnp.float32(loss), grads)
        assert isinstance(packed, PackedDecision) and len(jax.tree.leaves(packed)) == 3
        got = packed.unpack()
        for field in policy.Decision._fields:  # every value, bit for bit
            np.testing.assert_array_equal(getattr(got, field), getattr(d, field), err_msg=field)
            np.testing.assert_array_equal(getattr(packed, field), getattr(d, field))
        assert got.apply.dtype == jnp.bool_ and got.reasons.dtype == jnp.int32
        assert got.step.dtype == jnp.int32 and got.layer_norms.shape == (2,)
        assert packed.reason_names == d.reason_names and repr(packed) == repr(d)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
        seen.add(int(d.reasons))
        state = new
    assert seen >= {0, 1, 2, 4}  # applied, NaN/inf loss, inf norm, a loss spike


def test_packed_row_is_exact_and_untracked_layers_are_none():
    guard = TrainingGuard(track_layers=False)
    d, _ = guard.decide(guard.init_state("jax"), jnp.float32(2.5), jnp.float32(math.inf), be="jax")
    packed = PackedDecision.pack(d._replace(layer_norms=None))
    assert not packed.tracked and packed.layer_norms is None
    assert packed.row.shape == (8,) and packed.row.dtype == jnp.float32
    assert int(packed.reasons) == 2 and not bool(packed.apply)
    assert float(packed.loss) == 2.5 and math.isinf(float(packed.grad_norm))
    with pytest.raises(AttributeError):
        packed.not_a_field  # noqa: B018


def test_after_step_takes_packed_and_plain_decisions_alike():
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((3,))}
    runs = {}
    for kind in ("packed", "plain"):
        og = TrainingGuard(snapshot_every=2).for_optax()
        p, o = params, tx.init(params)
        g = og.init(p, o)
        for i in range(5):
            loss = jnp.float32(math.nan if i == 3 else 1.0)
            p, o, g, d = og.step(tx, p, o, g, loss, {"w": jnp.full((3,), 0.5)})
            p, o, g = og.after_step(d if kind == "packed" else d.unpack(), p, o, g)
        runs[kind] = (p, og)
    (pp, a), (pl, b) = runs["packed"], runs["plain"]
    np.testing.assert_array_equal(pp["w"], pl["w"])
    untimed = [[{k: v for k, v in e.items() if k != "time"} for e in og.events] for og in (a, b)]
    assert untimed[0] == untimed[1]
    assert [e["step"] for e in a.events if e["event"] == "skip"] == [3]
    h1, h2 = a.history.as_arrays(), b.history.as_arrays()
    np.testing.assert_array_equal(h1["layer_norms"], h2["layer_norms"])
