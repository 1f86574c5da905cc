"""numstab.integrations.optax.loss_scaled: skipping, scale trajectory, clipping order, pytrees."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

import numstab  # noqa: E402
from numstab import InvalidArgumentError, LossScaler, LossScaleState  # noqa: E402
from numstab.integrations.optax import (  # noqa: E402
    LossScaledState,
    current_scale,
    find_loss_scale_state,
    loss_scaled,
    scale_loss,
)

# -- a small MLP -------------------------------------------------------------------------------


def mlp_params(seed: int = 0) -> dict:
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {
        "l1": {"w": jax.random.normal(k1, (4, 16)) * 0.5, "b": jax.random.normal(k2, (16,)) * 0.1},
        "l2": {"w": jax.random.normal(k3, (16, 1)) * 0.5, "b": jax.random.normal(k4, (1,)) * 0.1},
    }


def mlp_data(seed: int = 1) -> tuple:
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (32, 4)), jax.random.normal(ky, (32, 1))


def mlp_loss(params: dict, x, y):
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    out = h @ params["l2"]["w"] + params["l2"]["b"]
    return jnp.mean((out - y) ** 2)


def poisoned(grads: dict, poison):
    """grads with ``poison`` (0, inf or NaN) added to one element of one leaf."""
    w = grads["l1"]["w"].at[0, 0].add(poison)
    return {**grads, "l1": {**grads["l1"], "w": w}}


def make_step(tx, x, y, loss_factor: float = 1.0):
    @jax.jit
    def step(params, opt_state, poison):
        loss = lambda p: scale_loss(loss_factor * mlp_loss(p, x, y), opt_state)
        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(poisoned(grads, poison), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def tree_equal(a, b) -> bool:
    la, da = jax.tree.flatten(a)
    lb, db = jax.tree.flatten(b)
    pairs = zip(la, lb, strict=False)  # lengths differ only when da != db
    return da == db and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


def numpy_trajectory(scaler: LossScaler, finite_seq, start: LossScaleState | None = None):
    """The reference: LossScaler.update driven on the NumPy backend."""
    if start is None:
        state = scaler.init(backend="numpy")
    else:
        state = LossScaleState(*(np.asarray(x) for x in start))
    out = []
    for finite in finite_seq:
        state = scaler.update(state, bool(finite))
        out.append(tuple(np.asarray(x).item() for x in state))
    return out


EPS32 = float(np.finfo(np.float32).eps)


def tree_max(a, b=None) -> float:
    """max |a| over the leaves, or max |a - b| when b is given."""
    b = jax.tree.map(np.zeros_like, a) if b is None else b
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs)


def as_tuple(state: LossScaleState) -> tuple:
    return tuple(np.asarray(x).item() for x in state)


# -- training with injected overflows --------------------------------------------------------

POISON = {3: math.inf, 4: math.nan, 9: -math.inf, 10: math.inf, 14: math.nan}


@pytest.mark.parametrize(
    "scaler",
    [
        LossScaler(init_scale=2.0**10, growth_interval=3),
        LossScaler(init_scale=2.0**10, growth_interval=2, hysteresis=2, min_scale=2.0**8),
    ],
    ids=["torch-like", "hysteresis-min"],
)
def test_adam_mlp_skips_nonfinite_steps(scaler):
    x, y = mlp_data()
    tx = loss_scaled(optax.adam(1e-2), scaler)
    step = make_step(tx, x, y)
    params = mlp_params()
    opt_state = tx.init(params)

    adam = optax.adam(1e-2)  # the reference: plain adam on unscaled grads, good steps only
    ref_params, ref_state = mlp_params(), adam.init(mlp_params())

    @jax.jit
    def ref_step(p, s):
        updates, s = adam.update(jax.grad(mlp_loss)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    finite_seq, scales = [], []
    atol = 0.0  # grows with each applied step: the paths' float32 roundings accumulate
    for i in range(18):
        poison = POISON.get(i, 0.0)
        new_params, new_state = step(params, opt_state, jnp.float32(poison))
        finite = poison == 0.0
        finite_seq.append(finite)
        scales.append(as_tuple(new_state.loss_scale))
        assert bool(new_state.last_finite) is finite
        count, new_count = opt_state.inner_state[0].count, new_state.inner_state[0].count
        if finite:
            before = ref_params
            ref_params, ref_state = ref_step(ref_params, ref_state)
            # per step: an ulp of the weights (eps32 max|p|), and the update's own rounding:
            # ~16 float32 ops of adam plus gradient sums over 32 samples and 16 hidden units
            atol += EPS32 * (tree_max(ref_params) + (16 + 32 + 16) * tree_max(before, ref_params))
            assert int(new_count) == int(count) + 1
            assert not tree_equal(new_params, params)
        else:  # params and the whole inner state, count included, are untouched
            assert tree_equal(new_params, params)
            assert tree_equal(new_state.inner_state, opt_state.inner_state)
            assert int(new_count) == int(count)
        jax.tree.map(partial(np.testing.assert_allclose, rtol=0, atol=atol), new_params, ref_params)
        params, opt_state = new_params, new_state
    assert int(opt_state.total_notfinite) == len(POISON)
    assert int(opt_state.inner_state[0].count) == 18 - len(POISON)
    assert scales == numpy_trajectory(scaler, finite_seq)
    assert float(current_scale(opt_state)) == scales[-1][0]


def jmp_run(init_scale: float, period: int, finite_seq):
    jmp = pytest.importorskip("jmp")
    ls = jmp.DynamicLossScale(jnp.float32(init_scale), period=period)
    out = []
    for finite in finite_seq:
        ls = ls.adjust(jnp.asarray(finite))
        out.append((float(ls.loss_scale), int(ls.counter)))
    return out


@pytest.mark.parametrize("init_scale", [2.0**15, 2.0**126], ids=["default", "near-f32-max"])
def test_jmp_preset_matches_jmp_dynamic_loss_scale(init_scale):
    period = 4
    rng = np.random.default_rng(0)
    finite_seq = [True] * 9 + list(rng.random(60) > 0.3) + [False] * 20 + [True] * 13
    finite_seq += [False, True] * 3
    scaler = LossScaler.preset("jmp", growth_interval=period, init_scale=init_scale)
    tx = loss_scaled(optax.sgd(1e-3), scaler)
    x, y = mlp_data()
    step = make_step(tx, x, y, loss_factor=1e-6)  # no real overflow, even at a scale of 2**127
    params = mlp_params()
    opt_state = tx.init(params)
    ours = []
    for finite in finite_seq:
        params, opt_state = step(params, opt_state, jnp.float32(0.0 if finite else math.inf))
        assert bool(opt_state.last_finite) is bool(finite)
        ours.append((float(current_scale(opt_state)), int(opt_state.loss_scale.growth_tracker)))
    assert ours == jmp_run(init_scale, period, finite_seq)
    if init_scale == 2.0**15:
        assert min(s for s, _ in ours) == 1.0  # the floor was reached (jmp's min_loss_scale 1)
    else:
        assert max(s for s, _ in ours) == 2.0**127  # growth stopped below inf


# -- clipping ------------------------------------------------------------------------------------


def test_clipping_happens_after_unscaling():
    scale = 2.0**12
    true = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0, 0.0], [0.0, -0.5]])}
    scaled = jax.tree.map(lambda g: g * scale, true)
    tx = loss_scaled(optax.identity(), LossScaler(init_scale=scale), max_norm=1.0)
    updates, state = jax.jit(tx.update)(scaled, tx.init(true))

    clip = optax.clip_by_global_norm(1.0)
    expected, _ = clip.update(true, clip.init(true))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, expected)
    np.testing.assert_allclose(state.grad_norm, optax.global_norm(true), rtol=1e-6)
    np.testing.assert_allclose(optax.global_norm(updates), 1.0, rtol=1e-6)  # not 1/scale
    assert bool(state.last_finite)

    # below max_norm the unscaled grads pass unchanged
    tx = loss_scaled(optax.identity(), LossScaler(init_scale=scale), max_norm=100.0)
    updates, _ = jax.jit(tx.update)(scaled, tx.init(true))
    assert tree_equal(updates, true)


def test_clipped_nonfinite_step_gives_zero_updates():
    tx = loss_scaled(optax.sgd(1.0), LossScaler(init_scale=4.0), max_norm=1.0)
    params = {"a": jnp.ones(3)}
    grads = {"a": jnp.array([1.0, jnp.nan, 2.0])}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert tree_equal(updates, {"a": jnp.zeros(3)})
    assert not bool(state.last_finite)
    assert float(current_scale(state)) == 2.0


def test_overflowing_norm_of_finite_grads_counts_as_nonfinite():
    # every element finite, but the float32 sum of squares overflows: the step is skipped
    tx = loss_scaled(optax.sgd(1.0), LossScaler(init_scale=1.0, dynamic=False), max_norm=1.0)
    params = {"a": jnp.ones(4)}
    grads = {"a": jnp.full(4, 1e30, jnp.float32)}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert bool(numstab.all_finite(grads))
    assert not bool(state.last_finite)
    assert tree_equal(updates, {"a": jnp.zeros(4)})
    assert float(current_scale(state)) == 1.0  # a fixed scaler never moves


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_axis_name_sharded_norm_and_unanimous_skip_under_vmap(norm_type):
    """vmap with an axis_name stands in for 4 devices (test_distributed_jax uses shard_map)."""
    full = jax.random.normal(jax.random.PRNGKey(0), (8, 3)) * 10.0
    scale = 2.0**6
    tx = loss_scaled(optax.identity(), LossScaler(init_scale=scale), max_norm=2.0,
                     norm_type=norm_type, axis_name="dev")  # fmt: skip
    shards = (full * scale).reshape(4, 2, 3)
    state = jax.vmap(tx.init)(shards)
    update = jax.jit(jax.vmap(tx.update, axis_name="dev"))
    updates, new = update(shards, state)
    expected_norm = numstab.global_norm(full, norm_type)
    np.testing.assert_allclose(new.grad_norm, np.full(4, expected_norm), rtol=1e-6)
    expected, _ = numstab.clip_by_global_norm(full, 2.0, norm_type=norm_type)
    np.testing.assert_allclose(updates.reshape(8, 3), expected, rtol=1e-6)

    # one device overflows: all four skip and back off together
    bad = shards.at[2, 0, 0].set(jnp.inf)
    updates, new = update(bad, state)
    assert not np.asarray(new.last_finite).any()
    assert np.array_equal(np.asarray(current_scale(new)), np.full(4, scale / 2))
    assert not np.asarray(updates).any()
    # without axis_name only the device that saw the overflow would skip
    local = loss_scaled(optax.identity(), LossScaler(init_scale=scale))
    _, new = jax.jit(jax.vmap(local.update))(bad, jax.vmap(local.init)(bad))
    assert np.asarray(new.last_finite).tolist() == [True, True, False, True]


# -- state as a pytree ---------------------------------------------------------------------------

ODD_SCALER = LossScaler(
    init_scale=2.0**9,
    growth_factor=4.0,
    backoff_factor=0.25,
    growth_interval=3,
    hysteresis=2,
    min_scale=8.0,
    max_scale=2.0**20,
)


def odd_state(tx, params) -> LossScaledState:
    """A state with a non-default value in every field."""
    state = tx.init(params)
    inner = state.inner_state
    for _ in range(5):  # advance adam's count and moments
        _, inner = optax.adam(1e-2).update(params, inner, params)
    return LossScaledState(
        inner_state=inner,
        loss_scale=LossScaleState(jnp.float32(32.0), jnp.int32(2), jnp.int32(1)),
        last_finite=jnp.asarray(False),
        total_notfinite=jnp.int32(3),
        grad_norm=jnp.float32(1.5),
    )


def test_state_pytree_round_trip_keeps_every_field():
    params = mlp_params()
    tx = loss_scaled(optax.adam(1e-2), ODD_SCALER, max_norm=5.0)
    state = odd_state(tx, params)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(back) is LossScaledState and type(back.loss_scale) is LossScaleState
    assert tree_equal(back, state)
    assert as_tuple(back.loss_scale) == (32.0, 2, 1)
    assert int(back.inner_state[0].count) == 5
    assert tree_equal(jax.jit(lambda s: s)(state), state)
    # the three scaler arrays are leaves; the scaler's configuration is not in the state
    n_inner = len(jax.tree.leaves(state.inner_state))
    assert len(leaves) == n_inner + 3 + 3


def test_state_through_lax_scan_keeps_the_scaler_config():
    """The floor (min_scale=8) and the other non-default settings hold inside scan; jmp loses
    its min_loss_scale in a pytree round-trip (google-deepmind/jmp#44)."""
    x, y = mlp_data()
    params = mlp_params()
    tx = loss_scaled(optax.adam(1e-2), ODD_SCALER, max_norm=5.0)
    start = odd_state(tx, params)
    finite_seq = [False] * 4 + [True] * 7 + [False, True, True, True, False, False, False]
    poisons = jnp.asarray([0.0 if f else math.inf for f in finite_seq], jnp.float32)

    def body(carry, poison):
        p, s = carry
        grads = jax.grad(lambda q: scale_loss(mlp_loss(q, x, y), s))(p)
        updates, s = tx.update(poisoned(grads, poison), s, p)
        return (optax.apply_updates(p, updates), s), (s.loss_scale, s.last_finite)

    (_, end), (traj, finite) = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(
        (params, start), poisons
    )
    ours = [tuple(np.asarray(f)[i].item() for f in traj) for i in range(len(finite_seq))]
    assert np.asarray(finite).tolist() == finite_seq
    assert ours == numpy_trajectory(ODD_SCALER, finite_seq, start=start.loss_scale)
    assert min(s for s, _, _ in ours) == 8.0  # floored at min_scale, not at 1
    assert max(s for s, _, _ in ours) == 8.0 * 4**3  # grew by growth_factor 4, hysteresis 2
    assert int(end.total_notfinite) == 3 + finite_seq.count(False)

    # python loop of the same jitted step: same final state as scan
    step = jax.jit(lambda c, poison: body(c, poison)[0])
    carry = (params, start)
    for poison in poisons:
        carry = step(carry, poison)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), carry[1], end)

    jmp = pytest.importorskip("jmp")
    jls = jmp.DynamicLossScale(jnp.float32(32.0), period=3, factor=4,
                               min_loss_scale=jnp.float32(8.0))  # fmt: skip
    round_trip = jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(jls)))
    if float(round_trip.min_loss_scale) != 8.0:  # jmp 0.0.4: reset to 1.0

        def jmp_body(ls, finite):
            ls = ls.adjust(finite)
            return ls, ls.loss_scale

        _, jmp_traj = jax.lax.scan(jmp_body, jls, jnp.zeros(4, bool))
        assert float(jmp_traj[-1]) < 8.0  # jmp went below its floor; numstab did not


