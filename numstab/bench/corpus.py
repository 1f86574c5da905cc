"""A deterministic synthetic corpus: token streams from a seeded sparse Markov chain.

Every token has ``branching`` possible successors with Dirichlet-drawn probabilities, so the
best achievable loss is well below ``ln(vocab)`` and a model that learns shows it quickly.
The chain depends only on ``vocab`` (fixed seed); the stream, and so the data order, on the
run's seed. Batches are plain NumPy int32 arrays, identical for every framework.
"""

from __future__ import annotations

import numpy as np

CHAIN_SEED = 1234


def transition_matrix(vocab: int, branching: int = 8) -> np.ndarray:
    """(vocab, vocab) row-stochastic float64 matrix with ``branching`` non-zeros per row."""
    rng = np.random.default_rng(CHAIN_SEED)
    probs = np.zeros((vocab, vocab))
    k = min(branching, vocab)
    for row in range(vocab):
        successors = rng.choice(vocab, size=k, replace=False)
        probs[row, successors] = rng.dirichlet(np.full(k, 0.5))
    return probs


def batches(vocab: int, context: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """(steps, batch, context + 1) int32: batch i is the model's input ``[:, :-1]`` and
    targets ``[:, 1:]`` at step i. Each row is an independent walk from a random token."""
    cumulative = np.cumsum(transition_matrix(vocab), axis=1)
    cumulative[:, -1] = 1.0
    rng = np.random.default_rng(seed)
    rows = steps * batch
    out = np.empty((rows, context + 1), dtype=np.int32)
    out[:, 0] = rng.integers(0, vocab, size=rows)
    draws = rng.random((rows, context))
    for t in range(context):
        cdf = cumulative[out[:, t]]
        out[:, t + 1] = (draws[:, t : t + 1] > cdf).sum(axis=1)
    return out.reshape(steps, batch, context + 1)
