"""How many live workers sit at each clock, with the lowest and highest clock kept up to date.

``ssp.ClockTable`` asks for the minimum clock on every PUSH and PULL and for both ends on every
exchange with the global server; scanning its workers each time costs O(workers) per message,
which showed in profiles of a server with hundreds of workers per group. This multiset answers
both in O(1) and updates them in O(1) for the moves a table makes all the time:

- ``move(c, c + 1)`` (a push) adds the new clock before removing the old one, so when the old
  clock was the lowest and empties, the next lowest is right beside it;
- ``add`` (a join) only lowers ``low`` or raises ``high``;
- ``remove`` (a leave, an expiry) of an end that empties probes a few neighbouring clocks, then
  falls back to one pass over the distinct clocks (at most s + 2 of them under a staleness
  bound s).

Invariant: ``low == min(clocks)`` and ``high == max(clocks)`` of the multiset, both None when it
is empty (tests/test_clock_counts.py checks it against a brute-force multiset).
"""

from __future__ import annotations

__all__ = ["ClockCounts"]

NEIGHBOUR_PROBES = 8  # clocks tried next to an emptied end before one pass over all of them


class ClockCounts:
    """A multiset of int clocks with its minimum ``low`` and maximum ``high`` (None if empty)."""

    def __init__(self, clocks: list[int] | None = None) -> None:
        self._count: dict[int, int] = {}  # clock -> live workers at it (> 0)
        self.low: int | None = None
        self.high: int | None = None
        for c in clocks or ():
            self.add(c)

    def add(self, c: int) -> None:
        """One more worker at clock ``c``."""
        self._count[c] = self._count.get(c, 0) + 1
        if self.low is None or c < self.low:
            self.low = c
        if self.high is None or c > self.high:
            self.high = c

    def remove(self, c: int) -> None:
        """One worker less at clock ``c`` (``KeyError`` if none is there)."""
        left = self._count[c] - 1
        if left:
            self._count[c] = left
            return
        del self._count[c]
        if not self._count:
            self.low = self.high = None
            return
        if c == self.low:
            self.low = self._nearest(c, 1)
        if c == self.high:
            self.high = self._nearest(c, -1)

    def move(self, old: int, new: int) -> None:
        """A worker went from clock ``old`` to ``new`` (added first: see the module docstring)."""
        self.add(new)
        self.remove(old)

    def __len__(self) -> int:
        return sum(self._count.values())

    def _nearest(self, c: int, step: int) -> int:
        """The clock nearest to the emptied end ``c`` in direction ``step`` (+1 up, -1 down)."""
        for _ in range(NEIGHBOUR_PROBES):
            c += step
            if c in self._count:
                return c
        return min(self._count) if step > 0 else max(self._count)
