"""locate_nonfinite on Flax NNX models whose layer runs under a lifted transformation of its
own (``nnx.remat``, ``nnx.jit`` on a sub-module's ``__call__``). Those write every Variable
back on exit, each a new object, so the "training mode" check (a module whose state changed
while it ran) refused every such model, in eval mode and on finite inputs too. Now a value
the transformation only passed through counts as unchanged: the layer is located as one, as
under ``jax.checkpoint`` or ``nnx.vmap``, while a real write in training mode (Dropout's RNG
count, BatchNorm's statistics) is still refused (docs/semantics.md §15.3, "Training mode").
"""

from __future__ import annotations

import pytest

from numstab.errors import InvalidArgumentError
from numstab.locate import locate_nonfinite

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
jnp = jax.numpy

TRANSFORMS = {"remat": nnx.remat, "jit": nnx.jit, "none": lambda f: f}


def _model(transform: str, *, batch_norm: bool = True, dropout: bool = True):
    lifted = TRANSFORMS[transform]

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs) if batch_norm else None
            self.drop = nnx.Dropout(0.5, rngs=rngs) if dropout else None

        @lifted
        def __call__(self, x):
            x = self.fc(x)
            x = self.bn(x) if self.bn is not None else x
            x = self.drop(x) if self.drop is not None else x
            return jnp.log(x)  # NaN for a negative input

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.block = Block(rngs)
            self.head = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.head(self.block(x))

    return Model(nnx.Rngs(0))


def _loss(out, targets):
    return jnp.sum((out - targets) ** 2)


@pytest.mark.parametrize("with_loss", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("transform", ["remat", "jit"])
def test_lifted_transform_in_eval_mode_is_located(transform, with_loss):
    model = _model(transform)
    model.eval()
    kw = {"loss_fn": _loss, "targets": jnp.zeros((2, 1))} if with_loss else {}
    # a Linear with every weight 0 and bias 1 maps any input to 1: log(1) = 0, finite
    model.block.fc.kernel[...] = jnp.zeros((4, 4))
    model.block.fc.bias[...] = jnp.ones(4)
    clean = locate_nonfinite(model, jnp.ones((2, 4)), **kw)
    assert not clean.found, str(clean)
    assert clean.layers_checked == 3 + with_loss, str(clean)  # "", block, head (, <loss>)

    model.block.fc.bias[...] = -jnp.ones(4)  # log(-1): NaN in every element of the block
    report = locate_nonfinite(model, jnp.ones((2, 4)), **kw)
    assert (report.phase, report.layer, report.layer_type) == ("forward", "block", "Block")
    assert (report.nan_count, report.inf_count) == (8, 0), str(report)
    assert model.block.bn.mean[...].shape == (4,)  # the model is still usable
    assert model(jnp.ones((2, 4))).shape == (2, 1)


@pytest.mark.parametrize("with_loss", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("transform", ["remat", "jit", "none"])
@pytest.mark.parametrize("stateful", ["dropout", "batch_norm"])
def test_training_mode_is_still_refused(transform, stateful, with_loss):
    """Dropout's RNG count advancing, BatchNorm's batch statistics updating: a real write."""
    model = _model(transform, batch_norm=stateful == "batch_norm", dropout=stateful == "dropout")
    model.train()
    kw = {"loss_fn": _loss, "targets": jnp.zeros((2, 1))} if with_loss else {}
    with pytest.raises(InvalidArgumentError, match=r"deterministic mode \(model\.eval\(\)\)"):
        locate_nonfinite(model, jnp.ones((2, 4)), **kw)
    model.eval()
    assert locate_nonfinite(model, -jnp.ones((2, 4)), **kw).layer == "block"


def test_nested_lifted_transforms():
    """``nnx.jit`` around a block whose sub-module is itself under ``nnx.remat``."""

    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)

        @nnx.remat
        def __call__(self, x):
            return self.fc(x)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.inner = Inner(rngs)

        @nnx.jit
        def __call__(self, x):
            return jnp.sqrt(self.inner(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.block, self.head = Block(rngs), nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.head(self.block(x))

    model = Model(nnx.Rngs(0))
    model.eval()
    model.block.inner.fc.kernel[...] = jnp.zeros((4, 4))
    model.block.inner.fc.bias[...] = -jnp.ones(4)  # sqrt(-1): NaN
    report = locate_nonfinite(model, jnp.ones((2, 4)), loss_fn=_loss, targets=jnp.zeros((2, 1)))
    assert (report.phase, report.layer, report.nan_count) == ("forward", "block", 8), str(report)
