"""A worker's calibration: the step time it reports before it is grouped, from the steps it
timed (worker.calibrated_step_time), given step times as a CPU quota or a hiccup makes them."""

from __future__ import annotations

import pytest

from minips.worker import (
    CALIB_WINDOW_S,
    CALIB_WINDOWS,
    calibrated_step_time,
    calibration_done,
)


def quota_steps(compute_s: float, share: float, period_s: float, total_s: float) -> list[float]:
    """Step times of ``compute_s`` of CPU each under a quota of ``share`` of a core per
    ``period_s`` (the kernel's CFS bandwidth control): the process runs until its share of the
    period is spent, then waits for the next period; a step that straddles the wait takes it."""
    times, now, used = [], 0.0, 0.0  # wall clock; CPU used in the current period
    while now < total_s:
        start, left = now, compute_s
        while left > 1e-12:
            period_end = (int(now / period_s + 1e-9) + 1) * period_s
            budget = share * period_s - used
            if budget <= 1e-12:  # throttled until the next period
                now, used = period_end, 0.0
                continue
            run = min(left, budget, period_end - now)
            now, used, left = now + run, used + run, left - run
            if now >= period_end - 1e-12:
                used = 0.0
        times.append(now - start)
    return times


def test_a_worker_held_to_a_fifth_of_a_core_reports_its_throttled_pace() -> None:
    """5 ms steps under a 20% quota of a 100 ms period: four steps a period, 25 ms each on
    average, though most steps take 5 ms. The fastest step (what was reported before) said
    5 ms, faster than a free worker at 13 ms; the windows' median says 25."""
    throttled = quota_steps(0.005, 0.2, 0.1, 1.0)
    assert min(throttled) == pytest.approx(0.005)  # what the fastest step said
    assert sorted(throttled)[len(throttled) // 2] == pytest.approx(0.005)  # a plain median too
    free = [0.013] * 60
    assert calibrated_step_time(throttled) == pytest.approx(0.025, rel=0.15)
    assert calibrated_step_time(free) == pytest.approx(0.013)
    assert calibrated_step_time(throttled) > calibrated_step_time(free)


def test_one_disturbed_window_does_not_count() -> None:
    """A free worker whose start-up shares the core once (one 400 ms step): the median window
    reports its own pace, not the hiccup's."""
    times = [0.010] * 30 + [0.4] + [0.010] * 60
    assert calibrated_step_time(times) == pytest.approx(0.010)


def test_steps_longer_than_a_window_report_their_median() -> None:
    """A slow board (0.5-0.7 s steps): each step is a window of its own; the median step."""
    assert calibrated_step_time([0.7, 0.5, 0.6]) == pytest.approx(0.6)
    assert calibrated_step_time([0.5, 3.0, 0.6, 0.55, 0.52]) == pytest.approx(0.55)


def test_a_short_rest_joins_the_last_window() -> None:
    """Windows of at least ``window_s`` (0.25 s): 2 x 125 ms, 4 x 62.5 ms, 1 x 250 ms, and a
    62.5 ms step left over that joins the last window (mean 156.25 ms) instead of counting as a
    window of its own (which would make the median 93.75 ms)."""
    times = [0.125] * 2 + [0.0625] * 4 + [0.25, 0.0625]
    assert calibrated_step_time(times, window_s=0.25) == pytest.approx(0.125)


def test_calibration_times_enough_steps_and_windows() -> None:
    window = [CALIB_WINDOW_S / 10] * 10
    assert not calibration_done([], 1)
    assert not calibration_done(window * (CALIB_WINDOWS - 1), 5)  # too few windows
    assert calibration_done(window * CALIB_WINDOWS, 5)
    assert not calibration_done([2.0, 2.0], 5)  # slow steps: still the steps asked for
    assert calibration_done([2.0] * 5, 5)
