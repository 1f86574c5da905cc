"""locate_nonfinite on Flax models whose own code runs sub-modules under a lifted
transformation (docs/semantics.md §15.3, "Transformations inside the model").

- Flax NNX: ``nnx.scan`` over stacked blocks (the scan-over-layers recipe), ``nnx.vmap``,
  ``nnx.remat``, ``nnx.jit`` in the model's own ``__call__``. The transformed sub-module runs
  as a copy, part of the model's own code (``""``), whose parameters, reported, include the
  copied sub-module's: a NaN or an inf gradient in it is found there. Before, with a loss,
  flax's raw ``ValueError: Cannot extract graph node from different trace level`` (scan,
  vmap) or the training-mode message (remat, jit; the model had no Dropout or BatchNorm).
  A module that the model does not hold, handed to such a transformation, is refused with a
  message saying so (before: the same raw ValueError, or the training-mode message).
- Flax linen: ``nn.remat(Block)(name="blocks_1")``, ``nn.scan(Block, ...)``, ``nn.vmap``,
  ``nn.jit`` and a ``__call__`` decorated with ``nn.remat`` are located as one layer each,
  named by their scope, at any depth. Before, in the model's own code, every such model was
  refused with advice about Equinox (``model(x[0])``); one level down, the enclosing module
  was blamed. A lifted function in the model's own code is refused with linen's advice.
"""

from __future__ import annotations

import pytest

from numstab.errors import InvalidArgumentError
from numstab.locate import locate_nonfinite

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _loss(out):
    return (out**2).mean()


# --------------------------------------------------------------------------- Flax NNX


def _nnx_block():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)
            self.g = nnx.Param(jnp.ones(()))

        def __call__(self, h):  # g = 0: sqrt's gradient is inf (the parameter's only)
            return h + jnp.tanh(self.lin(h)) * jnp.sqrt(self.g[...])

    return nnx, Block


