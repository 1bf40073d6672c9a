"""Tests of minips.core.ssp: staleness bound, random event orders, leases, LEAVE, BSP rounds."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minips.core.ssp import ClockError, ClockTable, Rounds
from minips.errors import RemoteProtocolError


def test_bsp_lockstep_and_waiting_for():
    t = ClockTable(staleness=0, lease_s=10.0)
    for w in range(3):
        assert t.join(w, now=0.0) == 0
    assert all(t.may_start(w) for w in range(3))
    t.push(0, 1, now=1.0)
    assert not t.may_start(0)
    assert sorted(t.waiting_for(0)) == [1, 2]
    t.push(1, 1, now=1.0)
    assert t.waiting_for(0) == [2]
    t.push(2, 1, now=1.0)
    assert t.min_clock() == 1 and all(t.may_start(w) for w in range(3))


def test_ssp_bound_and_lead():
    t = ClockTable(staleness=2, lease_s=10.0)
    t.join("a", 0.0)
    t.join("b", 0.0)
    for c in (1, 2, 3):
        t.push("a", c, 0.0)
    # a is at 3, b at 0: a is 3 ahead, may not start step 4 (3 - 0 > 2).
    assert t.lead("a") == 3 and not t.may_start("a")
    assert t.waiting_for("a") == ["b"]
    with pytest.raises(ClockError):
        t.push("a", 4, 0.0)
    t.push("b", 1, 0.0)
    assert t.may_start("a") and t.lead("b") == 0


def test_asp_never_blocks():
    t = ClockTable(staleness=None, lease_s=10.0)
    t.join(1, 0.0)
    t.join(2, 0.0)
    for c in range(1, 50):
        t.push(1, c, 0.0)
    assert t.may_start(1) and t.waiting_for(1) == [] and t.lead(1) == 49


def test_wrong_clock_is_a_clear_remote_error():
    t = ClockTable(staleness=3, lease_s=10.0)
    t.join(7, 0.0)
    with pytest.raises(ClockError) as info:
        t.push(7, 2, 0.0)
    assert isinstance(info.value, RemoteProtocolError)
    assert (info.value.worker, info.value.expected, info.value.got) == (7, 1, 2)
    assert "expected 1" in str(info.value)
    with pytest.raises(ClockError):
        t.push(7, 0, 0.0)  # a repeated / old clock
    with pytest.raises(ClockError, match="not live"):
        t.push(8, 1, 0.0)


def test_leave_unblocks_waiters_and_rejoin_gets_clock_back():
    t = ClockTable(staleness=1, lease_s=10.0)
    t.join("fast", 0.0)
    t.join("slow", 0.0)
    t.push("fast", 1, 0.0)
    t.push("fast", 2, 0.0)
    assert t.waiting_for("fast") == ["slow"]
    t.leave("slow")
    assert t.may_start("fast") and t.live == ["fast"] and t.min_clock() == 2
    # The slow worker comes back: its old clock 0 is below the group's minimum, so it gets 2.
    assert t.join("slow", 5.0) == 2
    assert t.clocks == {"fast": 2, "slow": 2}


def test_rejoin_keeps_its_own_clock_when_ahead():
    t = ClockTable(staleness=3, lease_s=10.0)
    t.join(1, 0.0)
    t.join(2, 0.0)
    t.push(1, 1, 0.0)
    t.push(1, 2, 0.0)
    t.leave(1)
    assert t.join(1, 1.0) == 2
    t.leave(2)  # now 1 (at 2) holds the minimum
    t.leave(1)
    assert t.join(2, 2.0) == 2  # nobody live: the last minimum (2) stands in for 2's old 0


def test_join_clock_is_clamped_to_the_bound():
    t = ClockTable(staleness=2, lease_s=10.0)
    t.join(1, 0.0)
    assert t.join(2, 0.0, clock=100) == 3  # at most min + s + 1
    assert t.join(3, 0.0, clock=-5) == 0  # never below the minimum


def test_lease_expiry_unblocks_waiters():
    t = ClockTable(staleness=0, lease_s=5.0)
    t.join("a", 0.0)
    t.join("b", 0.0)
    t.push("a", 1, 1.0)
    assert t.waiting_for("a") == ["b"]
    assert t.heartbeat("a", 4.0)
    assert t.expire(5.0) == []  # b silent for exactly lease_s: not yet
    assert t.expire(5.5) == ["b"]
    assert t.may_start("a") and "b" not in t
    assert not t.heartbeat("b", 6.0)  # an expired worker must rejoin
    with pytest.raises(ClockError):
        t.push("b", 1, 6.0)
    assert t.expire(9.5) == ["a"]  # last seen at 4.0
    assert t.min_clock() is None and len(t) == 0


def test_push_renews_lease_and_infinite_lease():
    t = ClockTable(staleness=1, lease_s=2.0)
    t.join(1, 0.0)
    t.push(1, 1, 1.9)
    assert t.expire(3.0) == []
    forever = ClockTable(staleness=1, lease_s=math.inf)
    forever.join(1, 0.0)
    assert forever.expire(1e12) == []


def test_bad_config():
    with pytest.raises(ValueError):
        ClockTable(staleness=-1, lease_s=1.0)
    with pytest.raises(ValueError):
        ClockTable(staleness=0, lease_s=0.0)


def test_rounds_release_each_clock_once():
    t = ClockTable(staleness=0, lease_s=10.0)
    r: Rounds[str] = Rounds()
    for w in (1, 2, 3):
        t.join(w, 0.0)
    t.push(1, 1, 0.0)
    r.add(1, "g1")
    t.push(2, 1, 0.0)
    r.add(1, "g2")
    assert r.pop_complete(t.min_clock()) == [] and r.pending(1) == 2
    t.leave(3)  # the missing worker leaves: the round completes without it
    assert r.pop_complete(t.min_clock()) == [(1, ["g1", "g2"])]
    assert r.pop_complete(t.min_clock()) == []
    with pytest.raises(ValueError):
        r.add(1, "late")


# -- property test: a scheduler that obeys may_start never breaks the bound ----------------------

EVENT = st.one_of(
    st.tuples(st.just("push"), st.integers(0, 5)),
    st.tuples(st.just("push"), st.integers(0, 5)),  # pushes are the common case
    st.tuples(st.just("join"), st.integers(0, 5)),
    st.tuples(st.just("leave"), st.integers(0, 5)),
    st.tuples(st.just("beat"), st.integers(0, 5)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
)


def _apply(t: ClockTable, event: tuple, now: float) -> float:
    kind, arg = event
    if kind == "tick":
        now += arg
        t.expire(now)
    elif kind == "join":
        t.join(arg, now)
    elif kind == "leave":
        t.leave(arg)
    elif kind == "beat":
        t.heartbeat(arg, now)
    elif arg in t and t.may_start(arg):
        t.push(arg, t.clocks[arg] + 1, now)
    elif arg in t:
        with pytest.raises(ClockError):  # the table itself refuses a push past the bound
            t.push(arg, t.clocks[arg] + 1, now)
    return now


def _check(t: ClockTable, s: int | None, last_min: int) -> int:
    clocks = t.clocks
    if not clocks:
        assert t.min_clock() is None and t.max_clock() is None
        return last_min
    low = min(clocks.values())
    # the table's O(1) ends (ssp.py) against a scan of its workers
    assert (t.min_clock(), t.max_clock()) == (low, max(clocks.values()))
    assert low >= last_min, "the minimum clock went backwards"
    assert any(t.may_start(w) for w in clocks), "deadlock: no live worker may start"
    if s is not None:
        assert max(clocks.values()) - low <= s + 1
        for w in clocks:
            if t.may_start(w):
                assert clocks[w] - low <= s
            else:
                assert t.waiting_for(w) and all(clocks[v] == low for v in t.waiting_for(w))
    return low


@settings(max_examples=300, deadline=None)
@given(
    s=st.one_of(st.none(), st.integers(0, 4)),
    events=st.lists(EVENT, min_size=1, max_size=120),
)
def test_bound_holds_under_random_event_orders(s, events):
    t = ClockTable(staleness=s, lease_s=4.0)
    now, last_min = 0.0, 0
    for w in range(3):
        t.join(w, now)
    for event in events:
        now = _apply(t, event, now)
        last_min = _check(t, s, last_min)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(EVENT, min_size=1, max_size=120))
def test_bsp_rounds_release_every_push_once_and_only_when_complete(events):
    t = ClockTable(staleness=0, lease_s=4.0)
    rounds: Rounds[tuple[int, int]] = Rounds()
    now, pushed, released = 0.0, [], []
    for w in range(3):
        t.join(w, now)
    for kind, arg in events:
        if kind == "push" and arg in t and t.may_start(arg):
            clock = t.push(arg, t.clocks[arg] + 1, now)
            rounds.add(clock, (arg, clock))
            pushed.append((arg, clock))
        elif kind != "push":
            now = _apply(t, (kind, arg), now)
        released += _release(t, rounds)
    t.join(0, now)  # the live workers (at least one) catch up with the last round pushed
    released += _release(t, rounds)
    target = max((c for _, c in pushed), default=0)
    while t.min_clock() < target:
        for w in t.live:
            if t.may_start(w) and t.clocks[w] < target:
                pushed.append((w, t.push(w, t.clocks[w] + 1, now)))
                rounds.add(pushed[-1][1], pushed[-1])
        released += _release(t, rounds)
    assert sorted(released) == sorted(pushed)


def _release(t: ClockTable, rounds: Rounds) -> list:
    out = []
    for clock, items in rounds.pop_complete(t.min_clock()):
        assert all(c >= clock for c in t.clocks.values()), "released an incomplete round"
        assert {c for _, c in items} == {clock}
        out += items
    return out


def _simulate(staleness, step_times, horizon):
    """Discrete-event run of workers with fixed step times; returns each one's final clock."""
    t = ClockTable(staleness=staleness, lease_s=math.inf)
    for w in range(len(step_times)):
        t.join(w, 0.0)
    busy_until = {w: step for w, step in enumerate(step_times)}  # all start step 1 at time 0
    while True:
        w, now = min(busy_until.items(), key=lambda kv: (kv[1], kv[0]))
        if now > horizon:
            return t.clocks
        t.push(w, t.clocks[w] + 1, now)
        del busy_until[w]
        for v in t.live:  # start every idle worker that the bound now lets go
            if v not in busy_until and t.may_start(v):
                busy_until[v] = now + step_times[v]


