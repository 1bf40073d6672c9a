"""Log lines that count instead of repeating: the first event of a kind is logged at once, the
rest as "N times in the last S s" at most once a period (``guard.LogSummary`` decides; this
module owns the logger and the asyncio timer that flushes counts nobody followed up).

Invariant: a flood of refused or rejected peers costs a few log lines per period, not one line
per peer, and no count is lost: pending counts are logged within 1.5 periods, or at ``flush``.

Public API: ``CountingLog(logger)`` with ``note(kind, detail)`` and ``flush()``.
"""

from __future__ import annotations

import asyncio
import logging

from minips.net.guard import LogSummary

__all__ = ["CountingLog"]


class CountingLog:
    """``note`` events of a kind; lines go to ``logger`` at WARNING level."""

    def __init__(self, logger: logging.Logger, period_s: float | None = None) -> None:
        self.logger = logger
        self.summary = LogSummary() if period_s is None else LogSummary(period_s)
        self._timer: asyncio.TimerHandle | None = None

    def note(self, kind: str, detail: str) -> None:
        """Count one event; log it now if it is the first of its kind in a period."""
        loop = asyncio.get_running_loop()
        line = self.summary.event(kind, detail, loop.time())
        if line is not None:
            self.logger.warning("%s", line)
        elif self._timer is None:
            self._timer = loop.call_later(self.summary.period_s, self._due)

    def _due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        for line in self.summary.due(loop.time()):
            self.logger.warning("%s", line)
        if self.summary.counts:  # a kind whose period has not passed yet
            self._timer = loop.call_later(self.summary.period_s / 2, self._due)

    def flush(self) -> None:
        """Log every count still pending (at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for line in self.summary.flush(asyncio.get_running_loop().time()):
            self.logger.warning("%s", line)
