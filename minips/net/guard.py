"""What a server allows a source address before it has authenticated, sans-IO: how many
handshakes it may have open at once, which connections wait their turn for one, how long it
must wait after failed ones or after sessions it lost to protocol violations, and log lines that
count events instead of printing one line each. No sockets, tasks or clocks: callers pass
``now``.

Invariants:
- The limits count *unauthenticated* peers only: a connection holds one of its source's
  handshake slots from its first byte until its MAC was checked (``closed``), not a moment longer;
  an authenticated session never counts against its address (a lab behind one NAT address, or a
  bench's workers on 127.0.0.1, is as many peers as it has secrets proven).
- At most ``max_pending`` connections are in the handshake at once, at most
  ``max_pending_per_source`` of them from one address. A connection over the per-source cap
  *waits its turn* (``admit`` says "wait"; ``queue``), unread, in a first-in first-out line of at
  most ``max_waiting_per_source`` per address and ``max_waiting`` in all, for at most
  ``max_wait_s`` (the shell keeps the time and calls ``gave_up``): each handshake of that
  address that ends hands its slot to the oldest waiting connection (``closed`` returns it).
  So a burst of good peers from one address is admitted one slot after another, none turned
  away; a flood from one address is bounded by those lines and cut beyond them, and costs the
  other addresses nothing but the total caps.
- ``admit`` says no ("backoff", "per_source": its line is full, "total") to the rest.
- After ``free_failures`` failed handshakes in a row, a source is refused for a back-off that
  doubles with every further failure (``backoff_first_s`` up to ``backoff_max_s``), so a guesser
  gets a bounded number of attempts per second. A successful handshake clears the record; so
  does ``forget_after_s`` without failures. At most ``MAX_SOURCES`` records are kept.
- Sessions cut for a protocol violation (an ERROR of ``VIOLATIONS``: a peer that authenticated
  and then broke the protocol, e.g. a flood of messages it may not send) are counted the same
  way in a record of their own: after ``free_violations`` of them in a row the source waits
  before its next handshake, with the same doubling back-off. A session that ends without a
  violation clears that record (a handshake does not: a flooder passes every one).
- ``LogSummary`` lets the first event of each kind through at once and then one line per
  ``period_s`` with the count of what happened meanwhile: a flood costs a few lines, not one each.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["GuardLimits", "Guard", "LogSummary", "MAX_SOURCES", "VIOLATIONS"]

MAX_SOURCES = 4096  # failure records kept; the oldest goes first (bounds the guard's memory)
# ERROR codes that end a session for a protocol violation (protocol.md, section 6): the frame
# layer's and the servers' ("lease", "replaced", "refused" are not the peer breaking anything)
VIOLATIONS = frozenset({"protocol_error", "limit_exceeded", "read_timeout", "invalid", "clock",
                        "order"})


@dataclass(frozen=True)
class GuardLimits:
    """What one server allows before authentication."""

    max_pending: int = 1024  # connections in the handshake at once, all sources together
    max_pending_per_source: int = 64  # ... from one address; more from it wait their turn:
    max_waiting_per_source: int = 1024  # connections of one address waiting for a slot (a lab's
    # or a bench's workers behind one address connecting together are all admitted in turn)
    max_waiting: int = 4096  # ... all addresses together (a waiting socket costs ~12 KB)
    # s a connection waits in line; then it is closed unread: its address's slots are held by
    # peers that do not finish their handshakes (a good burst's slots turn over in ms)
    max_wait_s: float = 3.0
    free_failures: int = 3  # failed handshakes in a row a source may have before it waits
    backoff_first_s: float = 0.5  # the first wait; each further failure doubles it ...
    backoff_max_s: float = 30.0  # ... up to this
    forget_after_s: float = 600.0  # a source with no failure for this long starts afresh
    # sessions cut for a protocol violation in a row a source may have before it waits (the
    # same back-off); a reconnect loop of a buggy or hostile client is slowed to a trickle
    free_violations: int = 8


@dataclass
class _Record:
    failures: int = 0  # failed handshakes in a row
    until: float = 0.0  # refused before this time
    last: float = 0.0  # time of the last failure


class Guard:
    """Counts pending and waiting handshakes and failures per source address."""

    def __init__(self, limits: GuardLimits | None = None) -> None:
        self.limits = limits or GuardLimits()
        self.pending: collections.Counter[str] = collections.Counter()  # source -> open now
        self.total_pending = 0
        # source -> connections waiting for one of its slots, oldest first (the shell's tickets)
        self.waiting: dict[str, collections.deque[object]] = {}
        self.total_waiting = 0
        self._records: dict[str, _Record] = {}  # insertion order: oldest first
        self._violations: dict[str, _Record] = {}  # sessions cut for violations, the same way

    def admit(self, source: str, now: float) -> str:
        """"" when a new connection from ``source`` may start its handshake, "wait" when it may
        wait for one of its source's slots (``queue`` it), else why not: "backoff",
        "per_source" (its slots and its line are full) or "total"."""
        if self.backoff_left(source, now) > 0:
            return "backoff"
        if self.pending[source] >= self.limits.max_pending_per_source:
            line = self.waiting.get(source, ())
            if (len(line) < self.limits.max_waiting_per_source
                    and self.total_waiting < self.limits.max_waiting):
                return "wait"
            return "per_source"
        if self.total_pending >= self.limits.max_pending:
            return "total"
        return ""

    def backoff_left(self, source: str, now: float) -> float:
        """Seconds ``source`` must still wait before its next handshake (0: none), after
        failed handshakes or sessions cut for violations, whichever is longer."""
        until = max((rec.until for rec in (self._records.get(source),
                                           self._violations.get(source)) if rec is not None),
                    default=0.0)
        return max(0.0, until - now)

    def failures(self, source: str) -> int:
        """Failed handshakes in a row from ``source``."""
        rec = self._records.get(source)
        return 0 if rec is None else rec.failures

    def opened(self, source: str) -> None:
        """A connection ``admit`` let in started its handshake."""
        self.pending[source] += 1
        self.total_pending += 1

    def queue(self, source: str, ticket: object) -> None:
        """A connection ``admit`` told to wait joins the end of its source's line."""
        self.waiting.setdefault(source, collections.deque()).append(ticket)
        self.total_waiting += 1

    def gave_up(self, source: str, ticket: object) -> None:
        """A waiting connection left its line before its turn (timed out, or the server stops)."""
        line = self.waiting.get(source)
        if line is not None and ticket in line:
            line.remove(ticket)
            self.total_waiting -= 1
            if not line:
                del self.waiting[source]

    def closed(self, source: str) -> object | None:
        """That handshake ended (its MAC checked, or it failed or was cut off before). Returns
        the ticket of the connection of ``source`` that takes its slot now (counted as opened),
        or None when none waits."""
        line = self.waiting.get(source)
        if line:  # the slot passes on: pending counts stay as they are
            ticket = line.popleft()
            self.total_waiting -= 1
            if not line:
                del self.waiting[source]
            return ticket
        self.total_pending -= 1
        self.pending[source] -= 1
        if self.pending[source] <= 0:
            del self.pending[source]
        return None

    def failed(self, source: str, now: float) -> float:
        """A handshake from ``source`` failed (wrong secret); return its back-off (0: none)."""
        return self._count(self._records, source, now, self.limits.free_failures)

    def succeeded(self, source: str) -> None:
        """``source`` proved the secret: its failures are forgiven."""
        self._records.pop(source, None)

    def violated(self, source: str, now: float) -> float:
        """A session from ``source`` was cut for a protocol violation; return the back-off its
        next handshake waits (0: none yet)."""
        return self._count(self._violations, source, now, self.limits.free_violations)

    def violations(self, source: str) -> int:
        """Sessions from ``source`` cut for violations in a row."""
        rec = self._violations.get(source)
        return 0 if rec is None else rec.failures

    def behaved(self, source: str) -> None:
        """A session from ``source`` ended without a violation: its violations are forgiven."""
        self._violations.pop(source, None)

    def _count(self, records: dict[str, _Record], source: str, now: float, free: int) -> float:
        """One more failure of ``source`` in ``records``; its back-off after ``free`` of them."""
        rec = records.pop(source, None)  # re-inserted: the dict stays oldest-first
        if rec is None or now - rec.last > self.limits.forget_after_s:
            rec = _Record()
        rec.failures += 1
        rec.last = now
        over = rec.failures - free
        wait = 0.0 if over <= 0 else min(self.limits.backoff_max_s,
                                         self.limits.backoff_first_s * 2 ** min(over - 1, 30))
        rec.until = now + wait
        records[source] = rec
        while len(records) > MAX_SOURCES:
            del records[next(iter(records))]
        return wait


