"""asyncio shell around minips.protocol: connect/retry, serve, handshake, heartbeats, send/recv.

All protocol decisions live in ``minips.protocol``; this module only moves bytes. Receiving is
zero-copy: ``asyncio.BufferedProtocol`` hands the socket the decoder's own buffers, so a large
payload lands straight in the array the ``alloc`` callable chose. Sending hands the frame header
and the caller's buffers (16 KiB and up) to ``transport.writelines`` without joining them; with
uvloop that is one writev, with the standard loop (3.10/3.11) asyncio joins them itself.

Invariants:
- ``Channel.send`` returns only once the kernel has taken every byte of the frame (write buffer
  high-water mark 0), so the caller may modify the arrays it sent, and a peer that stops reading
  cannot make our memory grow: the sender waits, and is cut off after ``send_timeout``.
- A peer's protocol error (bad frame, over a limit, out-of-order message, half a frame then
  silence for ``read_timeout``) sends ERROR with the reason, closes that one connection and is
  counted in ``Server.stats``; the server keeps serving the others.
- Receiving stops (``pause_reading``) while ``MAX_QUEUED`` messages wait for ``recv``.

Public API:
- ``install_uvloop() -> bool``: use uvloop's event loop policy where it imports.
- ``Options``: timeouts, heartbeat interval, limits, alloc, socket buffer size.
- ``async connect(host, port, *, role, worker_id, token, timeout, retries, ssl, ...) -> Channel``
  raises ``AuthError`` on REFUSE, ``ConnectionError`` when unreachable within ``timeout``.
- ``async serve(host, port, *, accept, handler, token, ssl, options) -> Server``:
  ``accept(hello) -> dict`` (may be async) returns WELCOME's info (key ``worker_id`` sets the id
  sent back) or raises ``AuthError(reason)`` to refuse; then ``await handler(channel)``.
- ``Channel``: ``send(msg, compress=False)``, ``recv(timeout=None)`` (HEARTBEATs are absorbed;
  one reader at a time), ``send_error(code, reason)``, ``set_alloc(alloc)``, ``peer_hello``,
  ``welcome_info``, ``worker_id``, ``last_recv`` (``loop.time()`` of the last bytes),
  ``bytes_sent``/``bytes_received``, ``start_heartbeat(interval)``, ``close(leave=None)``.
- ``Server``: ``host``, ``port``, ``stats`` (connections, accepted, refused, protocol_errors,
  limit_exceeded, read_timeouts, handshake_timeouts, handler_errors), ``channels``, ``close()``,
  ``wait_closed()``; also an async context manager.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import random
import socket
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from minips import protocol as p
from minips.errors import AuthError, LimitExceeded, LocalProtocolError, RemoteProtocolError

__all__ = [
    "READ_TIMEOUT_S", "SEND_TIMEOUT_S", "HANDSHAKE_TIMEOUT_S", "MAX_QUEUED", "TOKEN_ENV",
    "install_uvloop", "Options", "Channel", "Server", "connect", "serve",
]

log = logging.getLogger("minips.transport")

TOKEN_ENV = "MINIPS_TOKEN"  # environment variable holding the shared secret
READ_TIMEOUT_S = 30.0  # seconds a peer may stall in the middle of a frame
SEND_TIMEOUT_S = 120.0  # seconds a send may wait for a peer that does not read
HANDSHAKE_TIMEOUT_S = 10.0  # seconds from accept to WELCOME
SOCKET_BUFFER_BYTES = 4 << 20  # SO_SNDBUF / SO_RCVBUF: big frames need fewer wakeups
MAX_QUEUED = 64  # received messages waiting for recv() before we stop reading the socket
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 2.0  # connect retry delays (doubling, with jitter)


def install_uvloop() -> bool:
    """Make new event loops uvloop loops when uvloop is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


@dataclass(frozen=True)
class Options:
    """Per-connection settings shared by ``connect`` and ``serve``."""

    read_timeout: float = READ_TIMEOUT_S  # s of silence allowed in the middle of a frame
    send_timeout: float = SEND_TIMEOUT_S  # s a send may wait for the peer to read
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S  # s for the whole handshake
    heartbeat: float | None = None  # s between HEARTBEATs we send; None: no heartbeats
    socket_buffer: int = SOCKET_BUFFER_BYTES  # bytes of kernel send/receive buffer; 0: default
    limits: p.Limits = field(default_factory=p.Limits)
    alloc: p.Alloc | None = None  # where received payload buffers go; None: fresh numpy arrays


_STAT_OF_REASON = {"protocol_error": "protocol_errors", "limit_exceeded": "limit_exceeded",
                   "read_timeout": "read_timeouts"}  # close reason -> Server.stats key


