"""The global server's one view of a group's server, wherever it runs (sans-IO interface).

A group's server runs in the global server's process (``server.InProcGroup``) or as a separate
`minips group` process behind a TCP channel (``group_sessions.RemoteGroup``); while none serves a
group (a resumed run waiting for its group processes, a lost one) it is ``NoGroup``. The global
side calls the same methods on each and never asks which it is.

The group's GDTopK ratio has one owner: ``GroupPeer.ratio``. In-process it *is* the group
server's attribute, so the group reads it where the roster writes it; for a group process it is
the value last sent, and ``send_ratio`` carries a new one over the wire (ASSIGN).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from minips.wire.messages import Assign

__all__ = ["GroupPeer", "NoGroup"]


class GroupPeer(Protocol):
    """What the global server does with one group's server."""

    ratio: float  # the group's GDTopK kept fraction (the one owner of it)

    @property
    def connected(self) -> bool:
        """A group server serves the group now (a lost group process: False)."""

    def expect(self, w: int) -> None:
        """Worker ``w`` joins the group (placed late, moved by a regroup)."""

    def traffic(self) -> dict[str, int]:
        """Worker <-> group bytes (``bytes_in``, ``bytes_out``) as far as known here."""

    def reported(self, stats: dict[str, Any]) -> None:
        """The counters of the group's last merged exchange (a group process's traffic)."""

    def state_dict(self) -> dict[str, Any] | None:
        """The group's training state for a checkpoint (None: it is not in this process)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's training state back (in-process only)."""

    async def send_ratio(self, assign: Assign) -> None:
        """Tell the group server its new ratio (an ASSIGN), unless it reads ``ratio`` itself."""

    async def finish(self) -> None:
        """The budget is spent: the group flushes its final delta."""

    async def close(self) -> None:
        """The global server closes: stop the group's server if it runs here."""


class NoGroup:
    """No group server serves the group now: it keeps the ratio and the last traffic known."""

    def __init__(self, ratio: float = 0.01, traffic: dict[str, int] | None = None) -> None:
        self.ratio = ratio
        self._traffic = dict(traffic or {})

    @property
    def connected(self) -> bool:
        return False

    def expect(self, w: int) -> None:
        """A group process learns its members from the global server's replies."""

    def traffic(self) -> dict[str, int]:
        return self._traffic

    def reported(self, stats: dict[str, Any]) -> None:
        self._traffic = {k: int(stats.get(k, 0)) for k in ("bytes_in", "bytes_out")}

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load: the group's state lives in its own process."""

    async def send_ratio(self, assign: Assign) -> None:
        """Nobody to tell: the group process that adopts the group gets it in its ASSIGN."""

    async def finish(self) -> None:
        """Nobody to tell."""

    async def close(self) -> None:
        """Nothing runs here."""
