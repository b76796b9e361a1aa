"""The range structure the memory timeline keeps its live bytes in."""

from __future__ import annotations

import random

import pytest

from offload_pass.ranges import RangeAddMax


@pytest.mark.parametrize("size", [1, 2, 7, 16, 101, 1000])
def test_range_additions_and_maxima_match_a_plain_list(size):
    rng = random.Random(size)
    plain = [rng.randrange(-(10**9), 10**12) for _ in range(size)]
    ranges = RangeAddMax(plain)
    for _ in range(400):
        start, stop = sorted(rng.randrange(-2, size + 3) for _ in range(2))
        if rng.random() < 0.5:
            amount = rng.randrange(-(10**9), 10**9)
            ranges.add(start, stop, amount)
            for i in range(max(start, 0), min(stop, size)):
                plain[i] += amount
        else:
            assert ranges.max(start, stop, default=-1) == max(
                plain[max(start, 0) : max(stop, 0)], default=-1
            )
    assert ranges.to_list() == plain
    assert len(ranges) == size


def test_an_empty_range_has_the_default_and_changes_nothing():
    ranges = RangeAddMax([3, 1, 4, 1, 5])
    ranges.add(3, 3, 100)
    assert ranges.max(2, 2) == 0 and ranges.max(4, 1, default=-7) == -7
    assert ranges.to_list() == [3, 1, 4, 1, 5]
    assert RangeAddMax([]).max(0, 1) == 0
