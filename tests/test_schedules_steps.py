"""warmup_cosine_schedule on host (NumPy) steps under each backend, on steps that are no
dense array, and the Keras adapter's own signature."""

from __future__ import annotations

import numpy as np
import pytest

import numstab
from numstab.errors import InvalidArgumentError
from numstab.schedules import warmup_cosine_schedule

SCHEDULE = warmup_cosine_schedule(1e-3, warmup_steps=2, total_steps=10, min_lr=1e-5)
EPS32 = float(np.finfo(np.float32).eps)


def _framework_array_type(backend: str) -> type:
    if backend == "torch":
        import torch

        return torch.Tensor
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.Tensor
    if backend == "jax":
        import jax

        return jax.Array
    return np.ndarray


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow", "jax"])
@pytest.mark.parametrize("step", [0, 1, 3, 9, 12])
def test_numpy_step_becomes_the_selected_backends_array(backend, step):
    host = np.asarray([step, step + 1], dtype=np.int64)
    for value in (SCHEDULE(host, backend=backend), _under_use_backend(host, backend)):
        assert isinstance(value, _framework_array_type(backend))
        got = np.asarray(value.numpy() if hasattr(value, "numpy") else value, np.float64)
        want = np.asarray([SCHEDULE(step), SCHEDULE(step + 1)])  # Python ints: float64
        # float32 terms of size base_lr: their rounding is absolute, relative to base_lr
        np.testing.assert_allclose(got, want, rtol=0, atol=8 * EPS32 * SCHEDULE.base_lr)


def _under_use_backend(host: np.ndarray, backend: str):
    with numstab.use_backend(backend):
        return SCHEDULE(host)


def test_ragged_and_sparse_steps_are_named_as_such():
    import tensorflow as tf

    ragged = tf.ragged.constant([[1], [2, 3]])
    sparse = tf.sparse.from_dense(tf.constant([[1, 0], [0, 2]]))
    for step, kind in ((ragged, "RaggedTensor"), (sparse, "SparseTensor")):
        with pytest.raises(InvalidArgumentError, match=f"step of type {kind}"):
            SCHEDULE(step)


def test_keras_schedule_names_itself_for_an_unknown_keyword():
    from numstab.integrations.keras_schedules import WarmupCosineDecay

    with pytest.raises(TypeError, match=r"WarmupCosineDecay\.__init__\(\).*'bogus'"):
        WarmupCosineDecay(1e-3, warmup_steps=1, total_steps=5, bogus=1)
    with pytest.raises(InvalidArgumentError, match="total_steps > warmup_steps"):
        WarmupCosineDecay(1e-3, warmup_steps=5, total_steps=5)
