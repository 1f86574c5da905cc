"""``smooth_labels`` refuses a ``num_classes`` past what the backend's class ids hold, with a
numstab error on every backend (before: NumPy's "Maximum allowed size exceeded", torch's and
JAX's OverflowError, TensorFlow's ValueError); and a bound checked on an int past float64
keeps its sign in the message (``min_value=-10**400`` was reported as ``inf``)."""

import numpy as np
import pytest

import numstab as ns
from numstab.errors import InvalidArgumentError
from tests.backend_arrays import as_backend


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow", "jax"])
def test_num_classes_past_the_id_dtype_raises(backend):
    ids = as_backend(backend, np.array([1], np.int32))
    with pytest.raises(InvalidArgumentError, match=r"Expected num_classes <= \d+ \(class ids"):
        ns.smooth_labels(ids, 0.1, num_classes=10**30)


def test_an_int_past_float64_keeps_its_sign():
    with pytest.raises(InvalidArgumentError, match=r"min_value=-inf"):
        ns.clip_by_value(np.ones(2, np.float32), -(10**400), 1.0)
