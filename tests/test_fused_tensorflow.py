"""TensorFlow's in-place weight-gradient update (numstab.frameworks.tensorflow.fused) against
NumPy: blocks that divide the vocabulary (one add per block, on a reshaped view) and blocks
that leave a remainder (row by row), one or several blocks per loop iteration."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
fused = pytest.importorskip("numstab.frameworks.tensorflow.fused")

WIDTH = 8


@pytest.mark.parametrize(
    ("vocab", "target", "block", "divides", "per_iteration"),
    [
        (12, 4, 4, True, 16),
        (12, 5, 4, True, 16),
        (11, 3, 3, False, 16),
        (12, 12, 12, True, 16),
        (7, 100, 7, True, 16),
        (24, 2, 2, True, 4),  # 12 blocks, 4 per loop iteration: 3 iterations
        (14, 2, 2, True, 4),  # 7 blocks, a prime: 1 per iteration
        (25, 2, 2, False, 4),  # 12 blocks of 2, 4 per iteration, and a row left over
    ],
)
def test_matmul_accumulate_in_blocks(monkeypatch, vocab, target, block, divides, per_iteration):
    monkeypatch.setattr(fused, "_ACCUMULATE_BLOCK_BYTES", 4 * WIDTH * target)
    monkeypatch.setattr(fused, "_BLOCKS_PER_ITERATION", per_iteration)
    assert fused._block_rows(vocab, WIDTH, 4) == (block, divides)
    rng = np.random.default_rng(0)
    acc, a, b = (
        rng.normal(size=(vocab, WIDTH)),
        rng.normal(size=(5, vocab)),
        rng.normal(size=(5, WIDTH)),
    )
    acc, a, b = (np.float32(x) for x in (acc, a, b))

    @tf.function
    def step(acc, a, b):
        acc = acc * 2.0  # a tensor of this graph, as the running sum is
        return fused.matmul_accumulate(acc, a, b), acc  # acc read again: Snapshot must copy

    got, before = step(acc, a, b)
    np.testing.assert_allclose(got.numpy(), 2 * acc + a.T @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(before.numpy(), 2 * acc, rtol=0, atol=0)
