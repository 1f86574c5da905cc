"""Misuse of the optax guard and of locate_nonfinite on the JAX libraries: each gives
``InvalidArgumentError`` naming the argument, at the call that received it, where before a
framework's own error came (or nothing, and a wrong result later). docs/semantics.md §16.8
(the optax guard, ``extra=``) and §15.3 (locate_nonfinite on JAX)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import numstab as ns  # noqa: E402
from numstab.errors import InvalidArgumentError  # noqa: E402

TX = optax.adam(1e-2)
PARAMS = {"w": jnp.ones((3,)), "b": jnp.zeros(())}


def loss_fn(params):
    return jnp.sum(params["w"] ** 2) + params["b"] ** 2


def guard_for(**settings):
    og = ns.TrainingGuard(**settings).for_optax()
    opt_state = TX.init(PARAMS)
    return og, opt_state, og.init(PARAMS, opt_state)


def one_step(og, opt_state, gstate, tx=TX, params=PARAMS, grads=None):
    loss, own = jax.value_and_grad(loss_fn)(PARAMS)
    return og.step(tx, params, opt_state, gstate, loss, own if grads is None else grads)


# -- finding 4: after_step and flush check the trees they keep -----------------------------------
def _equinox_mlp():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.PRNGKey(0))
    params, _ = eqx.partition(mlp, eqx.is_array)
    return mlp, params


def _mlp_guard(**settings):
    mlp, params = _equinox_mlp()
    og = ns.TrainingGuard(**settings).for_optax()
    opt_state = TX.init(params)
    gstate = og.init(params, opt_state)
    grads = jax.tree.map(jnp.ones_like, params)
    p, o, gstate, decision = og.step(TX, params, opt_state, gstate, jnp.float32(1.0), grads)
    return og, mlp, (p, o, gstate, decision)


@pytest.mark.parametrize("host_every", [1, 4])
def test_after_step_refuses_a_whole_equinox_module_at_once(host_every):
    """The whole module (non-array leaves) at the first after_step: before, kept silently and
    a raw TypeError from copy_tree at the first snapshot (step 100 by default)."""
    og, mlp, (_, o, gstate, decision) = _mlp_guard(host_every=host_every)
    with pytest.raises(InvalidArgumentError, match=r"params.*custom_jvp at params\.activation"):
        og.after_step(decision, mlp, o, gstate)


def test_after_step_refuses_a_whole_module_on_a_later_snapshot_step():
    """Host mode: good trees first, then the module on a step that snapshots."""
    og, mlp, (p, o, gstate, decision) = _mlp_guard(snapshot_every=2)
    p, o, gstate = og.after_step(decision, p, o, gstate)
    grads = jax.tree.map(jnp.ones_like, p)
    p, o, gstate, decision = og.step(TX, p, o, gstate, jnp.float32(1.0), grads)
    assert bool(decision.snapshot)
    with pytest.raises(InvalidArgumentError, match=r"params\.activation"):
        og.after_step(decision, mlp, o, gstate)


def test_flush_refuses_a_whole_module_when_it_snapshots_and_keeps_the_decisions():
    og, mlp, (p, o, gstate, decision) = _mlp_guard(snapshot_every=1, host_every=8)
    p, o, gstate = og.after_step(decision, p, o, gstate)
    with pytest.raises(InvalidArgumentError, match=r"params\.activation"):
        og.flush(mlp, o, gstate)
    assert len(og._pending) == 1  # a rejected flush drops nothing
    og.flush(p, o, gstate)
    assert [e["event"] for e in og.events].count("snapshot") == 2


def test_after_step_that_flushes_keeps_its_decision_only_once_its_trees_pass():
    """host_every=2: the second after_step flushes; rejected for its trees, it kept nothing
    (before, its decision stayed pending and the retry counted the step twice)."""
    og, mlp, (p, o, gstate, decision) = _mlp_guard(snapshot_every=2, host_every=2)
    p, o, gstate = og.after_step(decision, p, o, gstate)
    grads = jax.tree.map(jnp.ones_like, p)
    p, o, gstate, decision = og.step(TX, p, o, gstate, jnp.float32(1.0), grads)
    with pytest.raises(InvalidArgumentError, match=r"params\.activation"):
        og.after_step(decision, mlp, o, gstate)
    assert len(og._pending) == 1 and og._steps_seen == 1
    p, o, gstate = og.after_step(decision, p, o, gstate)
    assert og._pending == [] and og._steps_seen == 2
    assert og.history.as_arrays()["step"].tolist() == [0, 1]


# -- finding 5: a linen Module (it has a dtype field) is not an array -----------------------------
def test_init_refuses_a_linen_module_as_params_and_takes_numpy_and_numbers():
    linen = pytest.importorskip("flax.linen")
    og = ns.TrainingGuard().for_optax()
    with pytest.raises(InvalidArgumentError, match="leaf of type Dense at params"):
        og.init(linen.Dense(3), TX.init(PARAMS))
    params = {"w": np.ones(3, np.float32), "s": np.float32(2.0), "n": 3}
    og.init(params, TX.init(params))  # real arrays and numbers: as before


# -- finding 6: step checks tx, params, opt_state and the gradients' structure --------------------
def test_step_refuses_a_tx_that_is_not_a_transformation():
    og, o, g = guard_for()
    with pytest.raises(InvalidArgumentError, match=r"tx to be an optax\.GradientTransformation"):
        one_step(og, o, g, tx="adam")


@pytest.mark.parametrize("jitted", [False, True])
def test_step_refuses_gradients_of_another_structure(jitted):
    og, o, g = guard_for()

    def step(grads):
        return og.step(TX, PARAMS, o, g, jnp.float32(1.0), grads)

    with pytest.raises(InvalidArgumentError, match="gradients with the structure of params"):
        (jax.jit(step) if jitted else step)({"w": jnp.ones((3,))})


def test_step_refuses_linen_variables_as_params():
    og, o, g = guard_for()
    loss, grads = jax.value_and_grad(loss_fn)(PARAMS)
    with pytest.raises(InvalidArgumentError, match="gradients with the structure of params"):
        og.step(TX, {"params": PARAMS}, o, g, loss, grads)


def test_step_refuses_an_nnx_module_as_params_and_an_nnx_optimizer_as_opt_state():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    og = ns.TrainingGuard().for_optax()
    opt_state = TX.init(params)
    g = og.init(params, opt_state)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(InvalidArgumentError, match="gradients with the structure of params"):
        og.step(TX, model, opt_state, g, jnp.float32(1.0), grads)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    with pytest.raises(InvalidArgumentError, match=r"Received: opt_state of type Optimizer"):
        og.step(TX, params, optimizer, g, jnp.float32(1.0), grads)


def test_step_refuses_a_whole_equinox_module_as_params():
    og, mlp, (p, o, gstate, _) = _mlp_guard()
    grads = jax.tree.map(jnp.ones_like, p)
    with pytest.raises(InvalidArgumentError, match=r"params\.activation"):
        og.step(TX, mlp, o, gstate, jnp.float32(1.0), grads)


def test_step_refuses_another_optimizers_state_and_keeps_the_optimizers_own_error():
    og, _, g = guard_for()
    with pytest.raises(InvalidArgumentError, match="Received: opt_state of type tuple"):
        one_step(og, optax.sgd(0.1, momentum=0.9).init(PARAMS), g)

    def update(updates, state, params=None):
        raise RuntimeError("the optimizer's own")

    fitting = optax.GradientTransformation(TX.init, update)  # the state is what init makes
    with pytest.raises(RuntimeError, match="the optimizer's own"):
        one_step(og, TX.init(PARAMS), g, tx=fitting)


# -- finding 7: a snapshot file's payload names must match the guard's exactly --------------------
def _guard_with_files(directory, extra):
    og = ns.TrainingGuard(snapshot_every=3, snapshot_dir=str(directory)).for_optax()
    opt_state = TX.init(PARAMS)
    kw = {} if extra is None else {"extra": extra}
    g = og.init(PARAMS, opt_state, **kw)
    p, o = PARAMS, opt_state
    for _ in range(6):
        p, o, g, decision = one_step(og, o, g, params=p)
        p, o, g, *_ = og.after_step(decision, p, o, g, **kw)
    return og, opt_state, kw


@pytest.mark.parametrize("with_extra", [False, True])
def test_load_snapshot_refuses_a_file_with_other_payload_names(tmp_path, with_extra):
    """A file written with extra= loaded into a guard without it (the statistics were dropped
    silently), and the reverse."""
    stats = {"mean": jnp.zeros((3,))}
    _guard_with_files(tmp_path / "w", None if with_extra else stats)
    reader, opt_state, kw = _guard_with_files(tmp_path / "r", stats if with_extra else None)
    name = "snapshot-000000006.npz"
    shutil.copy(tmp_path / "w" / name, tmp_path / "r" / name)
    want = ["params", "opt_state", "extra"] if with_extra else ["params", "opt_state"]
    with pytest.raises(InvalidArgumentError) as info:
        reader.load_snapshot(PARAMS, opt_state, step=6, **kw)
    assert f"Expected a snapshot of an optax guard (payload {want}, exactly)" in str(info.value)


# -- finding 8: locate_nonfinite's positional inputs on JAX libraries -----------------------------
def _models():
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")
    linen = pytest.importorskip("flax.linen")
    dense = linen.Dense(3)
    variables = dense.init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
    return {
        "equinox": eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0)),
        "nnx": nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
        "linen": dense.bind(variables),
    }


def _not_traceable():
    torch = pytest.importorskip("torch")
    return {
        "torch": torch.ones(1, 2),
        "str": "abc",
        "object array": np.array([object(), object()]),
    }


@pytest.mark.parametrize("library", ["equinox", "nnx", "linen"])
@pytest.mark.parametrize("kind", ["torch", "str", "object array"])
def test_locate_refuses_an_input_jax_cannot_trace(library, kind):
    from numstab.locate import locate_nonfinite

    model, bad = _models()[library], _not_traceable()[kind]
    with pytest.raises(InvalidArgumentError, match=r"Expected inputs\[0\].*at inputs\[0\]"):
        locate_nonfinite(model, bad)


def test_locate_names_the_input_and_the_leaf_and_takes_numbers_none_and_static_keywords():
    """Positional numbers and None (an optional argument) are traced as before, and a
    keyword that is not an array stays static (§15.3)."""
    from numstab.locate import jax as locate_jax
    from numstab.locate import locate_nonfinite

    def model(x, scale, mask, *, deterministic):
        assert deterministic is True
        return locate_jax.layer("a", lambda p, x: x * scale, {}, x)

    x = jnp.ones((2,))
    with pytest.raises(InvalidArgumentError, match=r"at inputs\[2\]\['mask'\]"):
        locate_nonfinite(model, x, 2.0, {"mask": "abc"}, deterministic=True, backend="jax")
    with pytest.raises(InvalidArgumentError, match="at targets"):
        locate_nonfinite(
            model,
            x,
            2.0,
            None,
            loss_fn=lambda o, t: o.sum(),
            targets="y",
            deterministic=True,
            backend="jax",
        )
    report = locate_nonfinite(model, x, 2.0, None, deterministic=True, backend="jax")
    assert not report.found


def test_locate_refuses_a_keyword_array_jax_cannot_trace():
    """A torch tensor keyword looks like an array (shape, dtype), so it is traced: refused by
    name (before, JAX's raw TypeError); a Python bool keyword stays static."""
    from numstab.locate import locate_nonfinite

    torch = pytest.importorskip("torch")
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x, mask=None, *, deterministic=False):
            return self.linear(x) if mask is None else self.linear(x * mask)

    net = Net(eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0)))
    with pytest.raises(InvalidArgumentError, match=r"at model_kwargs\['mask'\]"):
        locate_nonfinite(net, jnp.ones((2,)), mask=torch.ones(2), deterministic=True)
    assert not locate_nonfinite(net, jnp.ones((2,)), mask=jnp.ones(2), deterministic=True).found