def test_simulated_speeds_follow_the_mode():
    fast_slow = [1.0, 2.0]
    assert _simulate(None, fast_slow, 100.5) == {0: 100, 1: 50}  # ASP: nobody waits
    assert _simulate(0, fast_slow, 100.5) == {0: 50, 1: 50}  # BSP: lockstep with the slowest
    ssp = _simulate(3, fast_slow, 101.5)  # slow pushed 50 at t=100, fast 54 at t=101
    assert ssp == {0: 54, 1: 50}  # SSP: the fast one runs s + 1 steps ahead, then waits


def test_restore_takes_saved_clocks_within_the_bound() -> None:
    t = ClockTable(staleness=2, lease_s=5.0)
    t.join("gone", 0.0, 0)
    t.leave("gone")
    t.restore({"a": 7, "b": 10, "c": 9}, now=100.0)
    assert t.clocks == {"a": 7, "b": 10, "c": 9} and t.min_clock() == 7
    assert t.may_start("c") and not t.may_start("b") and t.waiting_for("b") == ["a"]
    assert t.push("a", 8, 101.0) == 8
    assert t.join("late", 101.0, 0) == 8  # the restored minimum is the floor for joiners
    assert t.expire(105.5) == ["b", "c"]  # leases run from `now` of the restore


@pytest.mark.parametrize("clocks", [{"a": 0, "b": 4}, {"a": -1}, {"a": 1.5}])
def test_restore_refuses_clocks_that_break_the_bound(clocks: dict[Any, Any]) -> None:
    t = ClockTable(staleness=2, lease_s=5.0)
    t.restore({"x": 3}, now=0.0)
    with pytest.raises(ValueError):
        t.restore(clocks, now=1.0)
    assert t.clocks == {"x": 3}  # a refused restore changes nothing
    asp = ClockTable(staleness=None, lease_s=5.0)
    asp.restore({"a": 0, "b": 400}, now=0.0)  # no bound in ASP
    assert asp.lead("b") == 400
