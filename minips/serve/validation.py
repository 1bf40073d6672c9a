"""How a server ends a session that broke the rules: ``reject`` and ``replace`` (asyncio).

What the rules are is sans-IO and lives elsewhere: the wire schema and the conversation's order
and ranges in wire/ (``conversation.py``), clocks in the SSP table (``ssp.ClockError``), a
group's counters for the run in ``GlobalCore``. A violation raises ``RemoteProtocolError``;
``reject`` then answers ERROR with the reason (the error's ``code``, else ``clock`` for a clock
the table refused, else ``invalid``), logs (as counts) and counts it, and the caller closes that
one connection. ``replace`` ends a session that a new connection with the same worker id takes
over, with ERROR ``replaced``. The model is never touched by a rejected message: every check
runs before anything is applied.
"""

from __future__ import annotations

import collections
import logging

from minips.core import ssp
from minips.net.channel import Channel
from minips.net.transport import CountingLog

__all__ = ["REPLACED", "replace", "reject"]

log = logging.getLogger("minips.server")
_counted = CountingLog(log)  # one line per kind and period, with counts: a flood is a few lines

REPLACED = "replaced"  # ERROR code: another connection with the same worker id took over


async def replace(old: Channel, w: int, counts: collections.Counter[str], where: str) -> None:
    """A new connection with worker id ``w`` takes the session over: the old one is told why
    (ERROR ``replaced``) and closed. A worker that gets it stops rather than reconnecting, so two
    processes started with one id do not evict each other without end."""
    counts[REPLACED] += 1
    log.warning("%s: worker %d connected again; its connection from %s is replaced", where, w,
                old.peername)
    await old.send_error(REPLACED, f"another connection with worker id {w} took this session "
                         "over (is a second worker running with this id?)")
    await old.close()


async def reject(ch: Channel, exc: Exception, counts: collections.Counter[str], where: str) -> None:
    """Tell the peer why (ERROR), log and count it; the caller then closes the connection."""
    code = getattr(exc, "code", "") or ("clock" if isinstance(exc, ssp.ClockError) else "invalid")
    counts[code] += 1
    _counted.note(f"{where}: rejected", f"{ch.peername}: {exc} (expected "
                  f"{getattr(exc, 'expected', None)}, got {getattr(exc, 'got', None)!r})")
    await ch.send_error(code, str(exc))