# -- helpers and dtypes --------------------------------------------------------------------------


def test_scale_loss_and_state_lookup():
    params = {"w": jnp.ones(2)}
    tx = optax.chain(optax.scale(1.0), loss_scaled(optax.sgd(0.1), LossScaler(init_scale=8.0)))
    state = tx.init(params)
    assert float(current_scale(state)) == 8.0
    assert find_loss_scale_state(state) is state[1].loss_scale
    loss16 = jnp.float16(3.0)
    out = scale_loss(loss16, state)
    assert out.dtype == jnp.float16 and float(out) == 24.0
    assert float(scale_loss(jnp.float32(0.5), state[1])) == 4.0
    with pytest.raises(InvalidArgumentError):
        find_loss_scale_state(optax.adam(1.0).init(params))


def test_low_precision_params_keep_their_dtypes():
    params = {"w": jnp.ones(3, jnp.bfloat16), "v": jnp.ones(2, jnp.float16)}
    tx = loss_scaled(optax.sgd(0.5), LossScaler(init_scale=4.0), max_norm=10.0)
    grads = {"w": jnp.full(3, 4.0, jnp.bfloat16), "v": jnp.full(2, 8.0, jnp.float16)}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert updates["w"].dtype == jnp.bfloat16 and updates["v"].dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -0.5)
    np.testing.assert_allclose(np.asarray(updates["v"], np.float32), -1.0)
    assert state.grad_norm.dtype == jnp.float32


