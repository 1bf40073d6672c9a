"""Sans-IO clock table of one group: the SSP staleness bound, leases, LEAVE, who waits for whom.

A group server keeps one ``ClockTable``. It holds no sockets and reads no clock: every call that
depends on time takes ``now`` (seconds, any monotonic origin), so tests and simulators drive it
with made-up times. The file holds, in order: ``ClockCounts``, the multiset of live clocks the
table keeps its ends in; ``ClockError``; ``ClockTable``; ``Rounds``, the BSP rounds a group
server applies once each; and ``Iterations``, each worker's iteration time as its group sees it.

Vocabulary. A worker's *clock* is the number of pushes it has made. A worker at clock ``c`` that
wants to start step ``c + 1`` (PULL) may do so only while ``c - min_clock() <= s``, where the
minimum is over the *live* workers of the table and ``s`` is the staleness bound (0 = BSP,
``None`` = ASP, no bound). Its PUSH then carries clock ``c + 1``.

Invariants the table keeps (tests/test_ssp.py checks them under random event orders):

- ``min_clock()`` never decreases: joins are clamped to at least the current minimum, and a
  worker that leaves or whose lease expires simply stops counting.
- Over the live workers, ``max clock - min clock <= s + 1``: a push is accepted only from a
  worker that ``may_start`` (and the minimum cannot fall between its PULL and its PUSH).
- A clock moves forward by exactly one per push; any other clock raises ``ClockError``, which
  the server turns into an ERROR to that worker.

A worker that left is remembered: when it rejoins it gets back its old clock, raised to the
group's current minimum, and must pull the weights at that clock before pushing.

``ClockCounts`` counts how many live workers sit at each clock, with the lowest and highest
clock kept up to date. The table asks for the minimum clock on every PUSH and PULL and for both
ends on every exchange with the global server; scanning its workers each time costs O(workers)
per message, which showed in profiles of a server with hundreds of workers per group. The
multiset answers both in O(1) and updates them in O(1) for the moves a table makes all the time:

- ``move(c, c + 1)`` (a push) adds the new clock before removing the old one, so when the old
  clock was the lowest and empties, the next lowest is right beside it;
- ``add`` (a join) only lowers ``low`` or raises ``high``;
- ``remove`` (a leave, an expiry) of an end that empties probes a few neighbouring clocks, then
  falls back to one pass over the distinct clocks (at most s + 2 of them under a staleness
  bound s).

Invariant: ``low == min(clocks)`` and ``high == max(clocks)`` of the multiset, both None when it
is empty (tests/test_clock_counts.py checks it against a brute-force multiset).

Iterations. What a group waits on is a worker's whole *iteration*, not the compute time it
reports: its PULL, the weights over its link, its compute, its PUSH over its link. The group
server sees it as the interval between two PUSHes of the worker, less the time the SSP bound held
the PULL between them (a fast worker waiting on a slow one must not look slow): ``Iterations``
measures it per worker, with the compute time its PUSHes reported beside it (why it is slow),
and hands the means since the last ``take`` to the group's exchange, whence the global server
groups by it (``roster.py``, ``grouping.py``). Invariant: a worker's interval runs from its last
PUSH in this group's current session with it; a (re)join starts a new one, so time away from the
group never counts as an iteration.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from minips.errors import RemoteProtocolError

__all__ = ["ClockCounts", "ClockError", "ClockTable", "Rounds", "Iterations", "IterationTimes"]


# -- the live clocks as a multiset, its ends kept in O(1) ------------------------------------------

NEIGHBOUR_PROBES = 8  # clocks tried next to an emptied end before one pass over all of them


class ClockCounts:
    """A multiset of int clocks with its minimum ``low`` and maximum ``high`` (None if empty)."""

    def __init__(self, clocks: list[int] | None = None) -> None:
        self._count: dict[int, int] = {}  # clock -> live workers at it (> 0)
        self.low: int | None = None
        self.high: int | None = None
        for c in clocks or ():
            self.add(c)

    def add(self, c: int) -> None:
        """One more worker at clock ``c``."""
        self._count[c] = self._count.get(c, 0) + 1
        if self.low is None or c < self.low:
            self.low = c
        if self.high is None or c > self.high:
            self.high = c

    def remove(self, c: int) -> None:
        """One worker less at clock ``c`` (``KeyError`` if none is there)."""
        left = self._count[c] - 1
        if left:
            self._count[c] = left
            return
        del self._count[c]
        if not self._count:
            self.low = self.high = None
            return
        if c == self.low:
            self.low = self._nearest(c, 1)
        if c == self.high:
            self.high = self._nearest(c, -1)

    def move(self, old: int, new: int) -> None:
        """A worker went from clock ``old`` to ``new`` (added first: see the module docstring)."""
        self.add(new)
        self.remove(old)

    def __len__(self) -> int:
        return sum(self._count.values())

    def _nearest(self, c: int, step: int) -> int:
        """The clock nearest to the emptied end ``c`` in direction ``step`` (+1 up, -1 down)."""
        for _ in range(NEIGHBOUR_PROBES):
            c += step
            if c in self._count:
                return c
        return min(self._count) if step > 0 else max(self._count)


# -- the clock table: staleness bound, leases, LEAVE; BSP rounds -----------------------------------

W = Hashable  # a worker id; the servers use ints
T = TypeVar("T")


class ClockError(RemoteProtocolError):
    """A worker sent a clock the table cannot accept (wrong value, unknown or expired worker).

    ``worker`` is the offender; ``expected``/``got`` describe the clock (see ``ProtocolError``).
    """

    def __init__(self, msg: str, *, worker: W, expected: object = None, got: object = None):
        super().__init__(msg, expected=expected, got=got)
        self.worker = worker


@dataclass
class _Entry:
    clock: int  # pushes made so far
    last_seen: float  # `now` of the last join / heartbeat / push (lease start)


@dataclass
class ClockTable:
    """Clocks and leases of the workers of one group (see the module docstring).

    ``staleness``: the bound ``s`` in steps; 0 = BSP, ``None`` = ASP (no bound).
    ``lease_s``: a worker with no heartbeat or push for longer than this is expired by
    ``expire(now)``; ``math.inf`` disables leases.
    """

    staleness: int | None
    lease_s: float
    _live: dict[W, _Entry] = field(default_factory=dict, init=False, repr=False)
    _gone: dict[W, int] = field(default_factory=dict, init=False, repr=False)  # last clocks
    _floor: int = field(default=0, init=False, repr=False)  # highest minimum seen so far
    # the live clocks as a multiset: min_clock / max_clock in O(1) (ClockCounts above)
    _counts: ClockCounts = field(default_factory=ClockCounts, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.staleness is not None and self.staleness < 0:
            raise ValueError(f"staleness must be >= 0 or None, got {self.staleness}")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")

    # -- membership ---------------------------------------------------------------------------

    def join(self, w: W, now: float, clock: int | None = None) -> int:
        """Add (or re-add) worker ``w`` and return the clock it starts from.

        The clock is ``clock`` if given, else the one ``w`` had when it left, else the current
        minimum; it is then clamped to ``[min, min + s + 1]`` so a joiner neither drags the
        group back nor breaks the bound. Joining while already live just renews the lease.
        """
        if w in self._live:
            self._live[w].last_seen = now
            return self._live[w].clock
        lo = self._lowest()
        wanted = clock if clock is not None else self._gone.pop(w, lo)
        hi = math.inf if self.staleness is None else lo + self.staleness + 1
        start = int(min(max(wanted, lo), hi))
        self._live[w] = _Entry(start, now)
        self._counts.add(start)
        return start

    def restore(self, clocks: dict[W, int], now: float) -> None:
        """Make exactly ``clocks`` the live workers (a checkpoint's table), leases from ``now``.

        The saved clocks kept the invariants when they were saved, so they must still: clocks
        are ints >= 0 and ``max - min <= s + 1``; otherwise ``ValueError`` (nothing changes).
        The minimum becomes the floor, so a later join cannot start below it.
        """
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in clocks.values()):
            raise ValueError(f"clocks must be ints >= 0, got {clocks!r}")
        if clocks and self.staleness is not None:
            spread = max(clocks.values()) - min(clocks.values())
            if spread > self.staleness + 1:
                raise ValueError(f"clocks {clocks!r} spread {spread} steps, beyond the bound "
                                 f"s + 1 = {self.staleness + 1}")
        self._live = {w: _Entry(c, now) for w, c in clocks.items()}
        self._counts = ClockCounts(list(clocks.values()))
        self._gone = {w: c for w, c in self._gone.items() if w not in clocks}
        self._floor = max(self._floor, min(clocks.values(), default=0))

    def leave(self, w: W) -> None:
        """Remove ``w`` (LEAVE or closed connection); its clock is kept for a later rejoin."""
        entry = self._live.pop(w, None)
        if entry is not None:
            self._gone[w] = entry.clock
            self._counts.remove(entry.clock)
            self._raise_floor()

    def heartbeat(self, w: W, now: float) -> bool:
        """Renew ``w``'s lease. False when ``w`` is not live (expired or never joined)."""
        entry = self._live.get(w)
        if entry is None:
            return False
        entry.last_seen = max(entry.last_seen, now)
        return True

    def expire(self, now: float) -> list[W]:
        """Remove and return the workers silent for more than ``lease_s`` before ``now``."""
        dead = [w for w, e in self._live.items() if now - e.last_seen > self.lease_s]
        for w in dead:
            self.leave(w)
        return dead

    # -- clocks -------------------------------------------------------------------------------

    def push(self, w: W, clock: int, now: float) -> int:
        """Record ``w``'s push of step ``clock`` (its clock before the push + 1); return it.

        Raises ``ClockError`` when ``w`` is not live, when ``clock`` is not exactly one ahead,
        or when ``w`` was not allowed to start that step (it did not wait for its PULL).
        """
        entry = self._live.get(w)
        if entry is None:
            raise ClockError(
                f"worker {w!r} pushed clock {clock} but is not live (left or lease expired)",
                worker=w, expected="a live worker (join first)", got=clock,
            )
        if clock != entry.clock + 1:
            raise ClockError(
                f"worker {w!r} pushed clock {clock}, expected {entry.clock + 1}",
                worker=w, expected=entry.clock + 1, got=clock,
            )
        if not self.may_start(w):
            raise ClockError(
                f"worker {w!r} pushed clock {clock} beyond the staleness bound "
                f"{self.staleness} (slowest live clock {self.min_clock()})",
                worker=w, expected=f"clock <= {self._lowest() + (self.staleness or 0) + 1}",
                got=clock,
            )
        self._counts.move(entry.clock, clock)
        entry.clock = clock
        entry.last_seen = max(entry.last_seen, now)
        self._raise_floor()
        return clock

    def may_start(self, w: W) -> bool:
        """True when ``w`` (at clock c) may start step c + 1: ``c - min_clock() <= s``."""
        clock = self._entry(w).clock
        return self.staleness is None or clock - self._lowest() <= self.staleness

    def waiting_for(self, w: W) -> list[W]:
        """The live workers holding the minimum clock that ``w`` waits for ([] if it may start)."""
        if self.may_start(w):
            return []
        low = self._lowest()
        return [v for v, e in self._live.items() if e.clock == low]

    def lead(self, w: W) -> int:
        """How many steps ``w`` is ahead of the slowest live worker (its staleness, >= 0)."""
        return self._entry(w).clock - self._lowest()

    def min_clock(self) -> int | None:
        """Smallest clock among live workers, or None when no worker is live."""
        return self._counts.low

    def max_clock(self) -> int | None:
        """Largest clock among live workers, or None when no worker is live."""
        return self._counts.high

    @property
    def clocks(self) -> dict[W, int]:
        """A copy of ``{worker: clock}`` for the live workers."""
        return {w: e.clock for w, e in self._live.items()}

    @property
    def live(self) -> list[W]:
        """The live workers, in join order."""
        return list(self._live)

    def __contains__(self, w: object) -> bool:
        return w in self._live

    def __len__(self) -> int:
        return len(self._live)

    # -- helpers ------------------------------------------------------------------------------

    def _entry(self, w: W) -> _Entry:
        entry = self._live.get(w)
        if entry is None:
            raise ClockError(f"worker {w!r} is not live", worker=w, expected="a live worker")
        return entry

    def _lowest(self) -> int:
        # With nobody live the last minimum stands in, so a lone rejoiner cannot go backwards.
        low = self.min_clock()
        return self._floor if low is None else low

    def _raise_floor(self) -> None:
        low = self.min_clock()
        if low is not None and low > self._floor:
            self._floor = low


class Rounds(Generic[T]):
    """BSP rounds: collect the pushes of each clock, release a clock once all live pushed it.

    The group server ``add``s every accepted push (``item`` is whatever it needs, e.g. the decoded
    gradient) and after each push, LEAVE or expiry calls ``pop_complete(table.min_clock())``:
    a clock ``c`` is complete when every live worker's clock is ``>= c``. Each complete round is
    returned once, in clock order, so it can be averaged and applied exactly once. A worker that
    leaves mid-round does not block it; what it already pushed still counts.
    """

    def __init__(self) -> None:
        self._pending: dict[int, list[T]] = {}
        self.applied = 0  # highest clock already returned by pop_complete

    def add(self, clock: int, item: T) -> None:
        """Queue ``item`` for round ``clock``; a clock already released is refused."""
        if clock <= self.applied:
            raise ValueError(f"round {clock} was already applied (applied up to {self.applied})")
        self._pending.setdefault(clock, []).append(item)

    def pop_complete(self, complete_through: int | None) -> list[tuple[int, list[T]]]:
        """Return ``[(clock, items)]`` for every pending clock ``<= complete_through``."""
        if complete_through is None:
            return []  # nobody live: keep the pushes until someone joins and completes the round
        done = sorted(c for c in self._pending if c <= complete_through)
        self.applied = max(self.applied, complete_through)
        return [(c, self._pending.pop(c)) for c in done]

    def pending(self, clock: int) -> int:
        """How many pushes are queued for ``clock``."""
        return len(self._pending.get(clock, ()))


# -- iteration times: the interval between a worker's pushes, less the SSP hold --------------------

class IterationTimes(NamedTuple):
    """One worker's means over the PUSHes since the last ``Iterations.take`` (seconds)."""

    iteration_s: float  # interval between its PUSHes less the SSP hold of the PULL between
    compute_s: float  # the step time its PUSHes reported (compute to an encoded push)


class Iterations:
    """Each worker's iteration time as its group server sees it (see the module docstring).

    ``start(w)`` when ``w`` (re)joins; ``held(w, s)`` when the SSP bound held its PULL ``s``
    seconds; ``push(w, now, compute_s)`` at each of its PUSHes; ``take()`` the per-worker means
    since the last ``take`` (and resets them). A worker's first PUSH after ``start`` opens its
    interval and counts none: join to first PUSH includes the join's own PULL of the weights
    whole, once, which is no iteration of its pace.
    """

    def __init__(self) -> None:
        self._last: dict[int, float] = {}  # worker -> `now` of its last PUSH
        self._held: dict[int, float] = {}  # worker -> SSP hold since its last PUSH (s)
        # worker -> (iteration seconds, compute seconds, intervals) since the last take
        self._sums: dict[int, tuple[float, float, int]] = {}

    def start(self, w: int) -> None:
        """``w`` (re)joined: its next PUSH opens a new interval."""
        self._last.pop(w, None)
        self._held.pop(w, None)

    def held(self, w: int, seconds: float) -> None:
        """The SSP bound held ``w``'s PULL ``seconds`` before it was answered."""
        if seconds > 0:
            self._held[w] = self._held.get(w, 0.0) + seconds

    def push(self, w: int, now: float, compute_s: float = 0.0) -> float | None:
        """A PUSH of ``w`` at ``now`` whose step took ``compute_s``: the iteration it closes
        (seconds, None for the first), never below ``compute_s`` nor 0 (holds are measured by
        the same clock, so only rounding can take the difference under)."""
        prev, hold = self._last.get(w), self._held.pop(w, 0.0)
        self._last[w] = now
        if prev is None or not now > prev:
            return None
        it = max(now - prev - hold, compute_s, 0.0)
        s, c, n = self._sums.get(w, (0.0, 0.0, 0))
        self._sums[w] = (s + it, c + max(compute_s, 0.0), n + 1)
        return it

    def take(self) -> dict[int, IterationTimes]:
        """``{worker: its mean iteration and compute time}`` over the intervals since the last
        call (workers with none are left out); resets."""
        out = {w: IterationTimes(s / n, c / n) for w, (s, c, n) in sorted(self._sums.items())}
        self._sums = {}
        return out
