"""What a server allows a source address before it has authenticated, sans-IO: how many
handshakes it may have open at once, how long it must wait after failed ones, and log lines that
count events instead of printing one line each. No sockets, tasks or clocks: callers pass ``now``.

Invariants:
- At most ``max_pending`` connections are in the handshake at once, at most
  ``max_pending_per_source`` of them from one address; ``admit`` says no to the rest.
- After ``free_failures`` failed handshakes in a row, a source is refused for a back-off that
  doubles with every further failure (``backoff_first_s`` up to ``backoff_max_s``), so a guesser
  gets a bounded number of attempts per second. A successful handshake clears the record; so
  does ``forget_after_s`` without failures. At most ``MAX_SOURCES`` records are kept.
- ``LogSummary`` lets the first event of each kind through at once and then one line per
  ``period_s`` with the count of what happened meanwhile: a flood costs a few lines, not one each.

Public API: ``Limits``, ``Guard`` (``admit``, ``backoff_left``, ``failures``, ``opened``,
``closed``, ``failed``, ``succeeded``, ``pending``), ``LogSummary`` (``event``, ``due``, ``flush``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["Limits", "Guard", "LogSummary", "MAX_SOURCES"]

MAX_SOURCES = 4096  # failure records kept; the oldest goes first (bounds the guard's memory)


@dataclass(frozen=True)
class Limits:
    """What one server allows before authentication."""

    max_pending: int = 1024  # connections in the handshake at once, all sources together
    max_pending_per_source: int = 64  # ... from one address (a lab's workers behind one NAT fit)
    free_failures: int = 3  # failed handshakes in a row a source may have before it waits
    backoff_first_s: float = 0.5  # the first wait; each further failure doubles it ...
    backoff_max_s: float = 30.0  # ... up to this
    forget_after_s: float = 600.0  # a source with no failure for this long starts afresh


@dataclass
class _Record:
    failures: int = 0  # failed handshakes in a row
    until: float = 0.0  # refused before this time
    last: float = 0.0  # time of the last failure


class Guard:
    """Counts pending handshakes and failures per source address."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.pending: collections.Counter[str] = collections.Counter()  # source -> open now
        self.total_pending = 0
        self._records: dict[str, _Record] = {}  # insertion order: oldest first

    def admit(self, source: str, now: float) -> str:
        """"" when a new connection from ``source`` may start its handshake, else why not:
        "backoff", "per_source" or "total"."""
        if self.backoff_left(source, now) > 0:
            return "backoff"
        if self.pending[source] >= self.limits.max_pending_per_source:
            return "per_source"
        if self.total_pending >= self.limits.max_pending:
            return "total"
        return ""

    def backoff_left(self, source: str, now: float) -> float:
        """Seconds ``source`` must still wait before its next handshake (0: none)."""
        rec = self._records.get(source)
        return 0.0 if rec is None else max(0.0, rec.until - now)

    def failures(self, source: str) -> int:
        """Failed handshakes in a row from ``source``."""
        rec = self._records.get(source)
        return 0 if rec is None else rec.failures

    def opened(self, source: str) -> None:
        """A connection ``admit`` let in started its handshake."""
        self.pending[source] += 1
        self.total_pending += 1

    def closed(self, source: str) -> None:
        """That handshake ended (passed, failed or cut off)."""
        self.total_pending -= 1
        self.pending[source] -= 1
        if self.pending[source] <= 0:
            del self.pending[source]

    def failed(self, source: str, now: float) -> float:
        """A handshake from ``source`` failed (wrong secret); return its back-off (0: none)."""
        rec = self._records.pop(source, None)  # re-inserted: the dict stays oldest-first
        if rec is None or now - rec.last > self.limits.forget_after_s:
            rec = _Record()
        rec.failures += 1
        rec.last = now
        over = rec.failures - self.limits.free_failures
        wait = 0.0 if over <= 0 else min(self.limits.backoff_max_s,
                                         self.limits.backoff_first_s * 2 ** min(over - 1, 30))
        rec.until = now + wait
        self._records[source] = rec
        while len(self._records) > MAX_SOURCES:
            del self._records[next(iter(self._records))]
        return wait

    def succeeded(self, source: str) -> None:
        """``source`` proved the secret: its failures are forgiven."""
        self._records.pop(source, None)


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
