"""The listening side of minips over asyncio: ``serve`` and ``Server``, which run the server
half of the handshake on each connection, then hand the ``Channel`` to the handler.

Invariants (see also transport.py):
- A server handler only ever sees an authenticated channel: HELLO, CHALLENGE, AUTH and WELCOME
  have passed within ``handshake_timeout``, and ``accept`` agreed.
- Before that a connection costs a few KB (16 KiB frames at most, handshake.py), at most
  ``Options.guard.max_pending_per_source`` of them per address and ``max_pending`` in all are in
  the handshake, and an address that failed the secret too often waits (guard.py).
- A peer's protocol error, a refused or timed-out handshake, or a failing ``accept`` /
  ``handler`` closes that one connection (the peer is told why, with ERROR or REFUSE) and is
  counted in ``Server.stats``; the server keeps serving the others.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from typing import Any

from minips.errors import AuthError, RemoteProtocolError
from minips.net import guard as g
from minips.net.channel import Channel
from minips.net.endpoints import shared_secret
from minips.net.frame_protocol import FrameProtocol, Options
from minips.net.logcounts import CountingLog
from minips.wire import protocol as p

__all__ = ["Accept", "Handler", "Server", "serve"]

log = logging.getLogger("minips.net.transport")

Accept = Callable[[p.Hello], "dict[str, Any] | Awaitable[dict[str, Any]]"]
Handler = Callable[[Channel], Awaitable[None]]
_TURNED_AWAY = {  # guard.admit's reasons, as an operator reads them
    "backoff": "too many failed handshakes (wrong secret): it must wait",
    "per_source": "too many handshakes open from this address at once",
    "total": "too many handshakes open at once",
}


def _source(ch: Channel) -> str:
    """The peer's address without the port: what limits and back-off are kept per."""
    peer = ch.peername
    return str(peer[0]) if isinstance(peer, tuple) else "local"