class _FrameProtocol(asyncio.BufferedProtocol):
    """Feeds socket bytes to the decoder, queues messages, implements drain and read timeout."""

    def __init__(self, conn: p.Connection, options: Options) -> None:
        self.conn, self.options = conn, options
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.queue: collections.deque[p.Message] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None  # a recv() waiting for a message
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused
        self.closed = asyncio.Event()
        self.error: Exception | None = None  # why the connection ended, if not cleanly
        self.close_reason = ""  # "", "protocol_error", "limit_exceeded", "read_timeout"
        self.bytes_received = 0
        self.last_recv = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self.on_made: Callable[[_FrameProtocol], None] | None = None
        self.stats: collections.Counter[str] | None = None  # the server's counters, if any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if self.options.socket_buffer else ():
                sock.setsockopt(socket.SOL_SOCKET, opt, self.options.socket_buffer)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=0)  # pause until the kernel took everything
        if self.on_made is not None:
            self.on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.last_recv = self.loop.time()
        try:
            for msg in self.conn.decoder.buffer_updated(nbytes):
                self.conn.received([msg])
                self.queue.append(msg)
            if self.conn.decoder.error is not None:
                raise self.conn.decoder.error
        except RemoteProtocolError as e:
            self.fail(e, "limit_exceeded" if isinstance(e, LimitExceeded) else "protocol_error")
        self._wake()
        if len(self.queue) >= MAX_QUEUED and self.transport is not None:
            self.transport.pause_reading()
        if self._timer is None and self.conn.decoder.in_frame:
            self._arm_timer(self.options.read_timeout)

    def _arm_timer(self, delay: float) -> None:
        self._timer = self.loop.call_later(delay, self._check_stall)

    def _check_stall(self) -> None:
        """Cut off a peer that sent part of a frame and then nothing for read_timeout."""
        self._timer = None
        if not self.conn.decoder.in_frame or self.transport is None:
            return
        idle = self.loop.time() - self.last_recv
        if idle < self.options.read_timeout:
            self._arm_timer(self.options.read_timeout - idle)
            return
        err = RemoteProtocolError(f"read timeout: half a frame then {idle:.1f} s of silence",
                                  expected=f"a whole frame within {self.options.read_timeout} s")
        self.fail(err, "read_timeout")

    def fail(self, err: RemoteProtocolError, reason: str) -> None:
        """Tell the peer why (ERROR), then close; recv() will raise ``err``."""
        if self.error is None:
            self.error, self.close_reason = err, reason
            log.info("closing connection: %s", err)
            if self.stats is not None:
                self.stats[_STAT_OF_REASON[reason]] += 1
            if self.transport is not None and self.conn.state != p.State.CLOSED:
                frame = self.conn.send(p.Error(code=reason, reason=str(err)[: p.MAX_TEXT]))
                self.transport.writelines(frame)
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = exc or ConnectionResetError("connection closed by peer")
        if self._timer is not None:
            self._timer.cancel()
        self.closed.set()
        self._wake()
        self.resume_writing()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.drained is not None:
            if not self.drained.done():
                self.drained.set_result(None)
            self.drained = None


class Channel:
    """One authenticated connection: send and receive whole messages."""

    def __init__(self, proto: _FrameProtocol) -> None:
        self._proto = proto
        assert proto.transport is not None
        self._transport = proto.transport
        self.peer_hello: p.Hello | None = None  # server side: the client's HELLO
        self.welcome_info: dict[str, Any] = {}  # both sides: WELCOME's info map
        self.worker_id = -1  # the id in WELCOME
        self.bytes_sent = 0
        self.heartbeats_received = 0
        self._beat: asyncio.Task[None] | None = None

    @property
    def bytes_received(self) -> int:
        return self._proto.bytes_received

    @property
    def last_recv(self) -> float:
        """``loop.time()`` when bytes last arrived (for leases)."""
        return self._proto.last_recv

    @property
    def closed(self) -> bool:
        return self._proto.closed.is_set()

    @property
    def peername(self) -> Any:
        return self._transport.get_extra_info("peername")

    def set_alloc(self, alloc: p.Alloc | None) -> None:
        """Receive the next payload buffers into memory ``alloc`` returns (None: fresh arrays)."""
        self._proto.conn.decoder._alloc = alloc or p.default_alloc

    async def send(self, msg: p.Message, *, compress: bool = False) -> None:
        """Send ``msg``; returns once the kernel has every byte (the caller may reuse buffers)."""
        proto = self._proto
        if proto.error is not None:
            raise ConnectionResetError(f"connection is closed ({proto.error})")
        frame = proto.conn.send(msg, compress=compress)
        if len(frame) == 1:
            self._transport.write(frame[0])
        else:
            self._transport.writelines(frame)
        self.bytes_sent += sum(map(len, frame))
        if proto.drained is not None:
            try:
                await asyncio.wait_for(asyncio.shield(proto.drained), proto.options.send_timeout)
            except asyncio.TimeoutError:
                self._transport.abort()
                raise ConnectionError("send timed out: the peer stopped reading") from None
            if proto.error is not None:
                raise ConnectionResetError(f"connection lost while sending ({proto.error})")

    async def recv(self, timeout: float | None = None) -> p.Message:
        """The next message (HEARTBEATs are absorbed). Raises ``RemoteProtocolError`` when the
        peer broke the protocol, ``ConnectionError`` when the connection closed, and
        ``asyncio.TimeoutError`` after ``timeout`` seconds."""
        proto = self._proto
        while True:
            while proto.queue:
                msg = proto.queue.popleft()
                if len(proto.queue) == MAX_QUEUED // 2 and not self._transport.is_closing():
                    self._transport.resume_reading()
                if isinstance(msg, p.Heartbeat):
                    self.heartbeats_received += 1
                    continue
                return msg
            if proto.error is not None:
                raise proto.error
            if proto.waiter is not None:
                raise RuntimeError("another task is already waiting in recv() on this channel")
            proto.waiter = proto.loop.create_future()
            try:
                if timeout is None:
                    await proto.waiter
                else:
                    await asyncio.wait_for(proto.waiter, timeout)
            finally:
                proto.waiter = None

    def start_heartbeat(self, interval: float) -> None:
        """Send HEARTBEAT every ``interval`` seconds until the channel closes."""
        if self._beat is None:
            self._beat = asyncio.create_task(self._heartbeats(interval))

    async def _heartbeats(self, interval: float) -> None:
        seq = 0
        while not self.closed:
            await asyncio.sleep(interval)
            try:
                await self.send(p.Heartbeat(seq=seq))
            except (ConnectionError, LocalProtocolError):
                return
            seq += 1

    async def send_error(self, code: str, reason: str) -> None:
        """Send ERROR(code, reason) if the connection still allows it (before closing)."""
        if not self.closed and self._proto.conn.state != p.State.CLOSED:
            with contextlib.suppress(ConnectionError):
                await self.send(p.Error(code=code[: p.MAX_NAME], reason=reason[: p.MAX_TEXT]))

    async def close(self, leave: str | None = None) -> None:
        """Optionally say LEAVE(``leave``), then close and wait until the socket is closed."""
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
        if leave is not None and not self.closed and self._proto.conn.state == p.State.OPEN:
            try:
                await self.send(p.Leave(reason=leave))
            except ConnectionError:
                pass
        self._transport.close()
        await self._proto.closed.wait()

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---------------------------------------------------------------------------------------------
# Client


