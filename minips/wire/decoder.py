"""minips frame decoder, sans-IO: bytes in, messages out.

``FrameDecoder`` takes bytes with ``feed(data)`` or, zero-copy, through ``get_buffer()`` /
``buffer_updated(n)`` (the ``asyncio.BufferedProtocol`` pair) and returns the messages they
complete. It has no networking code, no clocks and no connection state (``handshake.py``).

Invariants:
- Any bytes give messages or raise ``RemoteProtocolError`` (``LimitExceeded`` for a limit), never
  another exception; after one the decoder stays failed (``error``). Every length is checked
  against ``Limits`` (frames.py) before anything of that size is allocated.
- A frame of up to 64 KiB is decoded in one step once it is whole in the scratch buffer (the
  common case: ACKs, PULLs, sparse PUSHes); ``get_buffer`` always keeps room for the rest of it
  (a smaller scratch buffer, as a server uses before the handshake, grows to the frame's size).
- ``widen(limits)`` raises the limits and the scratch buffer (a server, once the peer has
  authenticated); ``release()`` frees a frame in progress and the scratch (connection ended).
- A bigger frame is read stage by stage (prefix, head, buffers: ``partial_frame.py``) through
  the same checks; its payload buffers of 64 KiB or more are received straight into the memory
  ``alloc`` returns, 64 KiB per read.
- Decoded buffers are flat writable ``memoryview``s: into one private copy of a small body, or
  into ``alloc``'s memory.

Public API: ``Alloc``, ``default_alloc``, ``FrameDecoder``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.wire.frames import (
    CODEC_LZ4,
    DEFAULT_LIMITS,
    DIRECT_MIN_BYTES,
    DIRECT_READ_BYTES,
    KINDS,
    MAGIC,
    PREFIX,
    SCRATCH_BYTES,
    TABLE_ENTRY,
    TABLES,
    Limits,
    check_prefix,
    check_table,
    decompress,
    unpack_meta,
)
from minips.wire.messages import PROTOCOL_VERSION, Kind, Message, from_wire
from minips.wire.partial_frame import PartialFrame

__all__ = ["Alloc", "default_alloc", "FrameDecoder"]

Alloc = Callable[[Kind, int, int], Any]  # (kind, buffer index, nbytes) -> writable buffer


_unpack_prefix = PREFIX.unpack_from


def default_alloc(kind: Kind, index: int, nbytes: int) -> memoryview:
    """A fresh uninitialised uint8 array per buffer (np.empty does not zero it)."""
    return np.empty(nbytes, dtype=np.uint8).data


class FrameDecoder:
    """Bytes in, messages out. Feed it with ``feed(data)`` or, zero-copy, with ``get_buffer()``
    then ``buffer_updated(n)`` (the ``asyncio.BufferedProtocol`` pair).

    Frames up to 64 KiB are decoded once they are whole in the scratch buffer (``get_buffer``
    keeps room for them). Larger ones are read stage by stage, and their payload buffers of
    64 KiB or more are read by the caller straight into the memory ``alloc`` returned. After a
    ``RemoteProtocolError`` the decoder stays failed (``error`` is set).
    """

    def __init__(self, *, alloc: Alloc | None = None, limits: Limits = DEFAULT_LIMITS,
                 scratch: int = SCRATCH_BYTES) -> None:
        self.alloc: Alloc = alloc or default_alloc
        self.limits = limits
        self._buf = bytearray(scratch)  # grows to a frame that needs more (within limits)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0  # unread bytes are _buf[_lo:_hi]
        self._direct = False  # the last get_buffer() handed out the destination itself
        self._frame: PartialFrame | None = None  # a frame larger than 64 KiB, while it arrives
        self.error: RemoteProtocolError | None = None

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has arrived but not all of it."""
        return self._frame is not None or self._hi > self._lo

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Decode what ``data`` completes; keep the rest for the next call."""
        if self.error is not None:
            raise self.error
        out: list[Message] = []
        data = memoryview(data).cast("B")
        try:
            while data.nbytes:
                room = self.get_buffer(data.nbytes)
                n = min(len(room), data.nbytes)
                room[:n] = data[:n]
                data = data[n:]
                out += self.buffer_updated(n)
        except RemoteProtocolError:
            if not out:
                raise
        return out

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Writable memory for the next bytes from the socket."""
        if self._lo == self._hi and self._frame is None and self.error is None:
            self._lo = self._hi = 0  # nothing pending (the common case): all of scratch is free
            self._direct = False
            return self._view
        if self.error is not None:
            raise self.error
        f = self._frame
        if f is not None and f.dest is not None and self._lo == self._hi:
            if f.dest.nbytes - f.pos >= DIRECT_MIN_BYTES:
                self._direct = True
                return f.dest[f.pos:f.pos + DIRECT_READ_BYTES]
        self._direct = False
        if self._lo == self._hi:
            self._lo = self._hi = 0
        need = f.head_len if f is not None and f.msg is None else PREFIX.size
        if len(self._buf) - self._hi < max(DIRECT_MIN_BYTES, need):
            self._compact(need)
        return self._view[self._hi:]

    def widen(self, limits: Limits, scratch: int = SCRATCH_BYTES) -> None:
        """Accept frames up to ``limits`` from now on, with ``scratch`` bytes of receive buffer
        (a server widens a connection's small handshake limits once the peer authenticated)."""
        self.limits = limits
        if len(self._buf) < scratch:
            self._compact(scratch)

    def release(self) -> None:
        """Drop a frame in progress and the receive buffer (the connection ended): their memory
        goes back now, not when a garbage collection breaks the cycles a closed connection
        leaves (an exception's traceback refers to the frames that refer to it)."""
        self._frame = None
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0

    def _compact(self, need: int) -> None:
        """Move unread bytes to the front; grow (to a checked head size) if they still don't fit."""
        unread = self._hi - self._lo
        if need > len(self._buf):
            self._buf = bytearray(need)
            self._buf[:unread] = self._view[self._lo:self._hi]
            self._view = memoryview(self._buf)
        else:
            self._view[:unread] = self._view[self._lo:self._hi]
        self._lo, self._hi = 0, unread

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """``nbytes`` were written into the last ``get_buffer()``; return completed messages.

        Messages completed before an error are returned and the error is raised on the next call.
        """
        if self.error is not None:
            raise self.error
        if self._direct and self._frame is not None:
            self._frame.pos += nbytes
        else:
            self._hi += nbytes
        out: list[Message] = []
        try:
            while self._frame is not None or self._hi - self._lo >= PREFIX.size:
                if not self._next(out):
                    break
        except RemoteProtocolError as e:
            self.error = e
            if not out:
                raise
        return out

    def _next(self, out: list[Message]) -> bool:
        """Decode a whole frame, or advance a big one by a stage; False when bytes are missing."""
        if self._frame is not None:
            return self._step(out)
        buf, lo, limits = self._buf, self._lo, self.limits
        prefix = _unpack_prefix(buf, lo)
        magic, version, kind, nbuf, flags, meta_len, body_len = prefix
        at = lo + PREFIX.size + TABLE_ENTRY.size * nbuf  # where the map starts
        end = at + meta_len + body_len
        # the common case in one test (check_prefix's own): a valid prefix, the frame all here
        if (end > self._hi or magic != MAGIC or version != PROTOCOL_VERSION or flags
                or kind not in KINDS or nbuf > limits.max_buffers
                or meta_len > limits.max_meta_bytes or end - lo > limits.max_frame_bytes):
            return self._next_checked(prefix, out)
        table: tuple[int, ...] = ()
        if nbuf or body_len:
            table = TABLES[nbuf].unpack_from(buf, lo + PREFIX.size)
            check_table(table, body_len, limits)
        msg = from_wire(kind, version, unpack_meta(buf[at:at + meta_len], limits), nbuf)
        if nbuf:
            msg.__dict__["buffers"] = self._copy_body(msg.KIND, table, at + meta_len, body_len)
        self._lo = end
        out.append(msg)
        return True

    def _next_checked(self, prefix: tuple[Any, ...], out: list[Message]) -> bool:
        """``_next`` for a frame not yet whole, or a prefix that fails its one test."""
        head_len = check_prefix(prefix, self.limits)  # raises what is wrong, if anything
        _, version, kind, nbuf, _, _, body_len = prefix
        at = self._lo + PREFIX.size
        end = at + head_len + body_len
        if end > self._hi:  # not all here yet
            if end - self._lo <= DIRECT_MIN_BYTES:
                if end - self._lo > len(self._buf):  # a small scratch (handshake): grow it
                    self._compact(end - self._lo)
                return False  # get_buffer() keeps room for the rest of a frame this small
            self._frame = PartialFrame(prefix, head_len)
            self._lo = at
            return self._step(out)
        # a HELLO, REFUSE or ERROR of another version (check_prefix let it through)
        table, msg = self._head(KINDS[kind], version, nbuf, body_len,
                                self._view[at:at + head_len])
        if nbuf:
            msg.__dict__["buffers"] = self._copy_body(msg.KIND, table, at + head_len, body_len)
        self._lo = end
        out.append(msg)
        return True

    def _copy_body(self, kind: Kind, table: tuple[int, ...], at: int,
                   body_len: int) -> tuple[memoryview, ...]:
        """Buffers of a body that is all in scratch: one copy, or one per buffer via alloc."""
        if self.alloc is default_alloc and not any(table[0::3]):  # all raw: views into one copy
            body = memoryview(self._buf[at:at + body_len])  # a bytearray slice is a copy
            views, start = [], 0
            for wire in table[1::3]:
                views.append(body[start:start + wire])
                start += wire
            return tuple(views)
        bufs = []
        for i in range(len(table) // 3):
            codec, wire, raw = table[3 * i:3 * i + 3]
            src = self._view[at:at + wire]
            dest = self._allocate(kind, i, raw)
            dest[:] = decompress(src, raw) if codec == CODEC_LZ4 else src
            bufs.append(dest)
            at += wire
        return tuple(bufs)

    def _step(self, out: list[Message]) -> bool:
        """Advance a big frame by one stage if the bytes allow; False when more are needed."""
        f = self._frame
        assert f is not None
        if f.msg is None:
            if self._hi - self._lo < f.head_len:
                return False
            f.table, f.msg = self._head(f.kind, f.version, f.nbuf, f.body_len,
                                        self._view[self._lo:self._lo + f.head_len])
            self._lo += f.head_len
        if f.nbuf:
            self._lo = f.fill(self._view, self._lo, self._hi, self._allocate)
            if len(f.bufs) < f.nbuf:
                return False
        assert f.msg is not None
        if f.bufs:  # fields were checked at head time; the views are flat "B" already
            f.msg.__dict__["buffers"] = tuple(f.bufs)
        out.append(f.msg)
        self._frame = None
        return True

    def _head(self, kind: Kind, version: int, nbuf: int, body_len: int,
              raw: memoryview) -> tuple[tuple[int, ...], Message]:
        """Check a frame's table and map (``raw``: both, head_len bytes); return the flat table
        and the message, its buffers still empty."""
        table_len = TABLE_ENTRY.size * nbuf
        table: tuple[int, ...] = ()
        if nbuf or body_len:
            table = TABLES[nbuf].unpack(raw[:table_len])
            check_table(table, body_len, self.limits)
        meta = unpack_meta(raw[table_len:], self.limits)
        return table, from_wire(kind, version, meta, nbuf)

    def _allocate(self, kind: Kind, index: int, nbytes: int) -> memoryview:
        view = memoryview(self.alloc(kind, index, nbytes)).cast("B")
        if view.readonly or view.nbytes < nbytes:
            raise LocalProtocolError("alloc returned a read-only or short buffer", expected=nbytes,
                                     got=view.nbytes)
        return view[:nbytes]
