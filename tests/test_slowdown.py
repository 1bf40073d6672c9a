"""Changing speeds (core/slowdown.py): slowdown schedules, per-worker lists of them, seeded
random throttling; and the switch that keeps GSSP's first groups when speeds drift
(``--regroup off``)."""

from __future__ import annotations

import pytest

from minips.core.slowdown import Schedule, Slowdown, parse_schedule, parse_schedules, parse_throttle
from minips.errors import ConfigError


def test_a_schedule_is_a_step_function_of_training_time() -> None:
    s = parse_schedule("4@0,1@60s")
    assert [s.factor(t) for t in (-1, 0, 59.9, 60, 1e6)] == [4, 4, 4, 1, 1]
    assert s.first == 4 and s.changes and parse_schedule(s.text()) == s
    assert parse_schedule("2.5") == Schedule.flat(2.5) and not Schedule.flat(2.5).changes


def test_a_list_of_workers_keeps_the_flat_form_and_takes_schedules() -> None:
    assert parse_schedules("1,1,2x2,4") == [Schedule.flat(f) for f in (1, 1, 2, 2, 4)]
    got = parse_schedules("1,4@0,1@60s,2,3@0,1@5")
    assert got == [Schedule.flat(1), parse_schedule("4@0,1@60"), Schedule.flat(2),
                   parse_schedule("3,1@5")]


@pytest.mark.parametrize("bad", ["0", "1@5", "2,1@5,3@4", "a", "2@x"])
def test_bad_schedules_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_schedule(bad)


def test_throttling_is_seeded_per_worker_and_interval_and_stays_in_its_range() -> None:
    th = parse_throttle("0.3,2-5,10")
    assert th.text() == "0.3,2-5,10"
    factors = [th.factor(t, seed=0, worker=1) for t in range(0, 2000, 10)]
    throttled = [f for f in factors if f != 1.0]
    assert all(2 <= f <= 5 for f in throttled)
    assert 0.15 < len(throttled) / len(factors) < 0.45  # about P of the intervals
    assert factors == [th.factor(t + 9.9, seed=0, worker=1) for t in range(0, 2000, 10)]
    assert factors != [th.factor(t, seed=0, worker=2) for t in range(0, 2000, 10)]
    slow = Slowdown(parse_schedule("2"), th, seed=0, worker=1)
    assert [slow.factor(t) for t in range(0, 2000, 10)] == [2 * f for f in factors]
    with pytest.raises(ConfigError):
        parse_throttle("1.5,2-5,10")


def _drifted_roster(regroup: bool) -> list[object]:
    """A GSSP roster of 4 workers in 2 groups whose worker 3 turns fast: what maybe_regroup
    says at each of 12 looks."""
    from minips.core.config import RunConfig
    from minips.core.roster import REGROUP_EVERY_S, Roster, WorkerEntry

    run = RunConfig(mode="gssp", workers=4, groups=2, regroup=regroup).validate()
    roster = Roster(run, regroup=True)
    for w, t in enumerate((0.1, 0.1, 0.4, 0.4)):
        roster.workers[w] = WorkerEntry(w, connected=True, step_time=t)
    first = roster.first_assignment()
    for w, g in first.items():
        roster.workers[w].group = g
    roster.workers[3].step_time = 0.1
    return [roster.maybe_regroup(REGROUP_EVERY_S * (i + 1)) for i in range(12)]


def test_regroup_off_keeps_the_first_groups_when_speeds_drift() -> None:
    assert any(_drifted_roster(regroup=True))
    assert not any(_drifted_roster(regroup=False))
