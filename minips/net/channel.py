"""One minips connection under asyncio: ``Channel``, the object a server handler or a client
sends and receives whole messages with, over the socket protocol of frame_protocol.py.

All protocol decisions live in the sans-IO modules (``minips.wire.protocol``); this module only
moves bytes. Receiving is zero-copy: ``asyncio.BufferedProtocol`` hands the socket the decoder's own
buffers, so a large payload lands straight in the array the ``alloc`` callable chose. Sending
hands the frame header and the caller's buffers (16 KiB and up) to the transport without joining
them; with uvloop that is one writev.

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
  a HEARTBEAT waits for the frame in progress); it reads as ``pacer.ReadPacer`` allows (reading
  pauses while the downlink bucket is in debt; past the receive buffer the peer's TCP waits).

Public API: ``Channel``, ``write_batches``, and ``tune_socket(sock, buffer_bytes)``
(re-exported from frame_protocol.py, which holds ``Options``, ``FrameProtocol`` and the
timeout / queue constants).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from minips.errors import LocalProtocolError
from minips.net.frame_protocol import WRITE_BYTES, FrameProtocol, tune_socket
from minips.net.links import Pacing, TokenBucket
from minips.wire import protocol as p

__all__ = ["Channel", "write_batches", "tune_socket"]

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
        self.peer_hello: p.Hello | None = None  # server side: the client's HELLO
        self.welcome_info: dict[str, Any] = {}  # both sides: WELCOME's info map
        self.worker_id = -1  # the id in WELCOME
        self.bytes_sent = 0
        self._up: TokenBucket | None = None  # the uplink bucket of a paced channel
        self._send_lock = asyncio.Lock()  # a paced frame's chunks are never interleaved
        self._beat: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    @property
    def bytes_received(self) -> int:
        return self._proto.bytes_received

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

    def set_alloc(self, alloc: p.Alloc | None) -> None:
        """Receive the next payload buffers into memory ``alloc`` returns (None: fresh arrays)."""
        self._proto.decoder.alloc = alloc or p.default_alloc

    def set_pacing(self, pacing: Pacing | None) -> None:
        """Send and read at the rates of ``pacing``'s buckets from now on (None: at full
        speed); the buckets may be shared by several channels of one link."""
        self._up = None if pacing is None else pacing.up
        self._proto.set_downlink(None if pacing is None else pacing.down)

    async def send(self, msg: p.Message, *, compress: bool = False) -> None:
        """Send ``msg``; returns once the kernel has every byte (the caller may reuse buffers)."""
        if self._up is not None:
            async with self._send_lock:
                return await self._send_paced(msg, compress, self._up)
        proto = self._proto
        if proto.error is not None:
            raise ConnectionResetError(f"connection is closed ({proto.error})")
        frame = proto.conn.send(msg, compress=compress)
        if len(frame) == 1:  # a small frame is one bytes object (frames.encode joins them)
            self._transport.write(frame[0])
            self.bytes_sent += len(frame[0])
        else:
            for batch in write_batches(frame, WRITE_BYTES):
                self._transport.writelines(batch)
            self.bytes_sent += sum(map(len, frame))
        if proto.drained is not None:
            await self._drain()

    async def _send_paced(self, msg: p.Message, compress: bool, bucket: TokenBucket) -> None:
        """``send`` on a paced link: each chunk waits for its tokens, then is written."""
        proto = self._proto
        if proto.error is not None:
            raise ConnectionResetError(f"connection is closed ({proto.error})")
        frame = proto.conn.send(msg, compress=compress)
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

    async def recv(self, timeout: float | None = None) -> p.Message:
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
                await self.send(p.Heartbeat(seq=seq))
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
        if not self.closed and self._proto.conn.state != p.State.CLOSED:
            with contextlib.suppress(ConnectionError):
                await self.send(p.Error(code=code[: p.MAX_NAME], reason=reason[: p.MAX_TEXT]))

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
