"""A worker's session with the global server, its control channel: WELCOME (the run config),
ASSIGN (its group server, upload ratio, staleness; again on regrouping or a new GDTopK ratio),
and the end of the run (LEAVE "done", or ERROR). When the global server is lost mid-run the
session reconnects for up to ``reconnect_s`` (it may come back with ``--resume``).

The worker's training loop (worker.py) reads ``assign`` and ``done`` and waits on ``assigned`` /
``changed``; STATS go out on ``ch``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from minips.client.worker_link import connect_role
from minips.errors import AuthError, RemoteProtocolError
from minips.net.channel import Channel
from minips.run.config import WorkerConfig
from minips.wire import protocol

__all__ = ["Control"]


def _no_ratio(ratio: float) -> None:
    """``Control.on_ratio`` until the worker has a compressor: nothing to set."""


class Control:
    """The control session of one worker. ``event(name, **fields)`` records what happened to
    it (lost, back, gave up, stopped) in the worker's metrics file."""

    ch: Channel  # the control channel (set by ``open``, replaced on reconnect)

    def __init__(self, cfg: WorkerConfig, event: Callable[..., None]) -> None:
        self.cfg, self.event = cfg, event
        self.worker_id = cfg.worker_id  # the id the global server gave (WELCOME)
        self.heartbeat_s = 0.0  # from the run config, once known
        self.on_ratio: Callable[[float], None] = _no_ratio  # a new upload ratio (ASSIGN)
        self.assign: protocol.Assign | None = None  # latest ASSIGN
        self.assigned = asyncio.Event()  # the first ASSIGN (or the end) arrived
        self.changed = asyncio.Event()  # set by every ASSIGN; cleared by its waiter
        self.done = False  # the run is over
        self.stopped_by = ""  # the ERROR that ended the run, if one did

    async def open(self) -> dict[str, Any]:
        """Connect to the global server; returns WELCOME's info (the run config)."""
        self.ch = await connect_role(self.cfg, self.cfg.server_host, self.cfg.server_port,
                                     "worker", self.cfg.worker_id)
        info = dict(self.ch.welcome_info)
        self.worker_id = int(info.get("worker_id", self.cfg.worker_id))
        return info

    def address(self) -> str:
        """The assigned group server's address (after the first ASSIGN)."""
        assert self.assign is not None
        return str(self.assign.address)

    def group(self) -> int:
        """The assigned group (after the first ASSIGN)."""
        assert self.assign is not None
        return int(self.assign.group)

    async def loop(self) -> None:
        """Read the control channel; when the global server is lost mid-run, reconnect with
        backoff until ``reconnect_s`` has passed."""
        while not self.done:
            await self._read()
            if self.done:
                return
            self.event("control_lost")
            try:
                self.ch = await connect_role(self.cfg, self.cfg.server_host,
                                             self.cfg.server_port, "worker", self.worker_id,
                                             timeout=self.cfg.reconnect_s, retries=None)
            except (ConnectionError, AuthError) as exc:
                self.event("control_gave_up", reason=str(exc))
                return
            self.ch.start_heartbeat(self.heartbeat_s)
            self.event("control_back")

    async def _read(self) -> None:
        """ASSIGN (group, ratio), LEAVE "done", ERROR; returns when the channel closes."""
        with contextlib.suppress(ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError):
            while True:
                msg = await self.ch.recv()
                if isinstance(msg, protocol.Assign):
                    self.assign = msg
                    self.on_ratio(msg.ratio)
                    self.assigned.set()
                    self.changed.set()
                elif isinstance(msg, protocol.Error):
                    self.end(f"the global server sent ERROR {msg.code}: {msg.reason}")
                    return
                elif isinstance(msg, protocol.Leave) and msg.reason == "done":
                    self.end()
                    return
                elif isinstance(msg, protocol.Leave):
                    return

    def end(self, error: str = "") -> None:
        """The run is over: normally (LEAVE "done"), or cut short by a server's ``error``."""
        if error and not self.done:
            self.stopped_by = error
            self.event("stopped", reason=error)
        self.done = True
        self.assigned.set()
        self.changed.set()
