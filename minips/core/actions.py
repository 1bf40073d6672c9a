"""How a role core speaks to its shell: ``Log``, the one action every core returns, and the
actions the global core's entry points return.

A role core (``group_core.GroupCore``, ``global_core.GlobalCore``) takes a message or a tick and
the time ``now``, changes its state and returns a list of actions in the order they are due, as
h11 returns events for bytes. The shell performs them: asyncio (``group.GroupServer``,
``server.GlobalServer``), the simulator (``simulate.py``) in simulated time, or a test by hand.
An action is a frozen dataclass, so a test compares the lists a core returns with ``==``.

``Log`` is a line of the role's record, which the shell completes with the time and the role's
counters and writes to the run directory (``rundir.JsonlWriter``). The group core defines its
own actions beside its rules (``Reply``, ``Wake``, ...); the global core's are here, so that
``merge.Merger`` and ``GlobalCore`` answer in the same words. What goes back to the group that
asked is an action too (``GroupReply``; ``reply(actions, kind)`` picks it out). No IO here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from minips.core.exchange import ExchangeResult
from minips.wire import messages

__all__ = [
    "Log",
    "Admitted",
    "AllFinal",
    "Fail",
    "FormGroups",
    "GlobalAction",
    "GroupReply",
    "PlaceLate",
    "Placed",
    "Regroup",
    "Rehomed",
    "RunDone",
    "SendSettings",
    "WeightsReady",
    "reply",
]


@dataclass(frozen=True)
class Log:
    """One line of the role's record: ``event`` and its ``fields`` (the shell adds the time and
    the role's counters)."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)


# -- what the global core asks its shell to do (``global_core.GlobalCore``) --------------------

@dataclass(frozen=True)
class FormGroups:
    """Open the first groups and assign every worker."""


@dataclass(frozen=True)
class PlaceLate:
    """Put ``worker`` (reported after the grouping) in the group nearest its speed."""

    worker: int


@dataclass(frozen=True)
class Placed:
    """Worker ``worker`` (reported after the grouping) is in group ``group`` now: tell it and
    the group's server."""

    worker: int
    group: int


@dataclass(frozen=True)
class Admitted:
    """A HELLO is admitted as worker ``worker`` (its WELCOME says so)."""

    worker: int


@dataclass(frozen=True)
class GroupReply:
    """Send ``answer`` back to group ``group``, whose exchange or PULL it answers: the
    EXCHANGE_REPLY or GLOBAL_WEIGHTS of a group process, an ``ExchangeResult`` in-process."""

    group: int
    answer: ExchangeResult | messages.ExchangeReply | messages.GlobalWeights


@dataclass(frozen=True)
class Regroup:
    """Move workers: ``{worker: new group}`` (group ids matched to the old ones)."""

    assignment: dict[int, int]


@dataclass(frozen=True)
class SendSettings:
    """New send settings of the groups ``ratios`` names (``{group: ratio}``, with the H in the
    groups' handles), to deliver to the groups and their workers (ASSIGN)."""

    ratios: dict[int, float]


@dataclass(frozen=True)
class WeightsReady:
    """The global weights exist now (a worker pushed the initial weights)."""


@dataclass(frozen=True)
class RunDone:
    """The budget is spent (``reason``: epochs, wall time, workers left, ...)."""

    reason: str


@dataclass(frozen=True)
class AllFinal:
    """Every group flushed its final delta."""


@dataclass(frozen=True)
class Fail:
    """The run fails now: ``code`` (one word, the ERROR sent to the workers) and why."""

    code: str
    reason: str


@dataclass(frozen=True)
class Rehomed:
    """Lost group ``group``'s workers moved: ``{worker: new group}``; tell them and their new
    groups' servers."""

    group: int
    moved: dict[int, int]


GlobalAction = (FormGroups | PlaceLate | Placed | Admitted | GroupReply | Regroup | SendSettings
                | WeightsReady | RunDone | AllFinal | Fail | Rehomed | Log)

T = TypeVar("T", ExchangeResult, messages.ExchangeReply, messages.GlobalWeights)


def reply(actions: list[GlobalAction], kind: type[T]) -> T:
    """The answer of kind ``kind`` that ``actions`` send back to the group that asked."""
    for a in actions:
        if isinstance(a, GroupReply) and isinstance(a.answer, kind):
            return a.answer
    raise LookupError(f"no {kind.__name__} among the actions")
