"""What the global server's rules (``global_core.py``) ask their shell to do (sans-IO).

``GlobalCore``'s entry points take a message (or a tick) and ``now`` and return a list of these
actions; the asyncio shell (``server.py``) performs them over real connections, the simulator
(``simulate.py``) over simulated ones. Each is a frozen dataclass, so a test compares them.

- ``FormGroups``: every expected worker reported (or the calibration time passed): open the
  groups of ``Roster.first_assignment`` and send each worker its ASSIGN.
- ``PlaceLate(worker)``: a worker reported after the grouping: once the groups are open, put it
  in the group nearest its speed.
- ``Regroup(assignment)``: the speeds drifted (``grouping.Regrouper``): move these workers.
- ``SendRatios(ratios)``: GDTopK chose new ratios ``{group: ratio}`` (already in the groups):
  tell the group servers that do not read them in-process and every worker of those groups.
- ``WeightsReady``: the first initial weights arrived; the grouping may go on.
- ``Done(reason)``: the budget is spent: tell the groups and the workers, wait for the final
  deltas (bounded).
- ``AllFinal``: every group flushed its final delta: end the run, or wait for the workers to
  rejoin when budget is left (``run_end.py``).
- ``Fail(code, reason)``: the run fails now (``diverged``: a group sent NaN or inf).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "AllFinal", "Done", "Fail", "FormGroups", "PlaceLate", "Regroup",
           "SendRatios", "WeightsReady"]


@dataclass(frozen=True)
class FormGroups:
    """Open the first groups and assign every worker."""


@dataclass(frozen=True)
class PlaceLate:
    """Put ``worker`` (reported after the grouping) in the group nearest its speed."""

    worker: int


@dataclass(frozen=True)
class Regroup:
    """Move workers: ``{worker: new group}`` (group ids matched to the old ones)."""

    assignment: dict[int, int]


@dataclass(frozen=True)
class SendRatios:
    """GDTopK's new ratios ``{group: ratio}``, to deliver to the groups and their workers."""

    ratios: dict[int, float]


@dataclass(frozen=True)
class WeightsReady:
    """The global weights exist now (a worker pushed the initial weights)."""


@dataclass(frozen=True)
class Done:
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


Action = FormGroups | PlaceLate | Regroup | SendRatios | WeightsReady | Done | AllFinal | Fail
