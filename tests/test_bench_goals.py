"""benchmarks/_goals.py: a printed ratio never reads as the opposite of its verdict (the
verdict is on the unrounded ratio, so a ratio that rounds onto its goal gets more digits)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def goals(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _goals

    return _goals


@pytest.mark.parametrize(
    ("ratio", "goal", "text"),
    [
        (1.0204, 1.02, "1.0204"),  # over: three decimals would print 1.020, as if met
        (1.02, 1.02, "1.020"),  # at the goal: met, and reads so
        (1.01996, 1.02, "1.020"),  # under, rounding up onto the goal: still reads as met
        (1.0200001, 1.02, "1.0200001"),
        (1.5, 1.02, "1.500"),
        (1.5, None, "1.500"),  # no goal: three decimals
        (math.nan, 1.02, "nan"),
    ],
)
def test_ratio_text_shows_why_the_verdict(goals, ratio, goal, text):
    assert goals.ratio_text(ratio, goal) == text
    if goal is not None and not math.isnan(ratio):
        assert (float(text) <= goal) == (ratio <= goal)


def test_print_rows_prints_the_digits_the_verdict_needs(goals, capsys):
    goals.print_rows([goals.goal_row("clip", 1.0204, 1.02)], [])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split() == ["clip", "1.0204", "<=", "1.02", "NO"]
