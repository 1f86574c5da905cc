"""Trees of flax NNX variables and modules, Equinox modules holding non-array leaves, and
generators (torch's ``model.parameters()``), in every tree function (docs §6, §15).

Before: an NNX ``Param`` (it forwards ``.dtype``) and an ``nnx.Linear`` (a ``dtype=None``
setting) were leaves, read on the host by ``np.asarray`` eagerly and refused under
``nnx.jit``; an NNX ``PytreeState`` (a registered node without children) was a leaf; an
Equinox MLP's activation function and a BatchNorm's axis name were leaves ("Expected tree
leaves to be an array of numbers"); a generator was a leaf.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import numstab as ns
from numstab.tree import flatten, leaves_with_paths, unflatten

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


EPS32 = float(np.finfo(np.float32).eps)  # float32 sums of a few squares: a few ulps


def _nnx():
    return pytest.importorskip("flax.nnx")


def _eqx():
    return pytest.importorskip("equinox")


def _nnx_model_and_grads():
    nnx = _nnx()
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 3)))))(model)
    return model, grads


def _reference_norm(tree) -> float:
    return math.sqrt(sum(float(jnp.sum(x.astype(jnp.float32) ** 2)) for x in tree))


def test_nnx_grads_clip_under_nnx_jit():
    nnx = _nnx()
    model, grads = _nnx_model_and_grads()
    expected = _reference_norm(jax.tree_util.tree_leaves(grads))

    @nnx.jit
    def step(m):
        g = nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 3)))))(m)
        clipped, norm = ns.clip_by_global_norm(g, 1.0)
        return norm, ns.global_norm(clipped), ns.all_finite(g)

    norm, clipped_norm, finite = step(model)
    assert isinstance(norm, jax.Array) and float(norm) == pytest.approx(expected, rel=16 * EPS32)
    assert float(clipped_norm) == pytest.approx(1.0, rel=16 * EPS32) and bool(finite)


def test_nnx_grads_stay_jax_arrays_eagerly():
    _, grads = _nnx_model_and_grads()
    leaves, treedef = flatten(grads)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)  # no host copy
    norm = ns.global_norm(grads)
    assert isinstance(norm, jax.Array)  # was numpy.float32: every Param read on the host
    clipped, _ = ns.clip_by_global_norm(grads, 1e-3)
    assert type(clipped) is type(grads)
    rebuilt = unflatten(treedef, leaves)
    assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(grads)
    out = ns.clip_by_value(grads, -0.5, 0.5)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(out)) <= 0.5


def test_finite_summary_of_nnx_grads_eager_and_jitted():
    nnx = _nnx()
    model, grads = _nnx_model_and_grads()
    summary = ns.finite_summary(grads)
    assert summary.sums.shape == (4,)

    @nnx.jit
    def step(m):
        return ns.finite_summary(nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 3)))))(m))

    assert step(model).sums.shape == (4,)
    with ns.check_numerics(mode="sentinel") as cn:
        cn.watch(step(model), "grads")
        cn.check()


def test_whole_nnx_models_and_states_are_scanned():
    nnx = _nnx()

    class Net(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

    net = Net()
    assert ns.find_nonfinite(nnx.Linear(3, 4, rngs=nnx.Rngs(0))) == []
    assert ns.find_nonfinite(net) == [] and ns.find_nonfinite(nnx.state(net)) == []
    ns.assert_finite(net)
    assert bool(ns.all_finite(net.linear)) and float(ns.global_norm(net.linear)) > 0
    net.linear.kernel[...] = net.linear.kernel[...].at[0, 1].set(jnp.nan)
    (record,) = ns.find_nonfinite(net)
    assert record.path == ".linear.kernel.value" and record.nan_count == 1
    (record,) = ns.find_nonfinite(nnx.state(net))
    assert record.path == "['linear']['kernel'].value"
    with pytest.raises(ns.NonFiniteError) as info:
        ns.assert_finite(net, "model")
    assert info.value.framework == "jax"
    with ns.check_numerics(mode="sentinel") as cn:
        cn.watch(net, "model")
        with pytest.raises(ns.NonFiniteError):
            cn.check()
    # the Rngs' count is a uint32 array: the documented integer-leaf error, not "RngKey"
    with pytest.raises(ns.InvalidArgumentError, match="dtype=uint32"):
        ns.all_finite(nnx.state(net))


def test_registered_node_without_children_is_an_empty_container():
    nnx = _nnx()
    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    paths = [p for p, _ in leaves_with_paths(linear)]
    assert paths == [".bias.value", ".kernel.value"]  # no "._pytree__state" leaf


def test_nnx_grads_in_the_stateful_clippers():
    nnx = _nnx()
    model, grads = _nnx_model_and_grads()
    on_device = lambda tree: all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(tree))
    zclip = ns.ZClip()
    out, _ = zclip.update(grads, zclip.init(grads))
    assert type(out) is type(grads) and on_device(out)  # was NumPy: read on the host
    agc = ns.AGC(0.01).clip(grads, nnx.state(model, nnx.Param))
    assert type(agc) is type(grads) and on_device(agc)
    scaler = ns.LossScaler()

    @nnx.jit
    def unscale(g, state):
        return scaler.unscale(g, state)

    unscaled, finite = unscale(grads, scaler.init())
    assert type(unscaled) is type(grads) and on_device(unscaled) and bool(finite)


def test_equinox_modules_with_functions_strings_and_numbers():
    eqx = _eqx()
    key = jax.random.PRNGKey(0)
    mlp = eqx.nn.MLP(3, 2, 4, 2, key=key)
    arrays = eqx.filter(mlp, eqx.is_array)
    assert float(ns.global_norm(mlp)) == pytest.approx(float(ns.global_norm(arrays)))
    clipped, _ = ns.clip_by_global_norm(mlp, 1e-3)
    assert clipped.activation is mlp.activation and type(clipped) is type(mlp)
    assert float(ns.global_norm(clipped)) == pytest.approx(1e-3, rel=16 * EPS32)
    assert ns.find_nonfinite(mlp) == [] and bool(ns.all_finite(mlp))
    # its axis_name "batch" and inference=False are leaves of the module
    batch_norm = eqx.nn.BatchNorm(3, "batch", mode="ema")
    assert ns.find_nonfinite(batch_norm) == []
    assert ns.find_nonfinite(eqx.nn.Lambda(jax.nn.relu)) == []
    attention = eqx.nn.MultiheadAttention(2, 4, key=key)  # dropout's rate p=0.0 is a leaf
    norm = float(ns.global_norm(attention))
    assert norm == pytest.approx(float(ns.global_norm(eqx.filter(attention, eqx.is_array))))
    bad = eqx.tree_at(lambda m: m.layers[1].bias, mlp, jnp.full((4,), jnp.inf))
    (record,) = ns.find_nonfinite(bad)
    assert record.path == ".layers[1].bias" and record.posinf_count == 4

    @eqx.filter_jit
    def step(model):
        return ns.finite_summary(model), ns.clip_by_global_norm(model, 1.0)[0]

    summary, out = step(bad)
    assert summary.sums.shape == (6,) and out.activation is mlp.activation


def test_integer_array_leaves_in_modules_keep_their_error():
    eqx = _eqx()

    class Counter(eqx.Module):
        w: jax.Array
        steps: jax.Array

    tree = Counter(jnp.ones(2), jnp.zeros((), jnp.int32))
    with pytest.raises(ns.InvalidArgumentError, match="dtype=int32"):
        ns.global_norm(tree)
    assert ns.find_nonfinite(tree) == []


def test_generators_are_read_as_lists():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = [p.detach() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.cat([p.reshape(-1) for p in params]))
    with torch.no_grad():
        assert torch.allclose(ns.global_norm(model.parameters()), expected, rtol=16 * EPS32, atol=0)
        clipped, norm = ns.clip_by_global_norm(model.parameters(), 0.1)
        assert (
            type(clipped) is list
            and len(clipped) == 4
            and torch.allclose(norm, expected, rtol=16 * EPS32, atol=0)
        )
        assert torch.allclose(ns.global_norm(clipped), torch.tensor(0.1), rtol=16 * EPS32, atol=0)
        low = ns.clip_by_value((p for p in model.parameters()), -0.01, 0.01)
        assert type(low) is list and max(float(x.abs().max()) for x in low) <= 0.01
        assert bool(ns.all_finite(model.parameters()))
        assert ns.find_nonfinite(model.parameters()) == []
        model[0].weight[0, 0] = float("nan")
    (record,) = ns.find_nonfinite(model.parameters())
    assert record.path == "[0]" and record.nan_count == 1
    with pytest.raises(ns.NonFiniteError) as info:
        ns.assert_finite(model.parameters())
    assert info.value.framework == "torch"  # the generator is read once, its items twice


def test_generator_of_containers_rebuilds_nested():
    a = np.ones(2, np.float32)
    leaves, treedef = flatten(x for x in ({"w": a}, [a, a]))
    assert len(leaves) == 3
    rebuilt = unflatten(treedef, [a * 2, a * 3, a * 4])
    assert type(rebuilt) is list and rebuilt[0]["w"][0] == 2.0 and rebuilt[1][1][0] == 4.0


def test_optimizer_state_dict_with_param_names():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert ns.find_nonfinite(state) == []  # param_names: strings, names not data
    ns.assert_finite(state)
    state["state"][0]["exp_avg"][0, 0] = float("inf")
    (record,) = ns.find_nonfinite(state)
    assert record.path == "['state'][0]['exp_avg']" and record.posinf_count == 1
    with pytest.raises(ns.InvalidArgumentError, match="str"):  # a string outside a dict
        ns.find_nonfinite([torch.ones(1), "grad"])
