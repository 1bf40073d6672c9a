"""The socket side of one minips connection: ``FrameProtocol`` (an ``asyncio.BufferedProtocol``)
feeds the bytes the socket reads to the sans-IO decoder and queues whole messages for
``channel.Channel.recv``; ``Options`` holds a connection's settings.

Receiving is zero-copy: the socket reads straight into the decoder's own buffers, so a large
payload lands in the array the ``alloc`` callable chose. The invariants (queue bounds and
back-pressure, read timeout in the middle of a frame, HEARTBEATs counted and never queued, a
paced downlink) are listed in channel.py's docstring.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import operator
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from minips.errors import LimitExceeded, RemoteProtocolError
from minips.net import guard
from minips.net.links import TokenBucket
from minips.net.pacer import ReadPacer
from minips.wire import protocol as p

__all__ = [
    "READ_TIMEOUT_S", "SEND_TIMEOUT_S", "HANDSHAKE_TIMEOUT_S", "SOCKET_BUFFER_BYTES", "WRITE_BYTES",
    "MAX_QUEUED", "MAX_QUEUED_BYTES", "Options", "FrameProtocol", "tune_socket",
]

log = logging.getLogger("minips.net.transport")

READ_TIMEOUT_S = 30.0  # seconds a peer may stall in the middle of a frame
SEND_TIMEOUT_S = 120.0  # seconds a send may wait for a peer that does not read
HANDSHAKE_TIMEOUT_S = 10.0  # seconds from accept to WELCOME
SOCKET_BUFFER_BYTES = 4 << 20  # SO_SNDBUF / SO_RCVBUF: big frames need fewer wakeups
# a big frame goes out in writes of about this much: the kernel takes the socket lock per call, and
# between calls it handles the peer's ACKs; one write of all 47 MB ran 1.3-1.5x slower on loopback
WRITE_BYTES = 1 << 20
# A minips peer has one request in flight (PULL or PUSH, maybe followed by LEAVE): a peer that
# sends far ahead is flooding, and is simply not read until its messages are handled.
MAX_QUEUED = 8  # received messages waiting for recv() before we stop reading the socket
MAX_QUEUED_BYTES = 16 << 20  # bytes of received buffers waiting for recv(), same purpose


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
    max_queued_bytes: int = MAX_QUEUED_BYTES  # bytes of received buffers before reading pauses
    max_queued: int = MAX_QUEUED  # received messages (not HEARTBEATs) before reading pauses
    guard: guard.Limits = field(default_factory=guard.Limits)  # a server's pre-auth limits


_STAT_OF_REASON = {"protocol_error": "protocol_errors", "limit_exceeded": "limit_exceeded",
                   "read_timeout": "read_timeouts"}  # close reason -> Server.stats key


_nbytes = operator.attrgetter("nbytes")  # sum(map(_nbytes, buffers)): bytes a message holds


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """The options of every minips socket: kernel buffers of ``buffer_bytes`` (0: the kernel's
    default) and, on TCP, no Nagle delay."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if buffer_bytes else ():
        sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):  # small frames leave at once
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FrameProtocol(asyncio.BufferedProtocol):
    """Feeds socket bytes to the decoder, queues messages, implements drain and read timeout."""

    def __init__(self, conn: p.Connection, options: Options) -> None:
        self.conn, self.options = conn, options
        self.decoder = conn.decoder
        # the decoder's own method, not a wrapper: one Python call less per read
        self.get_buffer = self.decoder.get_buffer  # type: ignore[method-assign]
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.queue: collections.deque[p.Message] = collections.deque()
        self.queued_bytes = 0  # bytes of the buffers of the queued messages
        self.paused = False  # reading paused because the queue is full
        self.reading = True  # what the transport was last told (pause_reading / resume_reading)
        self.pacer: ReadPacer | None = None  # the downlink of a paced channel
        self.waiter: asyncio.Future[None] | None = None  # a recv() waiting for a message
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused
        self.closed = asyncio.Event()
        self.error: Exception | None = None  # why the connection ended, if not cleanly
        self.close_reason = ""  # "", "protocol_error", "limit_exceeded", "read_timeout"
        self.bytes_received = 0
        self.heartbeats = 0  # HEARTBEATs received (counted here, never queued)
        self.last_recv = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self.on_made: Callable[[FrameProtocol], None] | None = None
        self.stats: collections.Counter[str] | None = None  # the server's counters, if any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock, self.options.socket_buffer)
        # Pause until everything is out of our hands: on TCP, until the kernel took every byte.
        # TLS transports pause when their buffer is >= the high mark, so 0 would pause after every
        # write, with nothing left to flush and no resume until the peer sends something: a
        # server's first message after WELCOME would wait for the client (which waits for it).
        tls = transport.get_extra_info("ssl_object") is not None
        self.transport.set_write_buffer_limits(high=1 if tls else 0, low=0)
        if self.on_made is not None:
            self.on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:  # replaced per instance in __init__
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.last_recv = self.loop.time()
        if self.pacer is not None:
            self.pacer.charge(nbytes)
        try:
            for msg in self.decoder.buffer_updated(nbytes):
                self.conn.received_one(msg)  # one by one: messages before a bad one still count
                if msg.KIND == p.Kind.HEARTBEAT:  # its bytes renewed last_recv; that is all
                    self.heartbeats += 1
                    continue
                self.queue.append(msg)
                if msg.KIND in p.WITH_BUFFERS:
                    buffers = msg.buffers  # type: ignore[attr-defined]
                    self.queued_bytes += sum(map(_nbytes, buffers))
            if self.decoder.error is not None:
                raise self.decoder.error
        except RemoteProtocolError as e:
            self.fail(e, "limit_exceeded" if isinstance(e, LimitExceeded) else "protocol_error")
        if self.queue:
            if not self.held:  # a paced message is ready once its bytes' time has passed
                self._wake()
            if (len(self.queue) >= self.options.max_queued
                    or self.queued_bytes >= self.options.max_queued_bytes):
                self._pause()
        if self._timer is None and self.decoder.in_frame:
            self._arm_timer(self.options.read_timeout)

    def pop(self) -> p.Message:
        """The oldest queued message; resumes reading once the queue is below half its bounds."""
        msg = self.queue.popleft()
        if msg.KIND in p.WITH_BUFFERS:
            self.queued_bytes -= sum(map(_nbytes, msg.buffers))  # type: ignore[attr-defined]
        if (self.paused and len(self.queue) <= self.options.max_queued // 2
                and self.queued_bytes <= self.options.max_queued_bytes // 2):
            self.paused = False
            self._set_reading()
        return msg

    def _pause(self) -> None:
        if not self.paused:
            self.paused = True
            self._set_reading()

    def _set_reading(self) -> None:
        """Tell the transport to read or not: read unless the queue is full or the downlink
        bucket is in debt (two reasons, one switch)."""
        wanted = not (self.paused or self.held)
        if wanted == self.reading or self.transport is None or self.transport.is_closing():
            return
        self.reading = wanted
        if wanted:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    @property
    def held(self) -> bool:
        """Whether the downlink pacer holds reading (and queued messages) back."""
        return self.pacer is not None and self.pacer.hold

    def set_downlink(self, bucket: TokenBucket | None) -> None:
        """Pace reading to ``bucket`` (None: read at full speed)."""
        self.pacer = None if bucket is None else ReadPacer(bucket, self.loop, self._paced)
        get = self.decoder.get_buffer
        chunked = get if self.pacer is None else self.pacer.chunked(get)
        self.get_buffer = chunked  # type: ignore[method-assign,assignment]

    def _paced(self) -> None:
        """The pacer started or stopped holding: read or not; hand on what is queued."""
        self._set_reading()
        if self.queue and not self.held:
            self._wake()

    def _arm_timer(self, delay: float) -> None:
        self._timer = self.loop.call_later(delay, self._check_stall)

    def _check_stall(self) -> None:
        """Cut off a peer that sent part of a frame and then nothing for read_timeout."""
        self._timer = None
        if not self.decoder.in_frame or self.transport is None:
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
        self.decoder.release()  # a half-received frame is freed at once
        if self.pacer is not None:
            self.pacer.stop()  # what is queued may be read at once
        self.closed.set()
        self._wake()
        self.resume_writing()

    def _wake(self) -> None:
        """Let a recv() waiting for a message (or for the close) run."""
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
