"""benchmarks/data_firewall.py's own parts: a row that misses its goal times the bare loader
against itself, and the miss is called noise only where it is no larger than the spread of
that comparison of identical work; the walk floor does the drop floor's work after visiting
every field."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def data_firewall(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import data_firewall

    return data_firewall


STEADY = [1.0, 1.0, 1.01, 1.0, 0.99, 1.0, 1.0, 1.01]  # identical work within 1%
NOISY = [1.0, 1.3, 1.0, 0.8, 1.0, 1.2, 1.0, 0.7]  # +-30% from pass to pass


@pytest.mark.parametrize(
    ("passes", "miss", "within_noise"),
    [
        (STEADY, 0.05, False),  # steady: a miss is a miss
        (NOISY, 0.05, True),  # a miss smaller than the spread of identical work
        (NOISY, 0.49, False),  # a miss larger than that spread is real, however noisy
    ],
)
def test_noise_of_pairs_passes_in_alternating_order(
    data_firewall, monkeypatch, passes, miss, within_noise
):
    """Round r times the two sides in turns (first then second, then second then first);
    the ratio is the median of first / second per round, with its quartiles; the noise is
    the farther quartile's distance from 1, and the miss is within it when no larger."""
    clock = itertools.chain(passes)
    monkeypatch.setattr(data_firewall, "timed", lambda fn: (next(clock), 0))
    got = data_firewall.noise_of(lambda: 0, rounds=4, miss=miss)
    # rounds 0 and 2 time `first` then `second`; rounds 1 and 3 `second` then `first`
    first = [passes[0], passes[3], passes[4], passes[7]]
    second = [passes[1], passes[2], passes[5], passes[6]]
    ratios = sorted(a / b for a, b in zip(first, second, strict=True))
    assert got["bare_against_itself"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    q1, q3 = got["bare_against_itself_quartiles"]
    assert q1 <= got["bare_against_itself"] <= q3
    assert got["noise"] == pytest.approx(max(q3 - 1, 1 - q1))
    assert got["miss"] == miss
    assert got["miss_within_noise"] is within_noise


def test_walk_floor_drops_what_the_drop_floor_drops(data_firewall):
    """``drop_walked`` (the walk floor) visits every field: a clean batch comes back as the
    same object; a dirty one loses the samples with a NaN or inf in any float field, in
    order, from every field, as ``drop_numpy`` does for the one field it knows."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    w = rng.normal(size=16)  # float64
    batch = {"x": x, "w": w, "y": np.arange(16), "ok": np.ones(16, dtype=bool)}
    assert data_firewall.drop_walked(batch) is batch
    x[[3, 9], 1] = [np.nan, np.inf]
    w[[9, 12]] = -np.inf
    got = data_firewall.drop_walked(batch)
    kept = np.setdiff1d(np.arange(16), [3, 9, 12])
    for key, value in batch.items():
        np.testing.assert_array_equal(got[key], value[kept])
    only_x = {"x": x, "y": batch["y"]}
    for key, value in data_firewall.drop_numpy(only_x).items():
        np.testing.assert_array_equal(data_firewall.drop_walked(only_x)[key], value)


@pytest.mark.parametrize(
    ("field", "error"),
    [
        ([0.0] * 4, TypeError),  # not an array
        (np.ones(()), TypeError),  # no batch axis: len() of a 0-d array
        (np.zeros(3), ValueError),  # another batch size
        (np.zeros(4, dtype=complex), TypeError),  # no route for its dtype
        (np.zeros(4, dtype=">f4"), TypeError),  # nor for a byte-swapped one
    ],
)
def test_walk_floor_refuses_what_it_does_not_route(data_firewall, field, error):
    with pytest.raises(error):
        data_firewall.drop_walked({"x": np.zeros((4, 2), dtype=np.float32), "f": field})
