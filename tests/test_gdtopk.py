"""Tests for compress.ratios: the iteration timer of a group server and the dynamic GDTopK ratio
policy (both directions, the push-weighted mean held at the target, bounds, smoothing,
hysteresis and the rate limit), driven with made-up times."""

from __future__ import annotations

import math

import pytest

from minips.compress.ratios import EPS, SPREAD, RatioPolicy

TARGET = 0.01


def mean(ratios: dict[int, float], workers: dict[int, int], times: dict[int, float]) -> float:
    """Mean kept fraction over the pushes: group g makes workers[g] / times[g] pushes per s."""
    pushes = {g: workers[g] / times[g] for g in ratios}
    return sum(pushes[g] * r for g, r in ratios.items()) / sum(pushes.values())


def policy(direction: str = "slower-more", **kw: float) -> RatioPolicy:
    return RatioPolicy(TARGET, direction=direction, **kw)


@pytest.mark.parametrize("direction", ["slower-more", "slower-less"])
def test_ratios_follow_the_direction_and_hold_the_push_weighted_mean(direction: str) -> None:
    p = policy(direction)
    workers = {0: 4, 1: 2, 2: 2}
    times = {0: 0.1, 1: 0.2, 2: 0.4}
    for g, t in times.items():
        p.observe(g, t, 0.0)
    r = p.propose(workers, now=0.0)
    assert r is not None and set(r) == {0, 1, 2}
    assert mean(r, workers, times) == pytest.approx(TARGET, rel=1e-6)
    if direction == "slower-more":  # slower groups send more per push, in proportion
        assert r[0] < r[1] < r[2]
        assert r[1] / r[0] == pytest.approx(2.0) and r[2] / r[0] == pytest.approx(4.0)
    else:
        assert r[0] > r[1] > r[2]
        assert r[0] / r[2] == pytest.approx(4.0)
    assert all(TARGET / SPREAD <= v <= TARGET * SPREAD for v in r.values())


def test_bounds_clamp_and_the_mean_is_still_held() -> None:
    p = policy()
    times = {0: 0.01, 1: 0.02, 2: 50.0}  # one group 5000x slower
    for g, t in times.items():
        p.observe(g, t, 0.0)
    r = p.compute({0: 1, 1: 1, 2: 1})
    assert r[2] == pytest.approx(TARGET * SPREAD)  # the slow one clamped at hi
    assert r[1] / r[0] == pytest.approx(2.0)  # the others keep their proportion
    assert mean(r, {0: 1, 1: 1, 2: 1}, times) == pytest.approx(TARGET, rel=1e-6)
    q = policy("slower-less")
    times = {0: 0.01, 1: 50.0}
    for g, t in times.items():
        q.observe(g, t, 0.0)
    r = q.compute({0: 1, 1: 20})  # the slow group's ratio hits lo, the fast one holds the mean
    assert r[1] == pytest.approx(TARGET / SPREAD)
    assert mean(r, {0: 1, 1: 20}, times) == pytest.approx(TARGET, rel=1e-6)


def test_equal_times_give_every_group_the_target() -> None:
    p = policy()
    for g in (0, 1):
        p.observe(g, 0.3, 0.0)
    assert p.compute({0: 3, 1: 5}) == pytest.approx({0: TARGET, 1: TARGET})


def test_changes_follow_the_times_with_smoothing_hysteresis_and_rate_limit() -> None:
    p = policy(tau_s=2.0, every_s=1.0)
    workers = {0: 2, 1: 2}
    p.observe(0, 0.1, 0.0)
    p.observe(1, 0.1, 0.0)
    first = p.propose(workers, now=0.0)
    assert first == pytest.approx({0: TARGET, 1: TARGET})
    # group 1 slows down: 2 s later its average has moved 1 - exp(-1) of the way to 0.3
    p.observe(1, 0.3, 2.0)
    assert p.times[1] == pytest.approx(0.1 + (1 - math.exp(-1)) * 0.2)
    assert p.propose(workers, now=2.5) is not None
    p.observe(1, 0.6, 2.6)  # slower still
    assert p.propose(workers, now=3.0) is None  # rate limit: within 1 s of the last
    second = p.propose(workers, now=3.5)
    assert second is not None and second[1] / second[0] == pytest.approx(p.times[1] / 0.1)
    assert mean(second, workers, p.times) == pytest.approx(TARGET)
    # a change smaller than EPS is not worth new ratios, however long one waits
    p.observe(1, p.times[1] * (1 + EPS / 4), 100.0)
    assert p.propose(workers, now=100.0) is None
    # group 1 speeds up again: the ratios come back to equal
    p.observe(1, 0.1, 200.0)
    third = p.propose(workers, now=200.0)
    assert third is not None and third[1] == pytest.approx(third[0], rel=1e-6)


def test_smoothing_is_over_time_not_over_reports() -> None:
    """Ten reports 0.1 s apart move the average as far as one report 1 s later."""
    many, one = policy(tau_s=5.0), policy(tau_s=5.0)
    for p in (many, one):
        p.observe(0, 0.1, 0.0)
    for i in range(1, 11):
        many.observe(0, 0.3, 0.1 * i)
    one.observe(0, 0.3, 1.0)
    assert many.times[0] == pytest.approx(one.times[0])
    assert 0.1 < one.times[0] < 0.3


def test_a_seed_counts_until_the_first_report_which_replaces_it() -> None:
    p = policy()
    p.seed(0, 0.05)
    p.seed(1, 0.05)
    assert p.compute({0: 1, 1: 1}) == pytest.approx({0: TARGET, 1: TARGET})
    p.observe(1, 0.5, 0.0)  # replaces the seed (no blending with a compute-only step time)
    assert p.times[1] == 0.5
    p.seed(1, 0.05)  # a later seed does not override a measured time
    assert p.times[1] == 0.5
    for bad in (0.0, -1.0, float("nan"), None, True):
        p.observe(0, bad, 0.0)  # type: ignore[arg-type]
    assert p.times[0] == 0.05


def test_groups_without_workers_or_times_are_left_out() -> None:
    p = policy()
    p.observe(0, 0.1, 0.0)
    p.observe(1, 0.2, 0.0)
    r = p.compute({0: 2, 1: 0, 2: 3})  # group 1 empty, group 2 never measured
    assert r == pytest.approx({0: TARGET})
    assert p.compute({}) == {}
