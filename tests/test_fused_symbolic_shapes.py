"""fused_linear_cross_entropy needs static shapes (docs §11): a jax.export symbolic
dimension is refused with the typed error TensorFlow's unknown dimension gets."""

import jax
import jax.numpy as jnp
import pytest
from jax import export

from numstab import fused_linear_cross_entropy
from numstab.errors import InvalidArgumentError


def _export(fn, *specs):
    return export.export(jax.jit(fn))(*specs)


def test_symbolic_batch_is_not_static():
    (b,) = export.symbolic_shape("b")
    weight = jnp.ones((10, 4))
    hidden = jax.ShapeDtypeStruct((b, 4), jnp.float32)
    labels = jax.ShapeDtypeStruct((b,), jnp.int32)
    with pytest.raises(InvalidArgumentError, match=r"hidden of rank >= 1 with a static shape"):
        _export(lambda h, y: fused_linear_cross_entropy(h, weight, y), hidden, labels)


def test_symbolic_vocab_and_labels_are_refused():
    (b,) = export.symbolic_shape("b")
    f32, i32 = jnp.float32, jnp.int32
    hidden, labels = jax.ShapeDtypeStruct((3, 4), f32), jax.ShapeDtypeStruct((3,), i32)
    weight = jax.ShapeDtypeStruct((b, 4), f32)
    with pytest.raises(InvalidArgumentError, match=r"Expected weight of shape \(vocab, 4\)"):
        _export(lambda h, y, w: fused_linear_cross_entropy(h, w, y), hidden, labels, weight)
    sym_labels = jax.ShapeDtypeStruct((b,), i32)
    with pytest.raises(InvalidArgumentError, match=r"Expected labels of shape \(3,\)"):
        _export(
            lambda h, y: fused_linear_cross_entropy(h, jnp.ones((10, 4)), y), hidden, sym_labels
        )


def test_static_shapes_still_export():
    hidden, labels = (
        jax.ShapeDtypeStruct((3, 4), jnp.float32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
    )
    exported = _export(
        lambda h, y: fused_linear_cross_entropy(h, jnp.ones((10, 4)), y), hidden, labels
    )
    out = exported.call(jnp.ones((3, 4)), jnp.array([0, 1, 9]))
    assert jnp.allclose(out, jnp.log(10.0), rtol=1e-6)
