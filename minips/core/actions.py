"""How a role core speaks to its shell: the actions its entry points return, and ``Log``, the
one action every core returns.

A role core (``group_core.GroupCore``, ``global_core.GlobalCore``) takes a message or a tick and
the time ``now``, changes its state and returns a list of actions in the order they are due, as
h11 returns events for bytes. The shell performs them: asyncio (``group.GroupServer``,
``server.GlobalServer``), the simulator (``simulate.py``) in simulated time, or a test by hand.
An action is a frozen dataclass, so a test compares the lists a core returns with ``==``.

Each core defines the actions only its shell performs beside its rules (a group's ``Reply``,
``Wake``, ...; the global server's ``FormGroups``, ``SendSettings``, ...). What every core asks
for is here: a line of the role's record, which the shell completes with the time and the
role's counters and writes to the run directory (``rundir.JsonlWriter``). No IO here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Log"]


@dataclass(frozen=True)
class Log:
    """One line of the role's record: ``event`` and its ``fields`` (the shell adds the time and
    the role's counters)."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)
