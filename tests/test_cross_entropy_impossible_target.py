"""§4.4.7: a target logit of -inf (or probability mass on a -inf class) costs +inf whatever
else the row holds, a NaN or +inf logit included, on every backend; elsewhere NaN wins."""

from __future__ import annotations

import numpy as np
import pytest

import numstab as ns

NAN, INF = float("nan"), float("inf")
ROWS = np.array([[-INF, NAN, 1.0], [-INF, INF, 1.0], [0.5, NAN, 1.0]], np.float32)
HARD = np.array([0, 0, 0])
SOFT = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], np.float32)
WANT = [INF, INF, NAN]  # the last row: a NaN logit, a finite target: NaN


def _as(backend: str, x: np.ndarray):
    if backend == "torch":
        import torch

        return torch.from_numpy(x)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.constant(x)
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x)
    return x


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow", "jax"])
@pytest.mark.parametrize("labels", [HARD, SOFT], ids=["hard", "probabilities"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_impossible_target_is_inf_whatever_the_row_holds(backend, labels, smoothing):
    out = ns.cross_entropy(
        _as(backend, ROWS),
        _as(backend, labels),
        label_smoothing=smoothing,
        reduction="none",
    )
    np.testing.assert_array_equal(np.asarray(out, np.float64), WANT)
