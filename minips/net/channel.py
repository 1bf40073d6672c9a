"""One minips connection under asyncio: ``FrameProtocol``, the socket side, and ``Channel``, the
object a server handler or a client sends and receives whole messages with.

All protocol decisions live in the sans-IO modules (``minips.wire``); this module only moves
bytes. The file holds, in order: a connection's settings (``Options``, the timeout, socket and
queue constants, ``tune_socket``); ``FrameProtocol`` (an ``asyncio.BufferedProtocol``), which
feeds the bytes the socket reads to the sans-IO decoder and queues whole messages for
``Channel.recv``; and ``Channel`` with ``write_batches``.

Receiving is zero-copy: the connection decodes with ``receive.FrameReceiver`` (in the place of
the plain ``frames.FrameDecoder`` its ``handshake.Connection`` made), whose own buffers
``asyncio.BufferedProtocol`` hands the socket, so a large payload lands straight in the array
the ``alloc`` callable chose. Sending hands the frame header and the caller's buffers (16 KiB
and up) to the transport without joining them; with uvloop that is one writev.

Invariants:
- ``Channel.send`` returns only once the kernel has taken every byte of the frame (write buffer
  high-water mark 0), so the caller may modify the arrays it sent, and a peer that stops reading
  cannot make our memory grow: the sender waits, and is cut off after ``send_timeout``.
- A peer's protocol error (bad frame, over a limit, out-of-order message, half a frame then
  silence for ``read_timeout``) sends ERROR with the reason and closes this connection; ``recv``
  raises it. The error is counted in the server's ``stats`` when there is one.
- Received messages wait in a queue for ``recv``; reading the socket pauses while
  ``Options.max_queued`` messages or ``max_queued_bytes`` of their buffers wait, and resumes
  below half of both. Memory held for one connection is at most that plus one frame in
  progress. Both are low (one request at a time is all the protocol has), so a peer that
  floods is not read: TCP makes it wait (back-pressure).
- HEARTBEATs are counted as they arrive and never queued: a peer whose request is waiting can
  still prove it is alive.
- ``recv`` has one reader at a time; a message reaches it with no queue hop beyond one future.
- A paced channel (``Channel.set_pacing``, a worker's emulated link: ``links.Pacing``) writes a
  frame in chunks, each after its tokens are in the uplink bucket, one frame at a time (a lock:
  a HEARTBEAT waits for the frame in progress); it reads as ``links.ReadPacer`` allows (reading
  pauses while the downlink bucket is in debt; past the receive buffer the peer's TCP waits).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import operator
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from minips.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from minips.net import guard
from minips.net.links import Pacing, ReadPacer, TokenBucket
from minips.record import trace
from minips.wire import checks, control, fields, frames, handshake, kinds, messages, receive

__all__ = [
    "READ_TIMEOUT_S",
    "SEND_TIMEOUT_S",
    "HANDSHAKE_TIMEOUT_S",
    "SOCKET_BUFFER_BYTES",
    "WRITE_BYTES",
    "MAX_QUEUED",
    "MAX_QUEUED_BYTES",
    "Options",
    "FrameProtocol",
    "tune_socket",
    "Channel",
    "write_batches",
]


# -- the socket side: settings, FrameProtocol feeding the decoder ----------------------------------

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
    limits: checks.Limits = field(default_factory=checks.Limits)
    alloc: frames.Alloc | None = None  # where received payload buffers go; None: fresh numpy arrays
    max_queued_bytes: int = MAX_QUEUED_BYTES  # bytes of received buffers before reading pauses
    max_queued: int = MAX_QUEUED  # received messages (not HEARTBEATs) before reading pauses
    # a server's pre-auth limits
    guard: guard.GuardLimits = field(default_factory=guard.GuardLimits)


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

    def __init__(self, conn: handshake.Connection, options: Options) -> None:
        self.conn, self.options = conn, options
        # the zero-copy receiver in the place of the plain decoder the Connection made
        self.decoder = conn.decoder = receive.FrameReceiver.taking_over(conn.decoder)
        # the decoder's own method, not a wrapper: one Python call less per read
        self.get_buffer = self.decoder.get_buffer  # type: ignore[method-assign]
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.queue: collections.deque[messages.Message] = collections.deque()
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
                if trace.TRACER is not None:  # --trace: all it costs when off is this check
                    trace.TRACER.received(self, msg)
                if msg.KIND == messages.Kind.HEARTBEAT:  # its bytes renewed last_recv; that is all
                    self.heartbeats += 1
                    continue
                self.queue.append(msg)
                if msg.KIND in kinds.WITH_BUFFERS:
                    buffers = msg.payload.buffers  # type: ignore[attr-defined]
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

    def pop(self) -> messages.Message:
        """The oldest queued message; resumes reading once the queue is below half its bounds."""
        msg = self.queue.popleft()
        if msg.KIND in kinds.WITH_BUFFERS:
            self.queued_bytes -= sum(map(_nbytes, msg.payload.buffers))  # type: ignore[attr-defined]
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
            if self.transport is not None and self.conn.state != handshake.State.CLOSED:
                error = control.Error(code=reason, reason=str(err)[: fields.MAX_TEXT])
                frame = self.conn.send(error)
                if trace.TRACER is not None:
                    trace.TRACER.sent(self, error, frame)
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


# -- the channel: whole messages out and in --------------------------------------------------------

def _time_out(waiter: asyncio.Future[None]) -> None:
    """recv()'s deadline: its waiter raises TimeoutError (unless a message came first)."""
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


