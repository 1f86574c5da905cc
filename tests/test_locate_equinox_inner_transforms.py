"""locate_nonfinite on JAX models whose layers call their sub-layers under a transformation
of their own (Equinox's MultiheadAttention vmaps its Linear layers; ``jax.vmap(self.fc)``
in a block): such a sub-layer is part of its caller, which is located as one layer (as a
linen or NNX attention is). Before, every such model raised "Expected the model's layers to
be called directly". The model's own top-level code under a transformation still raises it
(docs/semantics.md §15.3, "Transformations inside the model").
"""

from __future__ import annotations

import pytest

import numstab as ns

jax = pytest.importorskip("jax")
jnp = jax.numpy


def test_equinox_multihead_attention_is_one_layer():
    eqx = pytest.importorskip("equinox")

    class Head(eqx.Module):
        fc: eqx.nn.Linear

        def __call__(self, x):
            return jax.vmap(self.fc)(x)  # Equinox's idiom: one token at a time

    class Net(eqx.Module):
        attn: eqx.nn.MultiheadAttention
        head: Head

        def __call__(self, x, mask):
            return self.head(self.attn(x, x, x, mask=mask))

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    net = Net(eqx.nn.MultiheadAttention(2, 8, key=keys[0]), Head(eqx.nn.Linear(8, 3, key=keys[1])))
    x = jax.random.normal(keys[2], (5, 8))
    mask = jnp.tril(jnp.ones((5, 5), bool))
    loss = lambda out: out.sum()
    clean = ns.locate_nonfinite(net, x, mask, loss_fn=loss)
    assert not clean.found and clean.layers_checked == 4, str(clean)  # "", attn, head, loss

    where = lambda n: n.attn.value_proj.weight
    bad = eqx.tree_at(where, net, where(net).at[0, 0].set(jnp.nan))
    report = ns.locate_nonfinite(bad, x, mask, loss_fn=loss)
    assert (report.phase, report.layer, report.layer_type) == (
        "forward",
        "attn",
        "MultiheadAttention",
    )
    assert report.nonfinite_params == ("attn.value_proj.weight",), str(report)

    where = lambda n: n.head.fc.weight
    bad = eqx.tree_at(where, net, where(net).at[0, 0].set(jnp.inf))
    report = ns.locate_nonfinite(bad, x, mask, loss_fn=loss)
    assert (report.layer, report.inf_count, report.nan_count) == ("head", 5, 0), str(report)

    class TopLevelVmap(eqx.Module):  # the model's own code vmaps a layer: still refused
        fc: eqx.nn.Linear

        def __call__(self, x):
            return jax.vmap(self.fc)(x)

    with pytest.raises(ns.InvalidArgumentError, match=r"jax\.vmap.*part of that layer"):
        ns.locate_nonfinite(TopLevelVmap(net.head.fc), x, loss_fn=loss)


def test_plain_layer_calls_under_a_layers_own_scan():
    from numstab.locate.jax import layer

    w = jnp.ones((4, 4)) / 4

    def block(w, x):  # its own sub-layer, called under lax.scan and jax.vmap
        def step(h, _):
            return jax.vmap(lambda row: layer("fc", lambda w, r: r @ w, w, row))(h), None

        return jax.lax.scan(step, x, None, length=2)[0]

    def model(w, x):
        return layer("out", lambda w, h: jnp.log(h) @ w, w, layer("block", block, w, x))

    x = jnp.ones((3, 4))
    clean = ns.locate_nonfinite(model, w, x, loss_fn=jnp.sum)
    assert not clean.found and clean.layers_checked == 4, str(clean)  # "", block, out, loss
    report = ns.locate_nonfinite(model, w, x.at[0].set(-1.0), loss_fn=jnp.sum)
    assert (report.phase, report.layer) == ("forward", "out"), str(report)  # log(negative)