def _token(token: str | bytes | None) -> str | bytes | None:
    return os.environ.get(TOKEN_ENV) if token is None else token


async def _open(host: str, port: int, side: p.Side, options: Options,
                ssl: ssl_module.SSLContext | None, server_hostname: str | None) -> Channel:
    loop = asyncio.get_running_loop()
    conn = p.Connection(side, alloc=options.alloc, limits=options.limits)
    _, proto = await loop.create_connection(
        lambda: _FrameProtocol(conn, options), host, port, ssl=ssl,
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


class Server:
    """A listening minips server: handshakes each connection, then runs ``handler`` on it."""

    def __init__(self, accept: Accept, handler: Handler, token: str | bytes | None,
                 options: Options) -> None:
        self.accept, self.handler, self.token, self.options = accept, handler, token, options
        self.host, self.port = "", 0
        self.channels: set[Channel] = set()
        self.stats = collections.Counter({k: 0 for k in (
            "connections", "accepted", "refused", "protocol_errors", "limit_exceeded",
            "read_timeouts", "handshake_timeouts", "handler_errors")})
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _made(self, proto: _FrameProtocol) -> None:
        self.stats["connections"] += 1
        task = asyncio.create_task(self._serve_one(Channel(proto)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_one(self, ch: Channel) -> None:
        try:
            if await self._admit(ch):
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

    async def _admit(self, ch: Channel) -> bool:
        """Run the handshake; False (and counted) when it was refused or failed."""
        try:
            await asyncio.wait_for(self._handshake(ch), self.options.handshake_timeout)
        except AuthError as e:
            self.stats["refused"] += 1
            log.warning("refused %s: %s", ch.peername, e.reason)
            return False
        except asyncio.TimeoutError:
            self.stats["handshake_timeouts"] += 1
            return False
        self.stats["accepted"] += 1
        return True

    async def _handshake(self, ch: Channel) -> None:
        hs = p.ServerHandshake(_token(self.token))
        hello = await ch.recv()
        assert isinstance(hello, p.Hello)  # the state machine allows nothing else first
        reply = hs.on_hello(hello)
        await ch.send(reply)
        if isinstance(reply, p.Refuse):
            raise AuthError(reply.reason)
        auth = await ch.recv()
        assert isinstance(auth, p.Auth)
        refuse = hs.on_auth(auth)
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
    server = Server(accept, handler, token, options)

    def factory() -> _FrameProtocol:
        proto = _FrameProtocol(p.Connection(p.Side.SERVER, alloc=options.alloc,
                                            limits=options.limits), options)
        proto.on_made, proto.stats = server._made, server.stats
        return proto

    loop = asyncio.get_running_loop()
    server._server = await loop.create_server(factory, host, port, ssl=ssl)
    sockname = server._server.sockets[0].getsockname()
    server.host, server.port = sockname[0], sockname[1]
    return server
