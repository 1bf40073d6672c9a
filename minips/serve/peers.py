"""A group's server as the global server's shell sees it: one ``GroupPeer`` per group, wherever
that server runs.

``server.GlobalServer`` holds them (``peers``: group id -> peer); the global core never sees one
(it knows a group by its ``roster.GroupHandle``: members, address, ratio, counters). A group's
server runs in the global server's process (``server.InProcGroup``) or as a separate
`minips group` process behind a TCP channel (``sessions.RemoteGroup``); while none serves the
group (a resumed run waiting for its group processes, a lost one) its peer is ``NoGroup``. The
shell calls the same methods on each and never asks which it is.

A peer also keeps the group's worker traffic (``traffic``: ``bytes_in`` / ``bytes_out``), which
the shell feeds to its ledger (``record/ledger.py``) and hands to the core with the events that
need it: counted live by an in-process group's channels, or as a group process's last merged
exchange reported it (``reported``); a lost group's peer keeps the last count known.
"""

from __future__ import annotations

from typing import Any, Protocol

from minips.wire.control import Assign

__all__ = ["GroupPeer", "NoGroup"]


class GroupPeer(Protocol):
    """What the global server does with one group's server."""

    @property
    def connected(self) -> bool:
        """A group server serves the group now (a lost group process: False)."""

    def expect(self, w: int) -> None:
        """Worker ``w`` joins the group (placed late, moved by a regroup, rehomed)."""

    def forget(self, w: int) -> None:
        """Worker ``w``'s control session was cut for a protocol violation: unless it is
        connected to the group's server, it no longer counts in the group's clocks (as after a
        LEAVE), so a worker that comes back only to be cut again never holds the group's SSP
        minimum."""

    def traffic(self) -> dict[str, int]:
        """Worker <-> group bytes (``bytes_in``, ``bytes_out``) as far as known here."""

    def reported(self, stats: dict[str, Any]) -> None:
        """The counters of the group's last merged exchange (a group process's traffic)."""

    def state_dict(self) -> dict[str, Any] | None:
        """The group's training state for a checkpoint (None: it is not in this process)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's training state back (in-process only)."""

    def send_settings(self, assign: Assign) -> None:
        """Tell the group server its new ratio and H (an ASSIGN): at once in-process, else
        queued."""

    async def finish(self) -> None:
        """The budget is spent: the group flushes its final delta."""

    async def close(self) -> None:
        """The global server closes: stop the group's server if it runs here."""


class NoGroup:
    """No group server serves the group now: it keeps the last traffic known."""

    def __init__(self, traffic: dict[str, int] | None = None) -> None:
        self._traffic = {k: int(v) for k, v in (traffic or {}).items()}

    @property
    def connected(self) -> bool:
        return False

    def expect(self, w: int) -> None:
        """A group process learns its members from the global server's replies."""

    def forget(self, w: int) -> None:
        """No message tells a group process: a member it expected and that never connects
        stops holding its clocks when its lease (``lease_s``) runs out."""

    def traffic(self) -> dict[str, int]:
        return self._traffic

    def reported(self, stats: dict[str, Any]) -> None:
        self._traffic = {k: int(stats.get(k, 0)) for k in ("bytes_in", "bytes_out")}

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load: the group's state lives in its own process."""

    def send_settings(self, assign: Assign) -> None:
        """Nobody to tell: the group process that adopts the group gets it in its ASSIGN."""

    async def finish(self) -> None:
        """Nobody to tell."""

    async def close(self) -> None:
        """Nothing runs here."""
