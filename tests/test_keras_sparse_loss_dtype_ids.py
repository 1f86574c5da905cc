"""The Keras sparse loss with a 16-bit ``dtype``: Keras converts ``y_true`` to the loss dtype
before ``call``, so float16 turned class id 2049 into 2048 and bfloat16 2051 into 2048 (a
finite, silently wrong loss; Keras' own sparse loss does the same). Where the dtype cannot hold
every id of the classes exactly, the loss now raises ``InvalidArgumentError`` (§16.11)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

import numstab as ns  # noqa: E402
from numstab.errors import InvalidArgumentError  # noqa: E402
from numstab.integrations import keras_losses as nk  # noqa: E402


def _data(classes):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, classes)).astype(np.float32)
    return x, np.array([classes - 1, classes - 3])


@pytest.mark.parametrize("dtype, classes", [("float16", 3000), ("bfloat16", 300)])
def test_a_dtype_that_rounds_class_ids_is_refused(dtype, classes):
    x, y = _data(classes)
    with pytest.raises(InvalidArgumentError, match=f"dtype={dtype!r}"):
        nk.SparseCategoricalCrossentropy(dtype=dtype)(y, x)


@pytest.mark.parametrize("dtype, classes", [("float16", 2049), ("bfloat16", 257), (None, 3000)])
def test_ids_the_dtype_holds_exactly_are_taken(dtype, classes):
    x, y = _data(classes)
    got = float(nk.SparseCategoricalCrossentropy(dtype=dtype)(y, x))
    want = float(ns.cross_entropy(x, y))
    np.testing.assert_allclose(got, want, rtol=1e-2 if dtype else 1e-6)
