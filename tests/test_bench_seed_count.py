"""``numstab bench --seeds N`` with a count past its bound is a numstab error (§18.7: exit 2,
nothing run): before, a count past ``ssize_t`` ended in Python's OverflowError traceback."""

import pytest

from numstab.bench.spec import MAX_SEEDS, parse_seeds
from numstab.errors import InvalidArgumentError


@pytest.mark.parametrize("text", ["99999999999999999999", str(MAX_SEEDS + 1)])
def test_a_seed_count_past_the_bound_raises(text):
    with pytest.raises(InvalidArgumentError, match=r"--seeds to be a count N <= 10000"):
        parse_seeds(text)


def test_counts_and_lists_within_the_bound():
    assert parse_seeds("3") == (0, 1, 2)
    assert len(parse_seeds(str(MAX_SEEDS))) == MAX_SEEDS
    assert parse_seeds("7,99999999999999999999") == (7, 99999999999999999999)
