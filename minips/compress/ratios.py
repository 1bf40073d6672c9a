"""GDTopK's server-side part: each group's upload ratio from its measured iteration time
(sans-IO: no asyncio, no sockets, no clock; time comes in as ``now``). The global server runs
``RatioPolicy`` (``GDTopKCompressor.ratio_policy`` builds it).

The quantity. A group server measures each worker's *iteration time*, the figure the grouping
uses too: the wall time between consecutive pushes of the worker (its PULL, the weights over its
link, compute, the push over its link) less the time the SSP bound held its PULL (waiting for the
group's slowest is no part of its pace), averaged per worker over the pushes since its last
exchange, then over its workers (``core/ssp.py``, ``Iterations``). It reports it with every
exchange (stats field ``iter_time``). Compute-only step times would miss what GDTopK is about: a
group whose link is slow iterates slowly too.

The policy (``RatioPolicy``), run by the global server:

1. Smoothing: an exponential moving average over time, ``ema_g += w * (iter_time - ema_g)``
   with ``w = 1 - exp(-dt / tau)`` for a report ``dt`` seconds after the group's previous one
   (``tau`` = 5 s): a fast group that exchanges ten times a second is smoothed over the same
   seconds as a slow one. A group that has not reported yet uses the iteration time the
   grouping saw (``seed``), replaced, not blended, by its first report.
2. Shape: ``gdtopk_ratios`` with ``alpha``: ``slower-more`` gives a group
   ``floor * (t_g / t_fastest) ** alpha`` (slower groups, which push less often, send more per
   push), ``slower-less`` ``floor * (t_slowest / t_g) ** alpha`` (slower groups send less, to
   narrow the gap), clamped to ``[lo, hi]`` = ``[target / SPREAD, min(1, target * SPREAD)]``.
3. Level: ``floor`` is solved (bisection) so that the *push-weighted* mean kept fraction,
   ``sum_g p_g r_g / sum_g p_g`` with ``p_g = n_g / t_g`` the pushes per second of group g
   (``n_g`` workers, smoothed iteration time ``t_g``), equals the target (the run's ``ratio``).
   So ``--ratio`` means the same upload budget for ``gdtopk`` as for ``topk``: the mean kept
   fraction of the pushes the cluster makes, hence the same bytes per push on average (the
   matched-bytes comparison of docs/results.md), whatever the split between the groups.
4. Hysteresis and rate: a new set of ratios is proposed at most every ``every_s`` seconds, and
   only when some group's ratio moved by more than ``eps`` (relative) from what it has now.
   When one changes, all are replaced, so the mean stays at the target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from minips.errors import ConfigError

__all__ = ["RatioPolicy", "gdtopk_ratios", "SPREAD", "EPS", "EVERY_S", "TAU_S"]

SPREAD = 10.0  # ratios stay within [target / SPREAD, target * SPREAD]
EPS = 0.1  # relative change of some group's ratio that is worth sending new ratios
EVERY_S = 1.0  # at most one new set of ratios per this many seconds
TAU_S = 5.0  # time constant of the iteration times' moving average (seconds)
FLOOR_RANGE = (1e-9, 1e3)  # where the bisection looks for the floor (clamping does the rest)


def gdtopk_ratios(
    group_step_times: Sequence[float],
    *,
    floor: float = 0.004,
    alpha: float = 1.0,
    direction: str = "slower-more",
    lo: float = 0.001,
    hi: float = 0.05,
) -> list[float]:
    """Per-group kept fraction from each group's step time (seconds): ``slower-more`` gives
    ``floor * (t_g / t_fastest) ** alpha``, ``slower-less`` ``floor * (t_slowest / t_g) **
    alpha``, clamped to ``[lo, hi]``."""
    times = [float(t) for t in group_step_times]
    if any(not math.isfinite(t) or t <= 0.0 for t in times):
        raise ConfigError(f"group step times must be finite and > 0, got {times}")
    if not 0.0 < lo <= hi <= 1.0 or alpha < 0.0:
        raise ConfigError(f"need 0 < lo <= hi <= 1 and alpha >= 0, got {lo=}, {hi=}, {alpha=}")
    if direction == "slower-more":
        rel = [t / min(times) for t in times] if times else []
    elif direction == "slower-less":
        rel = [max(times) / t for t in times]
    else:
        raise ConfigError(f"direction must be 'slower-more' or 'slower-less', got {direction!r}")
    return [min(hi, max(lo, floor * r**alpha)) for r in rel]


class RatioPolicy:
    """Per-group GDTopK ratios from smoothed iteration times (see the module docstring)."""

    def __init__(self, target: float, *, direction: str = "slower-more", alpha: float = 1.0,
                 tau_s: float = TAU_S, eps: float = EPS, every_s: float = EVERY_S) -> None:
        self.target = target
        self.direction, self.alpha, self.tau_s, self.eps, self.every_s = (
            direction, alpha, tau_s, eps, every_s)
        self.lo, self.hi = target / SPREAD, min(1.0, target * SPREAD)
        self.times: dict[int, float] = {}  # group -> smoothed iteration time (s)
        self.measured: dict[int, float] = {}  # group -> `now` of its last report (not a seed)
        self.ratios: dict[int, float] = {}  # group -> the ratio last proposed
        self._at = -math.inf  # `now` of the last proposal

    def seed(self, g: int, step_time: float) -> None:
        """A first guess for group ``g`` (its workers' iteration time as the grouping saw it)
        until it reports."""
        if g not in self.measured and _valid(step_time):
            self.times[g] = float(step_time)

    def observe(self, g: int, iter_time: float, now: float) -> None:
        """Group ``g`` reported a mean iteration time at ``now``; invalid (0, missing) reports
        are ignored."""
        if not _valid(iter_time):
            return
        if g in self.measured:
            w = 1.0 - math.exp(-max(0.0, now - self.measured[g]) / self.tau_s)
            self.times[g] += w * (iter_time - self.times[g])
        else:
            self.times[g] = float(iter_time)
        self.measured[g] = now

    def compute(self, workers: Mapping[int, int]) -> dict[int, float]:
        """``{group: ratio}`` for the groups in ``workers`` (``{group: worker count}``) that
        have a time, with the push-weighted mean at the target."""
        ids = sorted(g for g, n in workers.items() if g in self.times and n > 0)
        if not ids:
            return {}
        times = [self.times[g] for g in ids]
        weights = [workers[g] / t for g, t in zip(ids, times, strict=True)]  # pushes per s

        def at(floor: float) -> list[float]:
            return gdtopk_ratios(times, floor=floor, alpha=self.alpha,
                                 direction=self.direction, lo=self.lo, hi=self.hi)

        def mean(floor: float) -> float:
            return sum(w * r for w, r in zip(weights, at(floor), strict=True)) / sum(weights)

        low, high = FLOOR_RANGE  # mean(floor) is monotone: bisect on a log scale
        for _ in range(80):
            mid = math.sqrt(low * high)
            low, high = (mid, high) if mean(mid) < self.target else (low, mid)
        return dict(zip(ids, at(math.sqrt(low * high)), strict=True))

    def propose(self, workers: Mapping[int, int], now: float) -> dict[int, float] | None:
        """New ratios when the rate limit allows and some group's changed by more than
        ``eps`` (or a group has none yet); else None. A proposal is taken as sent."""
        if now - self._at < self.every_s:
            return None
        new = self.compute(workers)
        if not any(g not in self.ratios or abs(r - self.ratios[g]) > self.eps * self.ratios[g]
                   for g, r in new.items()):
            return None
        self._at = now
        self.ratios.update(new)
        return new


def _valid(t: object) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
