"""A Python list of a framework's arrays is host data that numstab stacks, as NumPy, JAX and
TensorFlow convert it. torch's ``as_tensor`` takes only 1-element tensors in a list, so
``cross_entropy([t1, t2], labels)`` raised torch's ``ValueError`` ("only one element tensors
can be converted to Python scalars") where the other backends computed the loss."""

import numpy as np
import pytest

import numstab as ns

ROWS = [[1.0, 2.0], [3.0, 4.0]]


def _make(name):
    if name == "numpy":
        return np.asarray
    if name == "torch":
        torch = pytest.importorskip("torch")
        return torch.tensor
    if name == "jax":
        return pytest.importorskip("jax.numpy").asarray
    return pytest.importorskip("tensorflow").constant


@pytest.mark.parametrize("name", ["numpy", "torch", "jax", "tensorflow"])
def test_a_list_of_rows_is_the_stacked_logits(name):
    make = _make(name)
    labels = make(np.asarray([0, 1]))
    got = ns.cross_entropy([make(np.float32(r)) for r in ROWS], labels)
    want = ns.cross_entropy(make(np.float32(ROWS)), labels)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_ragged_rows_are_a_typed_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(ns.InvalidArgumentError, match="logits"):
        ns.cross_entropy([torch.ones(2), torch.ones(3)], torch.tensor([0, 1]))