@dataclass
class LogSummary:
    """Counts events by kind; ``event`` says when a line is due (first one, then once a period)."""

    period_s: float = 5.0  # at most one line per kind per this many seconds
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    _last: dict[str, float] = field(default_factory=dict)  # kind -> when its last line went out
    _example: dict[str, str] = field(default_factory=dict)  # kind -> the latest detail

    def event(self, kind: str, detail: str, now: float) -> str | None:
        """Count one event; return the line to log now, or None (it is counted for later)."""
        self.counts[kind] += 1
        self._example[kind] = detail
        last = self._last.get(kind)
        if last is None or now - last >= self.period_s:
            return self._line(kind, now)
        return None

    def due(self, now: float) -> list[str]:
        """Lines for kinds with uncounted events whose period has passed (call it now and then)."""
        return [self._line(k, now) for k, n in list(self.counts.items())
                if n and now - self._last.get(k, 0.0) >= self.period_s]

    def flush(self, now: float) -> list[str]:
        """Lines for every kind with events not yet reported (at shutdown)."""
        return [self._line(k, now) for k, n in list(self.counts.items()) if n]

    def _line(self, kind: str, now: float) -> str:
        n, last = self.counts.pop(kind), self._last.get(kind)
        self._last[kind] = now
        if n == 1 and last is None:
            return f"{kind}: {self._example[kind]}"
        since = "" if last is None else f" in the last {now - last:.0f} s"
        return f"{kind}: {n} times{since}, latest: {self._example[kind]}"
