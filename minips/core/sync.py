"""The synchronization modes as one table: what BSP, SSP, ASP and GSSP each decide.

A mode is a ``SyncPolicy``; the servers ask it rather than compare mode names, so a new mode is
one row of ``POLICIES`` (and its tests). What the columns decide:

| mode | bound in a group | a push is applied | groups | regrouping |
|---|---|---|---|---|
| bsp  | 0 | with its round: one step on the round's mean | 1 | no |
| ssp  | ``--staleness`` s | on arrival, 1/(workers) of a step | 1 | no |
| asp  | none | on arrival, 1/(workers) of a step | 1 | no |
| gssp | ``--staleness`` s | on arrival, 1/(group's workers) of a step | k (``--groups``) | yes |

Every mode exchanges with the global server every ``sync_every`` pushes of a group
(``exchange_due``) and merges a group's delta by ``--merge`` (``merge_scale``: mean over groups
or sum; with one group the two are the same).
A bound of 0 (BSP, or SSP with ``--staleness 0``) applies pushes in rounds: one SGD step on the
mean of a round's gradients, which is synchronous SGD (``reference.train``).

Public API: ``SyncPolicy``, ``POLICIES``, ``MODES``, ``policy(mode)``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODES", "POLICIES", "SyncPolicy", "policy"]


@dataclass(frozen=True)
class SyncPolicy:
    """One synchronization mode: its row of ``POLICIES``."""

    name: str
    bound: str  # "zero", "staleness" (the run's s) or "none" (unbounded)
    grouped: bool  # workers are split into speed groups (k of them); else one group of all
    regroup: bool  # groups are recomputed when the workers' speeds drift

    def staleness_bound(self, staleness: int) -> int | None:
        """The SSP bound inside a group: 0, the run's ``staleness``, or None (no bound)."""
        return {"zero": 0, "none": None}.get(self.bound, staleness)

    def in_rounds(self, staleness: int) -> bool:
        """Pushes wait for their round and apply as one step (a bound of 0)."""
        return self.staleness_bound(staleness) == 0

    def group_count(self, groups: int) -> int:
        """Groups of a run: ``groups`` (0 = chosen from the step times) or 1."""
        return groups if self.grouped else 1

    def exchange_due(self, pushes: int, sync_every: int) -> bool:
        """A group exchanges with the global server after ``sync_every`` pushes (every mode)."""
        return pushes >= sync_every

    def merge_scale(self, merge: str, groups: int) -> float:
        """The factor a group's delta is added to the global weights with: 1/k for ``mean``
        over k > 1 groups, else 1 (``sum``, or one group: the delta is the whole update)."""
        return 1.0 / groups if merge == "mean" and groups > 1 else 1.0


POLICIES: dict[str, SyncPolicy] = {p.name: p for p in (
    SyncPolicy("bsp", bound="zero", grouped=False, regroup=False),
    SyncPolicy("ssp", bound="staleness", grouped=False, regroup=False),
    SyncPolicy("asp", bound="none", grouped=False, regroup=False),
    SyncPolicy("gssp", bound="staleness", grouped=True, regroup=True),
)}
MODES = tuple(POLICIES)  # ("bsp", "ssp", "asp", "gssp")


def policy(mode: str) -> SyncPolicy:
    """The policy of ``mode``; ValueError names the modes there are."""
    try:
        return POLICIES[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}: one of {MODES}") from None