def write_batches(frame: list[Any], size: int) -> Iterator[list[Any]]:
    """The frame's byte buffers in order, cut and grouped into batches of about ``size`` bytes
    (a batch ends at the first piece that reaches ``size``): one writelines each, no copies."""
    batch: list[Any] = []
    filled = 0
    for part in frame:
        for start in range(0, len(part), size):
            piece = part[start:start + size] if len(part) > size else part
            batch.append(piece)
            filled += len(piece)
            if filled >= size:
                yield batch
                batch, filled = [], 0
    if batch:
        yield batch


class Channel:
    """One authenticated connection: send and receive whole messages."""

    def __init__(self, proto: FrameProtocol) -> None:
        self._proto = proto
        assert proto.transport is not None
        self._transport = proto.transport
        self.peer_hello: control.Hello | None = None  # server side: the client's HELLO
        self.welcome_info: dict[str, Any] = {}  # both sides: WELCOME's info map
        self.worker_id = -1  # the id in WELCOME
        self.bytes_sent = 0
        self.error_sent = ""  # the code of the ERROR this side sent with send_error ("": none)
        self._up: TokenBucket | None = None  # the uplink bucket of a paced channel
        self._send_lock = asyncio.Lock()  # a paced frame's chunks are never interleaved
        self._beat: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    @property
    def bytes_received(self) -> int:
        return self._proto.bytes_received

    def set_limits(self, limits: checks.Limits) -> None:
        """Check the peer's next frames against ``limits`` (``Connection.set_limits``)."""
        self._proto.conn.set_limits(limits)

    @property
    def last_recv(self) -> float:
        """``loop.time()`` when bytes last arrived (for leases)."""
        return self._proto.last_recv

    @property
    def heartbeats_received(self) -> int:
        return self._proto.heartbeats

    @property
    def closed(self) -> bool:
        return self._proto.closed.is_set()

    async def wait_closed(self) -> None:
        """Until the connection has closed (for whatever reason)."""
        await self._proto.closed.wait()

    @property
    def error(self) -> Exception | None:
        """Why the connection ended, once it has (None while it is open)."""
        return self._proto.error

    @property
    def peername(self) -> Any:
        """The peer's socket address (a (host, port, ...) tuple on TCP), as the transport
        reports it."""
        return self._transport.get_extra_info("peername")

    def set_alloc(self, alloc: frames.Alloc | None) -> None:
        """Receive the next payload buffers into memory ``alloc`` returns (None: fresh arrays)."""
        self._proto.decoder.alloc = alloc or frames.default_alloc

    def set_pacing(self, pacing: Pacing | None) -> None:
        """Send and read at the rates of ``pacing``'s buckets from now on (None: at full
        speed); the buckets may be shared by several channels of one link."""
        self._up = None if pacing is None else pacing.up
        self._proto.set_downlink(None if pacing is None else pacing.down)

    async def send(self, msg: messages.Message, *, compress: bool = False) -> None:
        """Send ``msg``; returns once the kernel has every byte (the caller may reuse buffers)."""
        if self._up is not None:
            async with self._send_lock:
                return await self._send_paced(msg, compress, self._up)
        proto = self._proto
        if proto.error is not None or proto.conn.closed:
            raise ConnectionResetError(f"connection is closed ({proto.error or 'ERROR sent'})")
        frame = proto.conn.send(msg, compress=compress)
        if trace.TRACER is not None:  # --trace: all it costs when off is this check
            trace.TRACER.sent(proto, msg, frame)
        if len(frame) == 1:  # a small frame is one bytes object (frames.encode joins them)
            self._transport.write(frame[0])
            self.bytes_sent += len(frame[0])
        else:
            for batch in write_batches(frame, WRITE_BYTES):
                self._transport.writelines(batch)
            self.bytes_sent += sum(map(len, frame))
        if proto.drained is not None:
            await self._drain()

    async def _send_paced(self, msg: messages.Message, compress: bool, bucket: TokenBucket) -> None:
        """``send`` on a paced link: each chunk waits for its tokens, then is written."""
        proto = self._proto
        if proto.error is not None or proto.conn.closed:
            raise ConnectionResetError(f"connection is closed ({proto.error or 'ERROR sent'})")
        frame = proto.conn.send(msg, compress=compress)
        if trace.TRACER is not None:  # --trace: all it costs when off is this check
            trace.TRACER.sent(proto, msg, frame)
        for batch in write_batches(frame, bucket.chunk()):
            size = sum(map(len, batch))
            wait = bucket.take(size, proto.loop.time())
            if wait > 0:
                await asyncio.sleep(wait)
            if proto.error is not None:
                raise ConnectionResetError(f"connection lost while sending ({proto.error})")
            self._transport.writelines(batch)
            self.bytes_sent += size
            if proto.drained is not None:
                await self._drain()

    async def _drain(self) -> None:
        """Until the kernel took what was written (``send_timeout`` at most)."""
        proto = self._proto
        assert proto.drained is not None
        try:
            await asyncio.wait_for(asyncio.shield(proto.drained), proto.options.send_timeout)
        except asyncio.TimeoutError:
            self._transport.abort()
            raise ConnectionError("send timed out: the peer stopped reading") from None
        if proto.error is not None:
            raise ConnectionResetError(f"connection lost while sending ({proto.error})")

    async def recv(self, timeout: float | None = None) -> messages.Message:
        """The next message (HEARTBEATs are absorbed). Raises ``RemoteProtocolError`` when the
        peer broke the protocol, ``ConnectionError`` when the connection closed, and
        ``asyncio.TimeoutError`` when no message came within ``timeout`` seconds."""
        proto = self._proto
        deadline = None if timeout is None else proto.loop.time() + timeout
        while True:
            if proto.queue and not proto.held:
                return proto.pop()
            if proto.error is not None:
                raise proto.error
            if proto.waiter is not None:
                raise RuntimeError("another task is already waiting in recv() on this channel")
            proto.waiter = waiter = proto.loop.create_future()  # the protocol wakes it
            # a plain timer for the deadline, not wait_for (which wraps the wait in a task)
            timer = None if deadline is None else proto.loop.call_at(deadline, _time_out, waiter)
            try:
                await waiter
            finally:
                proto.waiter = None
                if timer is not None:
                    timer.cancel()

    def start_heartbeat(self, interval: float) -> None:
        """Send HEARTBEAT every ``interval`` seconds until the channel closes."""
        if self._beat is None:
            self._beat = asyncio.create_task(self._heartbeats(interval))

    async def _heartbeats(self, interval: float) -> None:
        seq = 0
        while not self.closed:
            await asyncio.sleep(interval)
            try:
                await self.send(control.Heartbeat(seq=seq))
            except (ConnectionError, LocalProtocolError):
                return
            seq += 1

    def start_silence_limit(self, seconds: float) -> None:
        """Abort the connection once it carried no bytes for ``seconds``: a peer that sends
        HEARTBEAT more often is never that silent unless it is gone (a stalled process, or a
        machine that vanished without closing the connection)."""
        if self._watch is None:
            self._watch = asyncio.create_task(self._limit_silence(seconds))

    async def _limit_silence(self, seconds: float) -> None:
        proto = self._proto
        due = proto.loop.time()  # when this check should run
        while not self.closed:
            now = proto.loop.time()
            silent = now - proto.last_recv
            wait = seconds - silent + 0.01
            if silent > seconds:
                if now - due < min(1.0, seconds / 4):
                    self.abort(f"the peer sent nothing for {silent:.1f} s")
                    return
                # our own loop was held up: what the peer sent meanwhile may still be unread
                wait = 0.05
            due = now + wait
            await asyncio.sleep(wait)

    async def send_error(self, code: str, reason: str) -> None:
        """Send ERROR(code, reason) if the connection still allows it (before closing)."""
        if not self.closed and self._proto.conn.state != handshake.State.CLOSED:
            self.error_sent = code
            with contextlib.suppress(ConnectionError):
                await self.send(control.Error(code=code[: fields.MAX_NAME],
                                               reason=reason[: fields.MAX_TEXT]))

    def abort(self, reason: str) -> None:
        """Drop the connection now, without LEAVE; a waiting ``recv`` raises
        ``ConnectionAbortedError(reason)``."""
        if self._proto.error is None:
            self._proto.error = ConnectionAbortedError(reason)
        self._transport.abort()

    def close_nowait(self) -> None:
        """Start closing the connection, without LEAVE and without waiting (a server that turns
        a peer away, or stops); ``wait_closed`` waits for the end."""
        self._transport.close()

    async def close(self, leave: str | None = None) -> None:
        """Optionally say LEAVE(``leave``), then close and wait until the socket is closed."""
        for task in (self._beat, self._watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if leave is not None and not self.closed and self._proto.conn.state == handshake.State.OPEN:
            try:
                await self.send(control.Leave(reason=leave))
            except ConnectionError:
                pass
        self._transport.close()
        await self._proto.closed.wait()

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