def test_configured_numpy_backend_does_not_break_the_jax_transformation():
    params = {"w": jnp.ones(2)}
    tx = loss_scaled(optax.sgd(1.0), LossScaler(init_scale=4.0), max_norm=10.0)
    numstab.set_backend("numpy")
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.full(2, 8.0)}, state, params)
    np.testing.assert_array_equal(updates["w"], [-2.0, -2.0])
    assert float(scale_loss(jnp.float32(1.0), state)) == 4.0


def test_update_is_traced_without_host_callbacks():
    params = mlp_params()
    tx = loss_scaled(optax.adam(1e-3), max_norm=1.0)
    jaxpr = str(jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, tx.init(params)))
    assert "cond[" in jaxpr and "callback" not in jaxpr


# -- bad input -----------------------------------------------------------------------------------


def test_integer_grads_raise():
    params = {"w": jnp.ones(2, jnp.int32)}
    tx = loss_scaled(optax.sgd(0.1))
    with pytest.raises(InvalidArgumentError, match="floating"):
        tx.update(params, tx.init(params), params)
    with pytest.raises(InvalidArgumentError, match="floating"):
        jax.jit(tx.update)(params, tx.init(params), params)


@pytest.mark.parametrize(
    "grads",
    [
        {"w": jnp.ones(2)},
        {"w": jnp.ones(2), "b": jnp.ones(1), "extra": jnp.ones(1)},
        {"w": jnp.ones(3), "b": jnp.ones(1)},
        [jnp.ones(2), jnp.ones(1)],
    ],
    ids=["missing-leaf", "extra-leaf", "shape", "container"],
)
def test_mismatched_trees_raise(grads):
    params = {"w": jnp.ones(2), "b": jnp.ones(1)}
    tx = loss_scaled(optax.adam(0.1))
    with pytest.raises(InvalidArgumentError, match="param"):
        tx.update(grads, tx.init(params), params)


