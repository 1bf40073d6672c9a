"""What the global server's asyncio sessions share: its core, its events, its tasks (asyncio).

``server.GlobalServer`` makes one ``ServerIO`` and hands it to each session
(``client_sessions.py``, ``group_sessions.py``, ``server_checkpoint.py``, ``run_end.py``), so
they read the rules' state from ``core`` (a ``GlobalCore``), wait on the events, start tasks with
``spawn``, hand the actions the core returns to ``perform`` and open groups with ``open_group``
(both the server's), without importing the server back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from minips.core.global_core import Action, GlobalCore
from minips.core.roster import GroupHandle, WorkerEntry
from minips.net.channel import Channel
from minips.wire.messages import Message

if TYPE_CHECKING:  # the server's config, for annotations only (server.py imports this)
    from minips.server import ServerConfig

__all__ = ["OpenGroup", "ServerIO", "send_quiet"]

OpenGroup = Callable[[int, list[int]], Awaitable[GroupHandle]]  # (group, members) -> its handle


class ServerIO:
    """The global server's shared asyncio state (see the module docstring)."""

    def __init__(self, cfg: ServerConfig, core: GlobalCore,
                 perform: Callable[[list[Action]], None], open_group: OpenGroup) -> None:
        self.cfg, self.core = cfg, core
        self.perform = perform  # do what the core decided (global_core.py)
        self.open_group = open_group  # start group g's server (or hand g to a group process)
        self.finished = asyncio.Event()  # the run is over
        self.evaluated_final = asyncio.Event()  # the evaluator got the final weights
        self.weights_ready = asyncio.Event()  # the global weights exist
        self.groups_opened = asyncio.Event()  # every group of the grouping has its handle
        self.pending_groups: list[Channel] = []  # group processes not given a group yet
        self.rejected: collections.Counter[str] = collections.Counter()  # ERRORs sent, by code
        self.rejoin: asyncio.Task[None] | None = None  # waiting for every worker to come back
        self.saving: asyncio.Future[int] | None = None  # checkpoint write in flight
        self.tasks: set[asyncio.Task[Any]] = set()
        if core.weights is not None:
            self.weights_ready.set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; ``close`` cancels what is left."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def assign(self, entry: WorkerEntry, g: int) -> None:
        """Put worker ``entry`` in group ``g`` and tell it (ASSIGN) if it is connected and the
        group has a server ("" address: it is away)."""
        entry.group = g
        if entry.ch is not None and self.core.groups[g].address:
            with contextlib.suppress(ConnectionError):
                await entry.ch.send(self.core.assign_message(self.core.groups[g]))


async def send_quiet(ch: Channel, msg: Message) -> None:
    """Send ``msg``; a connection gone meanwhile is no error here."""
    with contextlib.suppress(ConnectionError, OSError):
        await ch.send(msg)
