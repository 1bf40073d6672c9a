"""A worker's (or the evaluator's) side of its connections: ``connect_role`` opens one with the
settings of a ``WorkerConfig``, ``Link`` is a channel on the worker's emulated link (pacing and
latency, docs/links.md), ``Stopped`` says how a server ended the session, ``leave`` says
goodbye.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TypeVar

from minips.errors import MiniPSError
from minips.net import links, transport
from minips.net.channel import Channel
from minips.run.config import WorkerConfig, client_ssl
from minips.wire import protocol

__all__ = ["Link", "Stopped", "connect_role", "leave"]

M = TypeVar("M", bound=protocol.Message)


class Link:
    """A channel on the worker's emulated link: paced to ``bandwidth_bps`` (sends) and
    ``down_bps`` (reads), bytes/s, 0 = full speed, as bytes go out and come in; ``latency_s``
    added before every send."""

    def __init__(self, ch: Channel, bandwidth_bps: float, latency_s: float,
                 down_bps: float = 0.0) -> None:
        self.ch = ch
        self.latency_s = latency_s
        pacing = links.Pacing.of(bandwidth_bps, down_bps, time.monotonic())
        if pacing is not None:
            ch.set_pacing(pacing)

    async def send(self, msg: protocol.Message) -> None:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        await self.ch.send(msg)

    async def expect(self, kind: type[M]) -> M:
        """Next message of type ``kind``; heartbeats are skipped, ERROR / LEAVE raise."""
        while True:
            msg = await self.ch.recv()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, (protocol.Error, protocol.Leave)):
                raise Stopped(msg)


class Stopped(MiniPSError):
    """The server ended the session: LEAVE "done" or ERROR end the run, another LEAVE (a group
    server shutting down) only this connection."""

    def __init__(self, msg: protocol.Error | protocol.Leave) -> None:
        super().__init__(f"{type(msg).__name__}: {msg.reason}")
        self.error = ""  # why, when an ERROR ended the run
        if isinstance(msg, protocol.Error):
            self.final = msg.code != "lease"  # an expired lease only asks for a rejoin
            self.error = f"the group server sent ERROR {msg.code}: {msg.reason}"
        else:
            self.final = msg.reason == "done"


async def connect_role(cfg: WorkerConfig, host: str, port: int, role: str, worker_id: int, *,
                       group: int = -1, timeout: float | None = None,
                       retries: int | None = 5) -> Channel:
    """One connection (``retries`` more attempts with backoff; None: as many as ``timeout``
    allows) within ``timeout`` seconds (default: ``cfg.connect_timeout_s``)."""
    timeout = cfg.connect_timeout_s if timeout is None else timeout
    return await transport.connect(host, port, role=role, worker_id=worker_id, group=group,
                                   token=cfg.token, timeout=timeout, ssl=client_ssl(cfg.tls_ca),
                                   retries=retries)


async def leave(ch: Channel) -> None:
    """Say LEAVE and close (whatever state the connection is in)."""
    with contextlib.suppress(Exception):
        await ch.close(leave="bye")