class Server:
    """A listening minips server: handshakes each connection, then runs ``handler`` on it.

    Before a peer has authenticated, ``guard`` (guard.py) caps how many handshakes run at once
    (per source address and in total) and makes a source that keeps failing wait; connections
    over a cap or in back-off are closed at once, unread. Refusals are logged as counts."""

    def __init__(self, accept: Accept, handler: Handler, token: str | bytes | None,
                 options: Options) -> None:
        self.accept, self.handler, self.token, self.options = accept, handler, token, options
        self.host, self.port = "", 0
        self.channels: set[Channel] = set()
        self.stats = collections.Counter({k: 0 for k in (
            "connections", "accepted", "refused", "protocol_errors", "limit_exceeded",
            "read_timeouts", "handshake_timeouts", "handler_errors", "turned_away")})
        self.guard = g.Guard(options.guard)
        self.counted = CountingLog(log)  # refusals, as counts
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _made(self, proto: FrameProtocol) -> None:
        self.stats["connections"] += 1
        ch = Channel(proto)
        source = _source(ch)
        why = self.guard.admit(source, proto.loop.time())
        if why:  # closed unread: costs no handshake, no HMAC, no buffer
            self._turn_away(source, why)
            ch.close_nowait()
            return
        self.guard.opened(source)
        task = asyncio.create_task(self._serve_one(ch, source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _turn_away(self, source: str, why: str) -> None:
        """Count and log a connection the guard said no to (``why``: a ``guard.admit`` reason)."""
        self.stats["turned_away"] += 1
        self.counted.note(f"turned away ({why})", f"{source}: " + _TURNED_AWAY[why])

    async def _serve_one(self, ch: Channel, source: str) -> None:
        try:
            if await self._admit(ch, source):
                self.channels.add(ch)
                await self.handler(ch)
        except (RemoteProtocolError, ConnectionError):
            pass  # the protocol already counted it and told the peer
        except Exception as e:  # a bug in accept() or handler(): tell the peer, keep serving
            self.stats["handler_errors"] += 1
            log.exception("handler failed for %s", ch.peername)
            await ch.send_error("internal", f"{type(e).__name__}: {e}")
        finally:
            self.channels.discard(ch)
            await ch.close()

    async def _admit(self, ch: Channel, source: str) -> bool:
        """Run the handshake; False (and counted) when it was refused or failed."""
        try:
            await asyncio.wait_for(self._handshake(ch, source), self.options.handshake_timeout)
        except AuthError as e:
            self.stats["refused"] += 1
            self.counted.note("refused", f"{source}: {e.reason}")
            return False
        except asyncio.TimeoutError:
            self.stats["handshake_timeouts"] += 1
            return False
        finally:
            self.guard.closed(source)
        self.stats["accepted"] += 1
        return True

    def _check_auth(self, hs: p.ServerHandshake, auth: p.Auth, source: str) -> p.Refuse | None:
        """``hs.on_auth`` with the source's back-off applied: a source still in back-off is cut
        off before its MAC is even checked; a wrong MAC starts or lengthens its back-off."""
        now = asyncio.get_running_loop().time()
        if self.guard.backoff_left(source, now) > 0:
            self._turn_away(source, "backoff")
            raise ConnectionAbortedError("source in back-off")
        refuse = hs.on_auth(auth)
        if refuse is None:
            self.guard.succeeded(source)
        elif (wait := self.guard.failed(source, now)) > 0:
            self.counted.note("back-off", f"{source} failed {self.guard.failures(source)} "
                              f"handshakes in a row: refused for {wait:.1f} s")
        return refuse

    async def _handshake(self, ch: Channel, source: str) -> None:
        hs = p.ServerHandshake(shared_secret(self.token))
        hello = await ch.recv()
        assert isinstance(hello, p.Hello)  # the state machine allows nothing else first
        reply = hs.on_hello(hello)
        await ch.send(reply)
        if isinstance(reply, p.Refuse):
            raise AuthError(reply.reason)
        auth = await ch.recv()
        assert isinstance(auth, p.Auth)
        refuse = self._check_auth(hs, auth, source)
        info: dict[str, Any] = {}
        if refuse is None:
            try:
                got = self.accept(hello)
                info = await got if inspect.isawaitable(got) else got
            except AuthError as e:
                refuse = p.Refuse(code="refused", reason=e.reason[: p.MAX_TEXT])
        if refuse is not None:
            await ch.send(refuse)
            raise AuthError(refuse.reason)
        ch.peer_hello, ch.welcome_info = hello, info
        ch.worker_id = int(info.get("worker_id", hello.worker_id))
        await ch.send(hs.welcome(ch.worker_id, info))
        if self.options.heartbeat:
            ch.start_heartbeat(self.options.heartbeat)

    def close(self) -> None:
        """Stop listening and close every connection."""
        self.counted.flush()
        if self._server is not None:
            self._server.close()
        for ch in list(self.channels):
            ch.close_nowait()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def serve(host: str, port: int, *, accept: Accept, handler: Handler,
                token: str | bytes | None = None, ssl: ssl_module.SSLContext | None = None,
                options: Options | None = None) -> Server:
    """Listen on host:port (port 0: any free port, see ``Server.port``) and serve minips.

    ``token`` defaults to $MINIPS_TOKEN; with one set, clients without it are refused.
    """
    options = options or Options()
    server = Server(accept, handler, token, options)

    def factory() -> FrameProtocol:
        proto = FrameProtocol(p.Connection(p.Side.SERVER, alloc=options.alloc,
                                            limits=options.limits), options)
        proto.on_made, proto.stats = server._made, server.stats
        return proto

    loop = asyncio.get_running_loop()
    server._server = await loop.create_server(factory, host, port, ssl=ssl)
    sockname = server._server.sockets[0].getsockname()
    server.host, server.port = sockname[0], sockname[1]
    return server
