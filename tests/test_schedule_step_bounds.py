"""Step counts past float64's exact integers are refused at construction (§12.2): before,
``warmup_cosine_schedule(0.1, warmup_steps=0, total_steps=10**400)`` was accepted and every
call then raised Python's OverflowError (``math.pi * count / decay``)."""

import numpy as np
import pytest

from numstab import warmup_cosine_schedule
from numstab.errors import InvalidArgumentError


@pytest.mark.parametrize(
    "warmup, total, name",
    [
        (0, 10**400, "total_steps"),
        (0, 2**53 + 1, "total_steps"),
        (10**400, 10**401, "warmup_steps"),
    ],
)
def test_step_counts_past_2_53_raise_at_construction(warmup, total, name):
    with pytest.raises(InvalidArgumentError, match=rf"Expected {name} <= 2\*\*53"):
        warmup_cosine_schedule(0.1, warmup_steps=warmup, total_steps=total)


def test_the_largest_counts_work_on_python_and_array_steps():
    schedule = warmup_cosine_schedule(0.1, warmup_steps=0, total_steps=2**53)
    assert schedule(0) == 0.1 and schedule(2**53) == 0.0
    assert float(schedule(np.array(0))) == pytest.approx(0.1, rel=1e-7)
