"""benchmarks/data_firewall.py's reading of its own noise: a row that misses its goal times
the bare loader against itself, and the miss is called noise only where that comparison of
identical work spreads past the margin."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def data_firewall(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import data_firewall

    return data_firewall


@pytest.mark.parametrize(
    ("passes", "within_noise"),
    [
        ([1.0, 1.0, 1.01, 1.0, 0.99, 1.0, 1.0, 1.01], False),  # steady: a miss is a miss
        ([1.0, 1.3, 1.0, 0.8, 1.0, 1.2, 1.0, 0.7], True),  # +-30% from pass to pass
    ],
)
def test_noise_of_pairs_passes_in_alternating_order(
    data_firewall, monkeypatch, passes, within_noise
):
    """Round r times the two sides in turns (first then second, then second then first);
    the ratio is the median of first / second per round, with its quartiles."""
    clock = itertools.chain(passes)
    monkeypatch.setattr(data_firewall, "timed", lambda fn: (next(clock), 0))
    got = data_firewall.noise_of(lambda: 0, rounds=4)
    # rounds 0 and 2 time `first` then `second`; rounds 1 and 3 `second` then `first`
    first = [passes[0], passes[3], passes[4], passes[7]]
    second = [passes[1], passes[2], passes[5], passes[6]]
    ratios = sorted(a / b for a, b in zip(first, second, strict=True))
    assert got["bare_against_itself"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    q1, q3 = got["bare_against_itself_quartiles"]
    assert q1 <= got["bare_against_itself"] <= q3
    assert got["miss_within_noise"] is within_noise
