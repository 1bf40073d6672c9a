"""A group server in the global server's process, as the global server sees it (asyncio).

``InProcGroup`` is the ``group_peer.GroupPeer`` of a ``group.GroupServer`` the global server
started itself: direct calls. Its ratio *is* the group server's attribute, so the roster writes
the one copy the group reads. Its uplink (the group's ``exchange.GroupLink``) is
``server.InProcLink``.
"""

from __future__ import annotations

from typing import Any

from minips.serve.group import GroupServer
from minips.wire import messages

__all__ = ["InProcGroup"]


class InProcGroup:
    """``GroupPeer`` of a group server in this process."""

    def __init__(self, server: GroupServer) -> None:
        self.server = server

    @property
    def ratio(self) -> float:
        return float(self.server.ratio)

    @ratio.setter
    def ratio(self, value: float) -> None:
        self.server.ratio = value

    @property
    def connected(self) -> bool:
        return True

    def expect(self, w: int) -> None:
        self.server.expect(w)

    def traffic(self) -> dict[str, int]:
        return self.server.traffic()

    def reported(self, stats: dict[str, Any]) -> None:
        """Its traffic is read live (``traffic``)."""

    def state_dict(self) -> dict[str, Any] | None:
        return self.server.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state)

    async def send_ratio(self, assign: messages.Assign) -> None:
        """It reads ``ratio`` itself."""

    async def finish(self) -> None:
        self.server.finish()

    async def close(self) -> None:
        await self.server.close()
