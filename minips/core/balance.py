"""LB-BSP's batch sizes: each worker's share of a round's samples follows its speed (sans-IO).

LB-BSP (Chen et al., SoCC'20) keeps BSP's semantics (a round is one SGD step on every sample
of the round) and removes its straggler wait by giving fast workers more of the round's samples:
if worker i needs tau_i seconds per sample, batch b_i proportional to 1 / tau_i makes
b_i x tau_i the same on every worker, and a round takes (sum b) / (sum 1 / tau) seconds, the
throughput ceiling of the profile (docs/results.md).

Exactly what minips does (``GroupCore`` holds one ``Balancer`` in mode ``lbbsp``):

- every PUSH brings its step time and its samples; ``observe`` folds step_time / samples into
  an exponential moving average per worker (weight ``SMOOTHING`` for the new value);
- after a round is applied, ``round_done`` re-balances after rounds 1, 1 + R, 1 + 2R, ... (R =
  ``every``, ``RunConfig.balance_every``, default 5): the round's total, ``batch_size`` x the live
  workers, is cut in proportion to 1 / tau_i (``allocate``: largest remainders, each worker at
  least ``MIN_BATCH``); a worker not measured yet counts at the mean speed of the others;
- the group's WEIGHTS tell each worker the batch of its next step (``Weights.batch``), so every
  PULL answered after a round sees the same allocation; the round's gradients are averaged with
  their samples as weights (``sparse.average``), so a round equals one SGD step on its whole batch.

With equal speeds every batch stays ``batch_size``: LB-BSP is then BSP exactly.

Invariants: ``sum(allocate(total, speeds)) == total``; each share >= ``MIN_BATCH`` (when the total
allows); shares are in the order of the speeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["SMOOTHING", "MIN_BATCH", "allocate", "Balancer"]

SMOOTHING = 0.5  # weight of a new seconds-per-sample measurement in the moving average
MIN_BATCH = 1  # no worker is given fewer samples (it must still push a gradient)


def allocate(total: int, speeds: Sequence[float], minimum: int = MIN_BATCH) -> list[int]:
    """``total`` samples cut in proportion to ``speeds`` (samples per second), each share at
    least ``minimum``, summing to ``total`` exactly (largest remainders)."""
    n = len(speeds)
    if n == 0:
        return []
    floor = min(minimum, total // n)
    s = sum(speeds)
    exact = [total * v / s for v in speeds]
    shares = [max(floor, math.floor(x)) for x in exact]
    for _ in range(total - sum(shares)):  # the largest remainders get one more
        shares[min(range(n), key=lambda i: shares[i] - exact[i])] += 1
    for _ in range(sum(shares) - total):  # the floor took too much: the most served give back
        shares[max((i for i in range(n) if shares[i] > floor),
                   key=lambda i: shares[i] - exact[i])] -= 1
    return shares


class Balancer:
    """The batch sizes of one LB-BSP group."""

    def __init__(self, batch_size: int, every: int) -> None:
        self.batch_size = batch_size  # the run's batch: the mean share of a round
        self.every = every  # rounds between re-balancings
        self.per_sample: dict[int, float] = {}  # worker -> smoothed seconds per sample
        self.batches: dict[int, int] = {}  # worker -> samples of its next step
        self.rounds = 0  # rounds applied

    def observe(self, w: int, step_time: float, samples: int) -> None:
        """A PUSH of worker ``w``: ``samples`` took ``step_time`` seconds."""
        if samples <= 0 or not step_time > 0:
            return
        x = step_time / samples
        old = self.per_sample.get(w, x)
        self.per_sample[w] = old + SMOOTHING * (x - old)

    def batch_of(self, w: int) -> int:
        """Samples of worker ``w``'s next step."""
        return self.batches.get(w, self.batch_size)

    def round_done(self, live: Sequence[int]) -> dict[int, int] | None:
        """A round was applied; the new ``{worker: batch}`` when a re-balancing is due and
        changes something, else None."""
        self.rounds += 1
        if (self.rounds - 1) % self.every:  # rounds 1, 1 + every, 1 + 2 every, ...
            return None
        return self.rebalance(live)

    def rebalance(self, live: Sequence[int]) -> dict[int, int] | None:
        """Cut ``batch_size`` x len(live) by the workers' speeds; None when nothing changes."""
        known = [self.per_sample[w] for w in live if w in self.per_sample]
        if not known:
            return None
        mean = sum(known) / len(known)
        speeds = [1.0 / self.per_sample.get(w, mean) for w in live]
        new = dict(zip(live, allocate(self.batch_size * len(live), speeds), strict=True))
        if all(self.batch_of(w) == b for w, b in new.items()):
            return None
        self.batches = new
        return dict(new)