def test_bad_arguments_raise():
    params = {"w": jnp.ones(2)}
    with pytest.raises(InvalidArgumentError):
        loss_scaled(object())
    with pytest.raises(InvalidArgumentError):
        loss_scaled(optax.sgd(0.1), "jmp")
    for bad in (0.0, -1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(InvalidArgumentError):
            loss_scaled(optax.sgd(0.1), max_norm=bad)
    for bad in (0.0, -2.0, math.nan):
        with pytest.raises(InvalidArgumentError):
            loss_scaled(optax.sgd(0.1), max_norm=1.0, norm_type=bad)
    tx = loss_scaled(optax.sgd(0.1))
    with pytest.raises(InvalidArgumentError, match="LossScaledState"):
        tx.update(params, optax.sgd(0.1).init(params), params)


def test_another_optimizers_or_models_state_raises_a_typed_error():
    """loss_scaled(adam).update with loss_scaled(sgd)'s state (or one made for other params)
    raised optax's AttributeError / a shape error from inside the update."""
    params = {"w": jnp.ones(2), "b": jnp.ones(1)}
    adam = loss_scaled(optax.adam(0.1))
    for state in (
        loss_scaled(optax.sgd(0.1, momentum=0.9)).init(params),
        adam.init({"w": jnp.ones(3), "b": jnp.ones(1)}),
    ):
        with pytest.raises(InvalidArgumentError, match="inner_state") as caught:
            adam.update(params, state, params)
        assert caught.value.__cause__ is not None  # optax's own error stays attached
    with pytest.raises(InvalidArgumentError, match="inner_state"):  # also while traced
        jax.jit(adam.update)(params, loss_scaled(optax.sgd(0.1, momentum=0.9)).init(params))


def test_the_inner_transformations_own_errors_pass_through():
    def failing_update(updates, state, params=None):
        raise RuntimeError("inner failed")

    tx = loss_scaled(optax.GradientTransformation(lambda p: optax.EmptyState(), failing_update))
    params = {"w": jnp.ones(2)}
    with pytest.raises(RuntimeError, match="inner failed"):
        tx.update(params, tx.init(params), params)
