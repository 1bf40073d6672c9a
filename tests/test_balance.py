"""LB-BSP (core/balance.py, ``--mode lbbsp``): the batch sizes follow the workers' speeds, a
round's gradients are averaged with their samples as weights, and with equal speeds a round is
BSP's exactly."""

from __future__ import annotations

import numpy as np

from minips import sparse
from minips.core.actions import Log
from minips.core.balance import Balancer, allocate
from minips.core.config import RunConfig
from minips.core.group_core import GroupCore
from minips.wire import messages

N = 200


def test_allocate_cuts_the_total_in_proportion_to_speed_and_keeps_the_sum() -> None:
    assert allocate(256, [1, 1, 1, 1]) == [64, 64, 64, 64]
    assert allocate(128, [4, 2, 1, 1]) == [64, 32, 16, 16]
    shares = allocate(100, [1.0, 1.0 / 1.5, 0.5, 0.25])
    assert sum(shares) == 100 and shares == sorted(shares, reverse=True)
    assert allocate(4, [1000.0, 1.0, 1.0, 1.0]) == [1, 1, 1, 1]  # each keeps a sample
    assert allocate(0, []) == []


def test_the_balancer_rebalances_after_the_first_round_then_every_r_rounds() -> None:
    b = Balancer(batch_size=64, every=3)
    for w, seconds_per_sample in ((0, 0.001), (1, 0.004)):  # worker 1 is 4x slower
        b.observe(w, seconds_per_sample * 64, 64)
    assert b.round_done([0, 1]) == {0: 102, 1: 26}  # 128 samples, 4:1
    b.observe(0, 0.004 * 102, 102)  # worker 0 slowed down to worker 1's speed
    b.observe(1, 0.004 * 26, 26)
    assert b.round_done([0, 1]) is None and b.round_done([0, 1]) is None  # rounds 2 and 3
    new = b.round_done([0, 1])  # round 4 = 1 + 3: the moving average moved half way
    assert new is not None and sum(new.values()) == 128 and new[0] < 102


def test_the_weighted_average_is_the_mean_over_all_samples() -> None:
    g1, g2 = np.full(4, 1.0, np.float32), np.full(4, 4.0, np.float32)
    out = sparse.average([g1, g2], 4, [30, 10])
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, np.full(4, 1.75), rtol=1e-6)  # (30 x 1 + 10 x 4) / 40
    sv = sparse.SparseVector(np.array([1], np.uint32), np.array([8.0], np.float32), 4)
    mixed = sparse.average([g1, sv], 4, [1, 3])
    assert isinstance(mixed, np.ndarray)
    np.testing.assert_allclose(mixed, np.array([0.25, 6.25, 0.25, 0.25]), rtol=1e-6)


def _push(clock: int, grad: np.ndarray, samples: int, step_time: float) -> messages.Push:
    return messages.Push(clock=clock, samples=samples, step_time=step_time,
                         payload=sparse.encode_vector(grad))


def _drive(mode: str, step_times: tuple[float, float], rounds: int = 6
           ) -> tuple[GroupCore, list[dict[int, int]], list[Log]]:
    """Two workers in lock step; each pushes a gradient of the batch its WEIGHTS named, its
    step taking step_times[w] x (batch / 32)."""
    run = RunConfig(workers=2, mode=mode, batch_size=32, lr=0.1, balance_every=2).validate()
    core = GroupCore(0, run, np.zeros(N, np.float32), members=[0, 1])
    rng = np.random.default_rng(0)
    batches, logs = [], []
    for r in range(rounds):
        sizes = {w: core.weights_message(w, []).batch or 32 for w in (0, 1)}
        batches.append(sizes)
        for w in (0, 1):
            grad = rng.standard_normal(N).astype(np.float32)
            msg = _push(r + 1, grad, sizes[w], step_times[w] * sizes[w] / 32)
            logs += [a for a in core.push(w, msg, 0.0) if isinstance(a, Log)]
    return core, batches, logs


def test_batches_follow_the_speeds_and_keep_the_round_total() -> None:
    _, batches, logs = _drive("lbbsp", (0.1, 0.3))
    assert batches[0] == {0: 32, 1: 32}  # nothing measured before the first round
    assert batches[1] == {0: 48, 1: 16}  # 3x faster: 3x the samples, 64 in all
    assert all(sum(b.values()) == 64 for b in batches)
    assert logs[0].event == "balance" and logs[0].fields["batches"] == {"0": 48, "1": 16}


def test_an_lbbsp_round_with_equal_speeds_is_a_bsp_round() -> None:
    lb, batches, logs = _drive("lbbsp", (0.2, 0.2))
    bsp, _, _ = _drive("bsp", (0.2, 0.2))
    assert all(b == {0: 32, 1: 32} for b in batches) and not logs
    np.testing.assert_allclose(lb.weights, bsp.weights, rtol=1e-5, atol=1e-7)
    assert lb.version == bsp.version == 6