def _nnx_model(transform: str):
    nnx, Block = _nnx_block()

    def stacked(rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        return make(rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Linear(4, 8, rngs=rngs)
            self.blocks = stacked(rngs) if transform in ("scan", "vmap") else Block(rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            h = self.emb(x)
            if transform == "scan":  # the scan-over-layers recipe

                @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
                def run(block, h):
                    return block(h)

            elif transform == "vmap":

                @nnx.vmap(in_axes=(0, None), out_axes=0)
                def run(block, h):
                    return block(h)

            else:
                run = getattr(nnx, transform)(lambda block, h: block(h))
            out = run(self.blocks, h)
            return self.head(out.sum(0) if transform == "vmap" else out)

    return Model(nnx.Rngs(0))


def _set_g(model, value: float) -> None:
    g = model.blocks.g
    g[...] = g[...].at[1].set(value) if g[...].ndim else jnp.asarray(value)


@pytest.mark.parametrize("transform", ["scan", "vmap", "remat", "jit"])
def test_nnx_transform_in_the_models_own_call(transform):
    model = _nnx_model(transform)
    x = jnp.ones((2, 4))
    clean = locate_nonfinite(model, x, loss_fn=_loss)
    assert not clean.found and clean.layers_checked == 4, str(clean)  # "", emb, head, loss
    assert not locate_nonfinite(model, x).found

    _set_g(model, 0.0)  # an inf gradient of a transformed block's parameter only
    report = locate_nonfinite(model, x, loss_fn=_loss)
    assert (report.phase, report.layer, report.layer_type) == ("backward", "", "Model")
    assert report.nonfinite_params and all(
        "blocks" in p and "g" in p for p in report.nonfinite_params
    ), str(report)

    _set_g(model, -1.0)  # sqrt(-1): a NaN made inside the transformed block
    for kw in ({"loss_fn": _loss}, {}):
        report = locate_nonfinite(model, x, **kw)
        assert (report.phase, report.layer, report.nan_count) == ("forward", "", 4), str(report)
    assert model(x).shape == (2, 2)  # the model is still usable


@pytest.mark.parametrize("transform", ["vmap", "remat"])
def test_nnx_module_outside_the_model_is_refused_with_its_reason(transform):
    nnx, Block = _nnx_block()
    outside = Block(nnx.Rngs(1))  # not an attribute of the model

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            if transform == "vmap":
                run = nnx.vmap(lambda block, h: block(h), in_axes=(None, 0))
            else:
                run = nnx.remat(lambda block, h: block(h))
            return self.head(run(outside, x))

    with pytest.raises(InvalidArgumentError, match=r"held by the model.*attribute of the model"):
        locate_nonfinite(Model(nnx.Rngs(0)), jnp.ones((2, 8)), loss_fn=_loss)


def test_nnx_training_mode_under_a_top_level_remat_is_still_refused():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.bn, self.head = nnx.BatchNorm(8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.remat(lambda bn, h: bn(h))(self.bn, x))

    model = Model(nnx.Rngs(0))
    with pytest.raises(InvalidArgumentError, match=r"deterministic mode \(model\.eval\(\)\)"):
        locate_nonfinite(model, jnp.ones((2, 8)), loss_fn=_loss)
    model.eval()
    assert not locate_nonfinite(model, jnp.ones((2, 8)), loss_fn=_loss).found


# --------------------------------------------------------------------------- Flax linen


def _linen_models():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            g = self.param("g", nn.initializers.ones, ())
            return h + jnp.tanh(nn.Dense(8)(h)) * jnp.sqrt(g)

    class ScanBlock(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return Block()(h), None

    class Decorated(nn.Module):
        @nn.remat
        @nn.compact
        def __call__(self, h):
            return Block()(h)

    def remat_blocks(h):
        for i in range(2):
            h = nn.remat(Block)(name=f"blocks_{i}")(h)
        return h

    class Remats(nn.Module):
        @nn.compact
        def __call__(self, h):
            return remat_blocks(h)

    lifted = {
        "remat": remat_blocks,
        "scan": lambda h: nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )(name="layers")(h, None)[0],
        "vmap": lambda h: nn.vmap(
            Block, variable_axes={"params": None}, split_rngs={"params": False}
        )(name="blocks_1")(h),
        "jit": lambda h: nn.jit(Block)(name="blocks_1")(h),
        "decorated": lambda h: Decorated(name="blocks_1")(h),
        "nested": lambda h: Remats(name="enc")(h),
    }

    def model(kind: str):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2)(lifted[kind](nn.Dense(8)(x)))

        return Model()

    return nn, model


# (the layer holding the faulty g, its layer calls with a loss, the parameter tree to edit)
LINEN = {
    "remat": ("blocks_1", 6, ("blocks_1",)),
    "scan": ("layers", 5, ("layers", "Block_0")),
    "vmap": ("blocks_1", 5, ("blocks_1",)),
    "jit": ("blocks_1", 5, ("blocks_1",)),
    "decorated": ("blocks_1", 5, ("blocks_1", "Block_0")),
    "nested": ("enc.blocks_1", 7, ("enc", "blocks_1")),
}


@pytest.mark.parametrize("kind", list(LINEN))
def test_linen_lifted_module_is_one_layer(kind):
    _, make = _linen_models()
    where, calls, path = LINEN[kind]
    model, x = make(kind), jnp.ones((2, 4))
    variables = model.init(jax.random.PRNGKey(0), x)
    clean = locate_nonfinite(model.bind(variables), x, loss_fn=_loss)
    assert not clean.found and clean.layers_checked == calls, str(clean)

    def with_g(value: float):
        params = jax.tree_util.tree_map(lambda a: a, dict(variables["params"]))
        tree = params
        for key in path[:-1]:
            tree[key] = dict(tree[key])
            tree = tree[key]
        leaf = dict(tree[path[-1]])
        leaf["g"] = jnp.full_like(leaf["g"], value)
        tree[path[-1]] = leaf
        return model.bind({"params": params})

    report = locate_nonfinite(with_g(0.0), x, loss_fn=_loss)  # an inf gradient of g only
    assert (report.phase, report.layer) == ("backward", where), str(report)
    assert report.nonfinite_params and all("g" in p for p in report.nonfinite_params)
    for kw in ({"loss_fn": _loss}, {}):
        report = locate_nonfinite(with_g(-1.0), x, **kw)  # sqrt(-1): NaN
        assert (report.phase, report.layer) == ("forward", where), str(report)


def test_linen_lifted_function_in_the_models_own_call_gets_linens_advice():
    nn, _ = _linen_models()

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = nn.Dense(8)
            run = nn.vmap(
                lambda module, h: module(h),
                variable_axes={"params": None},
                split_rngs={"params": False},
            )
            return run(dense, x)

    model, x = Model(), jnp.ones((2, 8))
    bound = model.bind(model.init(jax.random.PRNGKey(0), x))
    with pytest.raises(InvalidArgumentError, match=r"Flax linen: lift a module class"):
        locate_nonfinite(bound, x, loss_fn=_loss)


def test_linen_training_mode_and_lifted_classes_restored():
    nn, _ = _linen_models()
    remat_bn = nn.remat(nn.BatchNorm)  # made before locating: patched, then restored
    call = remat_bn.__call__

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(remat_bn(use_running_average=False, name="bn")(x))

    model, x = Model(), jnp.ones((2, 8))
    variables = model.init(jax.random.PRNGKey(0), x)
    with pytest.raises(InvalidArgumentError, match="deterministic mode"):
        locate_nonfinite(model.bind(variables, mutable=["batch_stats"]), x, loss_fn=_loss)
    assert remat_bn.__call__ is call
    assert model.apply(variables, x, mutable=["batch_stats"])[0].shape == (2, 2)
