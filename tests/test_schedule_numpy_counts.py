"""``schedule.for_optax()`` takes a NumPy integer array count past int32 as the step it is
(§12.3): JAX without x64 wrapped a 0-d int64 array of 2**40 to 0 (the warmup's start) and
2**32 + 50 to 50, where a Python or NumPy int of the same value gave min_lr."""

import numpy as np
import pytest

pytest.importorskip("optax")
jax = pytest.importorskip("jax")

from numstab.schedules import warmup_cosine_schedule  # noqa: E402

SCHEDULE = warmup_cosine_schedule(
    0.1, warmup_steps=10, total_steps=100, min_lr=0.01, warmup_start_lr=0.001
)


@pytest.mark.parametrize(
    "count",
    [2**40, np.int64(2**40), np.array(2**40), np.array(2**32 + 50), np.array([2**40, 2**33])],
)
def test_counts_past_int32_give_min_lr(count):
    lr = np.asarray(SCHEDULE.for_optax()(count))
    # min_lr through float32 arithmetic: within a few ulps of 0.01
    np.testing.assert_allclose(
        lr, np.full(np.shape(count), 0.01), rtol=4 * np.finfo(np.float32).eps
    )


def test_in_range_integer_arrays_keep_their_steps():
    counts = np.array([0, 10, 55], np.int64)
    got = np.asarray(SCHEDULE.for_optax()(counts))
    want = [SCHEDULE(int(c)) for c in counts]
    eps = np.finfo(np.float32).eps  # float32 terms of size base_lr: a few ulps of 0.1
    np.testing.assert_allclose(got, want, rtol=4 * eps, atol=4 * eps * 0.1)
