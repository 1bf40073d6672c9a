"""What a group core asks its IO side to do: the actions ``GroupCore``'s entry points return.

``GroupCore`` (group_core.py) takes a message or a timer tick and the time, changes its state
and returns a list of these actions, in the order they are due, like ``protocol.py`` returns
messages for bytes (and h11 events for HTTP). The IO side performs them: ``group.GroupServer``
over asyncio, the simulator (simulate.py) with simulated time, a test by hand. No IO here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Action", "AllLeft", "BudgetSpent", "Log", "Reply", "StartExchange", "Wake"]


@dataclass(frozen=True)
class Reply:
    """Send ``msg`` (an ACK) to worker ``worker``, the one whose message this answers."""

    worker: int
    msg: Any


@dataclass(frozen=True)
class Wake:
    """The group's lowest clock or its membership changed: a held PULL may be answerable now
    (``GroupCore.may_answer``)."""


@dataclass(frozen=True)
class StartExchange:
    """``sync_every`` pushes since the last exchange: start one with the global server unless
    one is in flight (``GroupCore.begin_exchange``)."""


@dataclass(frozen=True)
class AllLeft:
    """The group's last worker left: a final exchange is due (a ``final`` flush)."""


@dataclass(frozen=True)
class BudgetSpent:
    """The global server's answer says the run is over: answer every PULL with ``done`` and
    flush a last delta (``GroupServer.finish``)."""


@dataclass(frozen=True)
class Log:
    """One line of the group's record: ``event`` and its ``fields`` (the IO side adds the time
    and the group's counters)."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)


Action = Reply | Wake | StartExchange | AllLeft | BudgetSpent | Log
