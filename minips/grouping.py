"""Grouping workers by speed: exact 1-D k-means on log step time, choice of k, regrouping.

Plain numpy, no I/O and no clock: the global server passes in the times it measured. The time
of a step here is the *iteration* a group waits on (``roster.WorkerEntry.iteration``: the interval
between a worker's PUSHes at its group server less the SSP hold, or before any, its calibrated
compute plus its link probe), not the compute time a worker reports: a worker with a fast CPU
behind a slow link is a slow worker (DESIGN.md, "Grouping"). The functions below call it the
step time; they work on any positive seconds.

- ``cluster_1d(values, k)``: the optimal split of the sorted log step times into ``k`` contiguous
  clusters (least within-cluster squared error, found exactly by dynamic programming). Equal
  values always land in the same cluster; group 0 is the fastest (smallest step time).
- ``choose_k(values, max_k)``: the smallest k whose clusters are all *tight* — in every cluster
  the slowest worker is at most ``max_ratio`` times slower than the fastest — so a group is
  split exactly at the gaps that are wider than that tolerance. Near-equal speeds give k = 1.
- ``assign_groups(step_times, k)``: ``{worker: group}`` from the two above.
- ``Regrouper``: re-runs the grouping as step times drift, with hysteresis (smoothing, a margin
  and a patience count) so that noise never makes a worker bounce between groups; a large,
  lasting change of one worker's speed (2x or more) is found by a change-point test (CUSUM on
  its log step time) and regroups at once, without the patience.
- ``nearest_group(step_time, group_times)``: where a late joiner goes without regrouping.

Logs are used because speed differences are ratios: 1 s vs 2 s is the same gap as 2 s vs 4 s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from minips.errors import ConfigError

__all__ = [
    "cluster_1d",
    "choose_k",
    "assign_groups",
    "group_times",
    "nearest_group",
    "Regrouper",
    "DEFAULT_MAX_RATIO",
]

# Workers whose step times differ by at most 25% share a group. The reproduce profile
# {1, 1, 1.5, 1.5, 2, 2, 4, 4} has its closest distinct speeds 2/1.5 = 1.33 apart: 4 groups.
DEFAULT_MAX_RATIO = 1.25


def _log_times(values: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)  # (n,) seconds per step
    if x.ndim != 1 or x.size == 0:
        raise ConfigError(f"need a non-empty 1-D list of step times, got shape {x.shape}")
    if not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ConfigError(f"step times must be finite and > 0, got {x.tolist()}")
    return np.log(x)


def _split_points(x: np.ndarray, w: np.ndarray, k: int) -> list[int]:
    """Start index of each of the k clusters of sorted ``x`` (weights ``w``), least squared error.

    ``x`` (m,) float64 sorted distinct; ``w`` (m,) counts. DP over prefix sums, O(k m^2).
    """
    m = x.size
    s0 = np.concatenate([[0.0], np.cumsum(w)])  # (m+1,) prefix weight
    s1 = np.concatenate([[0.0], np.cumsum(w * x)])
    s2 = np.concatenate([[0.0], np.cumsum(w * x * x)])

    def sse(i: np.ndarray, j: int) -> np.ndarray:  # error of clusters x[i:j] for each i
        n, t = s0[j] - s0[i], s1[j] - s1[i]
        return s2[j] - s2[i] - t * t / n

    cost = np.full((k + 1, m + 1), np.inf)  # cost[c, j]: best error of x[:j] in c clusters
    start = np.zeros((k + 1, m + 1), dtype=np.int64)  # where the last of those c clusters starts
    cost[0, 0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, m + 1):
            i = np.arange(c - 1, j)  # the last cluster is x[i:j], non-empty
            total = cost[c - 1, i] + sse(i, j)
            best = int(np.argmin(total))  # first minimum: deterministic tie-break
            cost[c, j], start[c, j] = total[best], i[best]
    starts, j = [], m
    for c in range(k, 0, -1):
        j = int(start[c, j])
        starts.append(j)
    return starts[::-1]


def cluster_1d(values: Sequence[float] | np.ndarray, k: int) -> np.ndarray:
    """Labels ``(n,) int64`` of the optimal k-means split of log(values); 0 = smallest values.

    Fewer than ``k`` labels are used when there are fewer distinct values than ``k``.
    """
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    x = _log_times(values)
    distinct, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    k = min(k, distinct.size)
    starts = _split_points(distinct, counts.astype(np.float64), k)
    label_of_distinct = np.searchsorted(np.asarray(starts), np.arange(distinct.size), "right") - 1
    return label_of_distinct[inverse.reshape(-1)].astype(np.int64)


def _max_spread(x: np.ndarray, labels: np.ndarray) -> float:
    """Widest cluster, as max - min of log values (log of the slowest/fastest ratio)."""
    return max(float(np.ptp(x[labels == g])) for g in np.unique(labels))


def choose_k(
    values: Sequence[float] | np.ndarray, max_k: int = 4, *, max_ratio: float = DEFAULT_MAX_RATIO
) -> int:
    """Smallest k <= max_k whose clusters all stay within ``max_ratio`` (slowest / fastest).

    When even ``max_k`` clusters are wider than that (speeds spread evenly, no clear gaps),
    ``max_k`` is returned: it keeps the spread inside each group as small as allowed.
    Feed averaged step times: with 10% noise on single measurements, eight equal workers
    look about 1.3x apart and would be split (with 5% noise, rarely).
    """
    if max_ratio < 1:
        raise ConfigError(f"max_ratio must be >= 1, got {max_ratio}")
    x = _log_times(values)
    top = min(max_k, np.unique(x).size)
    for k in range(1, top + 1):
        if _max_spread(x, cluster_1d(values, k)) <= math.log(max_ratio) + 1e-12:
            return k
    return max(top, 1)


def assign_groups(
    step_times: Mapping[int, float],
    k: int | None = None,
    max_k: int = 4,
    *,
    max_ratio: float = DEFAULT_MAX_RATIO,
) -> dict[int, int]:
    """``{worker: group}`` for the measured step times; ``k=None`` lets ``choose_k`` decide.

    A given ``k`` is honoured (up to one group per worker). When the speeds form fewer tight
    clusters than ``k`` (``choose_k``: equal workers, or six equal PCs and two equal boards
    with ``k`` = 4), the extra groups split the largest clusters by rank into near-equal
    groups (``_split_tight``), not at the noise between equal workers: k-means would cut the
    widest noise, leaving groups of 1 and 4 where 2 and 2 were asked, and with ``--merge
    mean`` a worker alone in its group weighs 4x one of four. (Measured on the link-only
    suite, seed 1, 3 runs each: no accuracy gained or lost within the runs' spread.)
    """
    workers = sorted(step_times)
    if not workers:
        return {}
    times = [step_times[w] for w in workers]
    if k is None:
        k = choose_k(times, max_k, max_ratio=max_ratio)
        labels = cluster_1d(times, k)
    else:
        tight = choose_k(times, k, max_ratio=max_ratio)  # at most k
        labels = (_split_tight(times, cluster_1d(times, tight), k) if tight < k
                  else cluster_1d(times, k))
    return {w: int(g) for w, g in zip(workers, labels, strict=True)}


def _split_tight(times: Sequence[float], clusters: np.ndarray, k: int) -> np.ndarray:
    """Labels ``(n,) int64`` of min(k, n) groups made from the tight ``clusters`` (0 = fastest):
    each cluster starts with one group; each extra group goes to the cluster with the most
    workers per group (ties: the faster); each cluster is then cut by rank into its groups of
    near-equal size (``_split_by_rank``). Group 0 is the fastest."""
    sizes = np.bincount(clusters)
    share = np.ones(sizes.size, dtype=np.int64)
    for _ in range(min(k, len(times)) - sizes.size):
        share[int(np.argmax(np.where(share < sizes, sizes / share, -1.0)))] += 1
    labels = np.empty(len(times), dtype=np.int64)
    first = 0
    for c in range(sizes.size):
        members = np.flatnonzero(clusters == c)
        labels[members] = first + _split_by_rank([times[i] for i in members], int(share[c]))
        first += int(share[c])
    return labels


def _split_by_rank(times: Sequence[float], k: int) -> np.ndarray:
    """Labels ``(n,) int64``: the workers in speed order (ties by position), cut into
    min(k, n) contiguous groups of near-equal size; 0 = fastest."""
    n = len(times)
    order = np.argsort(np.asarray(times, dtype=np.float64), kind="stable")
    labels = np.empty(n, dtype=np.int64)
    labels[order] = np.arange(n) * min(k, n) // n
    return labels


def group_times(step_times: Mapping[int, float], assignment: Mapping[int, int]) -> dict[int, float]:
    """Typical step time of each group: the geometric mean of its members' step times."""
    logs: dict[int, list[float]] = {}
    for w, g in assignment.items():
        if w in step_times:
            logs.setdefault(g, []).append(math.log(step_times[w]))
    return {g: math.exp(sum(v) / len(v)) for g, v in sorted(logs.items())}


def nearest_group(step_time: float, group_times: Mapping[int, float]) -> int:
    """The group whose typical step time is closest in log; ties go to the faster group."""
    if not group_times:
        raise ConfigError("no groups to choose from")
    x = math.log(step_time)
    # Distances are rounded so that a time exactly between two groups goes to the faster one.
    return min(group_times, key=lambda g: (round(abs(x - math.log(group_times[g])), 9),
                                           group_times[g], g))


def _partition(assignment: Mapping[int, int]) -> set[frozenset[int]]:
    members: dict[int, set[int]] = {}
    for w, g in assignment.items():
        members.setdefault(g, set()).add(w)
    return {frozenset(m) for m in members.values()}


@dataclass
class Regrouper:
    """Grouping that follows drifting speeds without flapping.

    Each ``update(step_times)`` folds the new times into a per-worker moving average (in log).
    The first call forms the groups. Later calls return a new ``{worker: group}`` only when the
    current groups have been *out of shape* for ``patience`` consecutive updates, where out of
    shape means, beyond ``margin`` (log units; 0.1 is about 10%):

    - misplaced: a worker is nearer another group's centre (median log time) than its own;
    - too wide (k chosen automatically, fewer than ``max_k`` groups): a group spans more than
      ``max_ratio``;
    - mergeable (k chosen automatically): two neighbouring groups together span less than it.

    Otherwise it returns None. Workers missing from ``step_times`` are dropped; new ones are
    placed with ``nearest_group`` (call ``place`` to learn their group at once).

    A large change skips the patience. Each worker runs a two-sided CUSUM on its log step time
    against its level when the sums last stood at 0: ``up = max(0, up + d - jump / 2)`` and
    ``down = max(0, down - d - jump / 2)``, ``d = log t - level`` (at most 2 x jump a look).
    When one passes ``alarm * jump`` the worker's level jumps to its latest time and the
    groups are formed anew at once if that leaves them out of shape (above) and moves anyone:
    a change that every worker makes alike (a machine whose load rose slows every iteration)
    leaves each worker nearest its own group and moves nobody. With ``jump`` = log 2 and ``alarm`` =
    2: a change of 3x or more fires on its 2nd look, a 2x one on its 5th, one spike never
    does; on a steady profile with log-normal noise of sigma 0.1 a look it never regrouped in
    50,000 looks, with sigma 0.2 twice (docs/operations.md, "Regrouping"; tests/test_grouping.py).
    """

    k: int | None = None  # fixed number of groups; None = choose_k
    max_k: int = 4  # most groups choose_k may form
    max_ratio: float = DEFAULT_MAX_RATIO  # slowest / fastest allowed inside a group
    margin: float = 0.1  # hysteresis, in log step time
    patience: int = 5  # consecutive out-of-shape updates before regrouping
    smoothing: float = 0.3  # weight of a new measurement in the moving average
    jump: float = math.log(2.0)  # a change of this size (log units) or more skips the patience
    alarm: float = 2.0  # the change-point test fires past alarm * jump of summed deviation
    assignment: dict[int, int] = field(default_factory=dict)
    _log: dict[int, float] = field(default_factory=dict, repr=False)  # smoothed log step time
    _streak: int = field(default=0, repr=False)
    _jumped: bool = field(default=False, repr=False)  # a change-point test fired this update
    # per worker: (level, up, down) of its change-point test (CUSUM), in log step time
    _cusum: dict[int, tuple[float, float, float]] = field(default_factory=dict, repr=False)

    def update(self, step_times: Mapping[int, float]) -> dict[int, int] | None:
        """Feed the latest step times; a new assignment when a regroup is due, else None."""
        self._forget(step_times)
        self._observe(step_times)
        if not self._log:
            return None
        if not self.assignment:
            self.assignment = assign_groups(self.smoothed(), self.k, self.max_k,
                                            max_ratio=self.max_ratio)
            return dict(self.assignment)
        for w in self._log.keys() - self.assignment.keys():
            self.assignment[w] = nearest_group(self.smoothed()[w], self.group_times())
        shape = self._out_of_shape()
        self._streak = self._streak + 1 if shape else 0
        if not shape or (self._streak < self.patience and not self._jumped):
            return None
        self._streak = 0
        candidate = assign_groups(self.smoothed(), self.k, self.max_k, max_ratio=self.max_ratio)
        if _partition(candidate) == _partition(self.assignment):
            return None
        self.assignment = candidate
        return dict(candidate)

    def place(self, w: int, step_time: float) -> int:
        """Put a late joiner into the nearest existing group (no regroup) and return it."""
        self._observe({w: step_time})
        self.assignment[w] = nearest_group(step_time, self.group_times()) if self.assignment else 0
        return self.assignment[w]

    def smoothed(self) -> dict[int, float]:
        """The moving-average step time of every known worker, in seconds."""
        return {w: math.exp(x) for w, x in self._log.items()}

    def group_times(self) -> dict[int, float]:
        """Typical (geometric mean) smoothed step time of each current group."""
        return group_times(self.smoothed(), self.assignment)

    def _forget(self, step_times: Mapping[int, float]) -> None:
        for w in list(self._log):
            if w not in step_times:
                del self._log[w]
                self.assignment.pop(w, None)
                self._cusum.pop(w, None)

    def _observe(self, step_times: Mapping[int, float]) -> None:
        """Fold the times into the moving averages; ``_jumped``: a worker's change-point test
        fired (its average then jumps to its latest time)."""
        self._jumped = False
        for w, t in step_times.items():
            x = math.log(t)
            old = self._log.get(w, x)
            self._log[w] = old + self.smoothing * (x - old)
            if self._changed(w, x, old):
                self._log[w], self._jumped = x, True

    def _changed(self, w: int, x: float, average: float) -> bool:
        """Worker ``w``'s CUSUM after log step time ``x`` (``average``: its moving average
        before ``x``): True when it passes the alarm (the test then starts over at ``x``)."""
        level, up, down = self._cusum.get(w, (average, 0.0, 0.0))
        if up == down == 0.0:
            level = average  # the level the sums measure from: frozen while they run
        # one look counts as at most a 2 x jump (4x) change, so it never fires alone
        d, slack = float(np.clip(x - level, -2 * self.jump, 2 * self.jump)), self.jump / 2
        up, down = max(0.0, up + d - slack), max(0.0, down - d - slack)
        fired = max(up, down) > self.alarm * self.jump
        self._cusum[w] = (x, 0.0, 0.0) if fired else (level, up, down)
        return fired

    def _out_of_shape(self) -> bool:
        members: dict[int, list[float]] = {}
        for w, g in self.assignment.items():
            members.setdefault(g, []).append(self._log[w])
        centre = {g: float(np.median(v)) for g, v in members.items()}
        for w, g in self.assignment.items():
            own = abs(self._log[w] - centre[g])
            if any(own - abs(self._log[w] - c) > self.margin for h, c in centre.items() if h != g):
                return True
        return self.k is None and self._wrong_count(members, centre)

    def _wrong_count(self, members: dict[int, list[float]], centre: dict[int, float]) -> bool:
        tol = math.log(self.max_ratio)
        order = sorted(centre, key=lambda g: centre[g])  # fastest group first
        spans = [(min(members[g]), max(members[g])) for g in order]  # log (fastest, slowest)
        if len(spans) < self.max_k and any(hi - lo > tol + self.margin for lo, hi in spans):
            return True
        pairs = zip(spans[:-1], spans[1:], strict=True)
        return any(slow[1] - fast[0] < tol - self.margin for fast, slow in pairs)
