"""Tests of minips.core.ssp: O(1) lowest / highest clock vs a brute-force multiset."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minips.core.ssp import NEIGHBOUR_PROBES, ClockCounts

# (op, clock): clocks spread wider than NEIGHBOUR_PROBES so the one-pass fallback runs too
OP = st.tuples(st.sampled_from(["add", "remove", "move", "move"]),
               st.integers(0, 3 * NEIGHBOUR_PROBES))


def _check(counts: ClockCounts, brute: collections.Counter[int]) -> None:
    live = +brute  # drop zero counts
    assert counts.low == (min(live) if live else None)
    assert counts.high == (max(live) if live else None)
    assert len(counts) == sum(live.values())


@settings(max_examples=300, deadline=None)
@given(start=st.lists(st.integers(0, 20), max_size=10), ops=st.lists(OP, max_size=200))
def test_ends_match_a_brute_force_multiset(start: list[int], ops: list[tuple[str, int]]) -> None:
    counts, brute = ClockCounts(start), collections.Counter(start)
    _check(counts, brute)
    for op, c in ops:
        held = sorted(+brute)
        if op == "add" or not held:
            counts.add(c)
            brute[c] += 1
        else:
            old = held[c % len(held)]  # a clock someone holds: the lowest, highest or between
            if op == "remove":
                counts.remove(old)
            else:  # a push (old + 1) or any other move, as a rejoin far away
                new = old + 1 if c % 2 else c
                counts.move(old, new)
                brute[new] += 1
            brute[old] -= 1
        _check(counts, brute)


def test_push_of_the_last_worker_at_the_lowest_clock() -> None:
    counts = ClockCounts([3, 3, 5])
    counts.move(3, 4)
    assert (counts.low, counts.high) == (3, 5)
    counts.move(3, 4)
    assert (counts.low, counts.high) == (4, 5)
    counts.move(5, 6)
    assert (counts.low, counts.high) == (4, 6)


def test_far_ends_and_empty() -> None:
    counts = ClockCounts([0, 1000])
    counts.remove(0)
    assert counts.low == counts.high == 1000
    counts.remove(1000)
    assert counts.low is None and counts.high is None and len(counts) == 0
    with pytest.raises(KeyError):
        counts.remove(1000)
