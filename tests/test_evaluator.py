"""The evaluator's pace near the end of a run: it PULLs just after the likely end of the budget,
whatever the budget is (wall time, epochs, or every worker's ``max_steps`` pushes), so the final
weights are scored, and the run ends, within about ``END_PULL_S`` of the last push."""

from __future__ import annotations

import math

import pytest

from minips.core.config import RunConfig
from minips.evaluator import END_PULL_S, budget_left_s, next_pull_s
from minips.wire import messages
from minips.wire.fields import Payload


def weights(samples: int, train_s: float) -> messages.GlobalWeights:
    return messages.GlobalWeights(version=1, done=False, size=0, samples=samples, t=0.0,
                                  train_s=train_s, payload=Payload("dense-f32", {}, ()))


def test_a_max_steps_budget_is_every_workers_pushes_at_the_rate_so_far() -> None:
    run = RunConfig(workers=3, max_steps=100, batch_size=64, eval_every_s=5.0)
    # 19,200 samples in all; 13,568 done in 3.0 s: 5,632 left at 4,523 samples/s
    assert budget_left_s(run, weights(13_568, 3.0)) == pytest.approx(5_632 * 3.0 / 13_568)
    left = budget_left_s(run, weights(13_568, 3.0))
    assert next_pull_s(run, left, since_pull=0.0) == pytest.approx(left)  # not the 5 s period
    assert next_pull_s(run, left - 2.0, since_pull=2.0) == END_PULL_S  # scoring took 2 s


def test_no_budget_to_tell_by_leaves_the_period() -> None:
    run = RunConfig(workers=3, max_steps=100, eval_every_s=5.0)
    assert budget_left_s(run, weights(0, 0.0)) == math.inf  # nothing trained yet: no rate
    assert budget_left_s(RunConfig(epochs=0.0, wall_s=0.0), weights(500, 2.0)) == math.inf
    assert next_pull_s(run, math.inf, since_pull=1.0) == pytest.approx(4.0)


def test_the_wall_budget_and_the_samples_budget_the_sooner_of_the_two() -> None:
    run = RunConfig(workers=2, max_steps=10, batch_size=50, wall_s=60.0)  # 1,000 samples
    assert budget_left_s(run, weights(500, 2.0)) == pytest.approx(2.0)  # not 58 s
    assert budget_left_s(run, weights(500, 59.0)) == pytest.approx(1.0)  # the wall's
