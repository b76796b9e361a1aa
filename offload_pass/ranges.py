"""A list of integers that adds to a range and takes a range's maximum in O(sqrt(n)).

The planner asks a memory timeline of a whole step (one position per node, tens of
thousands at scale) what its peak would be with one transfer undone, then undoes it,
once per transfer considered: a plain list makes each of those O(n), the planner's
stage quadratic in the graph.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable


class RangeAddMax:
    """The values, cut into blocks of about sqrt(n): each block keeps an amount added to
    all of it and the maximum of its own values without that amount."""

    def __init__(self, values: Iterable[int]) -> None:
        self._values = list(values)
        self._size = max(1, math.isqrt(len(self._values)))
        blocks = range(0, len(self._values), self._size)
        self._added = [0] * len(blocks)
        self._tops = [max(self._values[b : b + self._size]) for b in blocks]

    def __len__(self) -> int:
        return len(self._values)

    def to_list(self) -> list[int]:
        return [v + self._added[i // self._size] for i, v in enumerate(self._values)]

    def max(self, start: int, stop: int, default: int = 0) -> int:
        """The largest value in ``[start, stop)``; ``default`` where that is empty."""
        start, stop = max(start, 0), min(stop, len(self._values))
        if start >= stop:
            return default
        first, last = start // self._size, (stop - 1) // self._size
        if first == last:
            return self._part_max(first, start, stop)
        whole = map(operator.add, self._tops[first + 1 : last], self._added[first + 1 : last])
        return max(
            self._part_max(first, start, (first + 1) * self._size),
            self._part_max(last, last * self._size, stop),
            *whole,
        )

    def add(self, start: int, stop: int, amount: int) -> None:
        """Add ``amount`` to every value in ``[start, stop)``."""
        start, stop = max(start, 0), min(stop, len(self._values))
        if start >= stop:
            return
        first, last = start // self._size, (stop - 1) // self._size
        if first == last:
            self._part_add(first, start, stop, amount)
            return
        self._part_add(first, start, (first + 1) * self._size, amount)
        self._part_add(last, last * self._size, stop, amount)
        self._added[first + 1 : last] = [a + amount for a in self._added[first + 1 : last]]

    def _part_max(self, block: int, start: int, stop: int) -> int:
        return max(self._values[start:stop]) + self._added[block]

    def _part_add(self, block: int, start: int, stop: int, amount: int) -> None:
        self._values[start:stop] = [v + amount for v in self._values[start:stop]]
        begin = block * self._size
        self._tops[block] = max(self._values[begin : begin + self._size])
