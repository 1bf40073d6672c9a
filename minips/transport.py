"""minips over asyncio: ``connect`` (with retry) and ``serve``, each running its half of the
handshake, then handing out a ``Channel`` (channel.py) that sends and receives whole messages.

All protocol decisions live in the sans-IO modules (``minips.protocol``); this module only opens
connections and runs the handshake over them.

Invariants:
- A server handler only ever sees an authenticated channel: HELLO, CHALLENGE, AUTH and WELCOME
  have passed within ``handshake_timeout``, and ``accept`` agreed.
- Before that a connection costs a few KB (16 KiB frames at most, handshake.py), at most
  ``Options.guard.max_pending_per_source`` of them per address and ``max_pending`` in all are in
  the handshake, and an address that failed the secret too often waits (guard.py).
- A peer's protocol error, a refused or timed-out handshake, or a failing ``accept`` /
  ``handler`` closes that one connection (the peer is told why, with ERROR or REFUSE) and is
  counted in ``Server.stats``; the server keeps serving the others.
- ``connect`` takes at most ``timeout`` seconds, retries included.

Public API:
- ``install_uvloop() -> bool``: use uvloop's event loop policy where it imports.
- ``Options``, ``Channel`` and the timeout / queue constants (defined in channel.py).
- ``async connect(host, port, *, role, worker_id, token, timeout, retries, ssl, ...) -> Channel``
  raises ``AuthError`` on REFUSE, ``ConnectionError`` when unreachable within ``timeout``.
- ``async serve(host, port, *, accept, handler, token, ssl, options) -> Server``:
  ``accept(hello) -> dict`` (may be async) returns WELCOME's info (key ``worker_id`` sets the id
  sent back) or raises ``AuthError(reason)`` to refuse; then ``await handler(channel)``.
- ``Channel``: ``send(msg, compress=False)``, ``recv(timeout=None)`` (HEARTBEATs are absorbed;
  one reader at a time), ``send_error(code, reason)``, ``set_alloc(alloc)``, ``peer_hello``,
  ``welcome_info``, ``worker_id``, ``last_recv`` (``loop.time()`` of the last bytes),
  ``bytes_sent``/``bytes_received``, ``start_heartbeat(interval)``,
  ``start_silence_limit(seconds)`` (abort once the peer sent nothing that long), ``error``,
  ``close(leave=None)``, ``abort(reason)``.
- ``Server``: ``host``, ``port``, ``stats`` (connections, accepted, refused, protocol_errors,
  limit_exceeded, read_timeouts, handshake_timeouts, handler_errors, turned_away: closed
  unread by ``guard``), ``guard``, ``channels``, ``close()``, ``wait_closed()``; also an async
  context manager.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import random
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from typing import Any

from minips import guard as g
from minips import protocol as p
from minips.channel import (
    HANDSHAKE_TIMEOUT_S,
    MAX_QUEUED,
    MAX_QUEUED_BYTES,
    READ_TIMEOUT_S,
    SEND_TIMEOUT_S,
    SOCKET_BUFFER_BYTES,
    WRITE_BYTES,
    Channel,
    FrameProtocol,
    Options,
)
from minips.errors import AuthError, RemoteProtocolError
from minips.logcounts import CountingLog

__all__ = [
    "READ_TIMEOUT_S", "SEND_TIMEOUT_S", "HANDSHAKE_TIMEOUT_S", "MAX_QUEUED", "MAX_QUEUED_BYTES",
    "SOCKET_BUFFER_BYTES", "WRITE_BYTES", "TOKEN_ENV", "install_uvloop", "Options", "Channel",
    "Server", "connect", "serve",
]

log = logging.getLogger("minips.transport")

TOKEN_ENV = "MINIPS_TOKEN"  # environment variable holding the shared secret
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 2.0  # connect retry delays (doubling, with jitter)


def install_uvloop() -> bool:
    """Make new event loops uvloop loops when uvloop is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# ---------------------------------------------------------------------------------------------
# Client


def _token(token: str | bytes | None) -> str | bytes | None:
    return os.environ.get(TOKEN_ENV) if token is None else token


async def _open(host: str, port: int, side: p.Side, options: Options,
                ssl: ssl_module.SSLContext | None, server_hostname: str | None) -> Channel:
    loop = asyncio.get_running_loop()
    conn = p.Connection(side, alloc=options.alloc, limits=options.limits)
    _, proto = await loop.create_connection(
        lambda: FrameProtocol(conn, options), host, port, ssl=ssl,
        server_hostname=(server_hostname or host) if ssl else None)
    return Channel(proto)


async def _client_handshake(ch: Channel, hs: p.ClientHandshake) -> None:
    await ch.send(hs.hello)
    reply = await ch.recv()
    if isinstance(reply, p.Challenge):
        await ch.send(hs.on_challenge(reply))
        reply = await ch.recv()
    welcome = hs.on_reply(reply)
    ch.welcome_info, ch.worker_id = welcome.info, welcome.worker_id


async def _attempt(host: str, port: int, hs: p.ClientHandshake, options: Options,
                   ssl: ssl_module.SSLContext | None, server_hostname: str | None) -> Channel:
    ch = await _open(host, port, p.Side.CLIENT, options, ssl, server_hostname)
    try:
        await _client_handshake(ch, hs)
    except BaseException:
        ch._transport.abort()
        raise
    if options.heartbeat:
        ch.start_heartbeat(options.heartbeat)
    return ch


async def connect(
    host: str, port: int, *, role: str = "worker", worker_id: int = -1,
    capabilities: tuple[str, ...] = (), address: str = "", group: int = -1,
    token: str | bytes | None = None, timeout: float = 10.0, retries: int = 5,
    ssl: ssl_module.SSLContext | None = None, server_hostname: str | None = None,
    options: Options | None = None, version: int = p.PROTOCOL_VERSION,
) -> Channel:
    """Connect and handshake; retry unreachable addresses with exponential backoff and jitter.

    ``token`` defaults to $MINIPS_TOKEN ("" means none). The whole call, retries included, takes
    at most ``timeout`` seconds. ``version`` exists so tests can speak a wrong one.
    """
    options = options or Options()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: BaseException | None = None
    for attempt in range(retries + 1):
        left = deadline - loop.time()
        if left <= 0:
            break
        hs = p.ClientHandshake(_token(token), version=version, role=role, worker_id=worker_id,
                               capabilities=capabilities, address=address, group=group)
        try:
            return await asyncio.wait_for(
                _attempt(host, port, hs, options, ssl, server_hostname), left)
        except AuthError:
            raise
        except (OSError, asyncio.TimeoutError) as e:  # refused, reset, unreachable, too slow
            last = e
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**attempt) * random.uniform(0.5, 1.0)
        await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
    raise ConnectionError(f"could not connect to {host}:{port} within {timeout} s "
                          f"({attempt + 1} attempts): {last!r}")


# ---------------------------------------------------------------------------------------------
# Server

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
                 options: Options, guard: g.Guard | None = None) -> None:
        self.accept, self.handler, self.token, self.options = accept, handler, token, options
        self.host, self.port = "", 0
        self.channels: set[Channel] = set()
        self.stats = collections.Counter({k: 0 for k in (
            "connections", "accepted", "refused", "protocol_errors", "limit_exceeded",
            "read_timeouts", "handshake_timeouts", "handler_errors", "turned_away")})
        self.guard = guard or g.Guard()
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
            ch._transport.close()
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
        hs = p.ServerHandshake(_token(self.token))
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
            ch._transport.close()

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
    server = Server(accept, handler, token, options, g.Guard(options.guard))

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
