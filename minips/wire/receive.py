"""The zero-copy receive engine, sans-IO: ``frames.FrameDecoder``'s twin for an asyncio shell.

``FrameReceiver`` decodes what ``frames.FrameDecoder`` decodes, with the same checks in the
same order and the same errors (tests/test_decoders.py holds the two equal), but never copies a
payload it need not: it takes bytes through ``get_buffer()`` / ``buffer_updated(n)``, the
``asyncio.BufferedProtocol`` pair, so the socket writes straight into its memory. No sockets,
no clocks: ``net/channel.py`` drives it. The file holds, in order: the engine's constants;
``decompress_into``, lz4 output inflated in place through liblz4's own ``LZ4_decompress_safe``
(found with ctypes in the lz4 package's extension); ``PartialFrame``, a frame larger than
64 KiB while it arrives (its prefix, table and message so far, and the buffers its body is
copied into); and ``FrameReceiver``.

Invariants:
- A frame of up to 64 KiB is decoded in one step once it is whole in the scratch buffer (the
  common case: ACKs, PULLs, sparse PUSHes); ``get_buffer`` always keeps room for the rest of it
  (a smaller scratch buffer, as a server uses before the handshake, grows to the frame's size).
- A bigger frame is read stage by stage (prefix, head, buffers: ``PartialFrame``) through the
  same checks, its head checked as soon as it is in; its payload buffers of 64 KiB or more are
  received straight into the memory ``alloc`` returns, 64 KiB per read. A raw buffer lands in
  that memory (no copy after it), an lz4 one in a temporary that is inflated into its
  destination once whole: one copy of the output, never two.
- lz4 output is charged to the ``InflateBudget`` before it is inflated; into fresh arrays (the
  default ``alloc``) the charge is held until the array is freed (``weakref.finalize``), so the
  budget bounds what compressed input keeps alive in the process, over every connection; into
  the caller's memory only while inflating.
- Decoded buffers are flat writable ``memoryview``s: into one private copy of a small all-raw
  body, or into ``alloc``'s memory.
- ``widen(limits)`` raises the limits and the scratch buffer (a server, once the peer has
  authenticated); ``release()`` frees a frame in progress and the scratch (connection ended).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import Any

import lz4.block._block as _lz4_ext
import numpy as np

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.wire.checks import (
    CODEC_LZ4,
    DEFAULT_LIMITS,
    KINDS,
    MAGIC,
    PREFIX,
    TABLE_ENTRY,
    InflateBudget,
    Limits,
    check_prefix,
    check_table,
    decompress,
    unpack_meta,
)
from minips.wire.frames import (
    HEAD_FIRST_BYTES,
    SCRATCH_BYTES,
    TABLES,
    Alloc,
    FrameDecoder,
    default_alloc,
    writable_view,
)
from minips.wire.kinds import from_wire, with_buffers
from minips.wire.messages import PROTOCOL_VERSION, Kind, Message

__all__ = [
    "DIRECT_MIN_BYTES",
    "DIRECT_READ_BYTES",
    "decompress_into",
    "Allocate",
    "Inflate",
    "PartialFrame",
    "FrameReceiver",
]


DIRECT_MIN_BYTES = 64 << 10  # a payload this large is received straight into its destination
# ... in reads of at most this much: small reads follow the sender closely, so the bytes are still
# in the cache when copied out of the kernel (1.3-1.5x the throughput of one huge read on loopback)
DIRECT_READ_BYTES = 64 << 10
FOREIGN_BYTES = 64  # of a peer that is not minips, kept in the bad-magic error: its first line


# -- lz4 output inflated in place ------------------------------------------------------------------

def _lz4_safe() -> Any:
    """liblz4's ``LZ4_decompress_safe`` from the lz4 package's own extension (it exports the
    library's symbols), or None where it cannot be found (then ``decompress_into`` copies)."""
    try:
        fn = ctypes.CDLL(_lz4_ext.__file__).LZ4_decompress_safe
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_LZ4_SAFE = _lz4_safe()


def decompress_into(wire: memoryview, dest: memoryview) -> None:
    """Decompress one lz4 block into ``dest``, which it must fill exactly: no temporary of the
    output's size (``lz4.block.decompress`` would make one, doubling what a buffer costs)."""
    if _LZ4_SAFE is None:
        dest[:] = decompress(wire, dest.nbytes)
        return
    src = np.frombuffer(wire, dtype=np.uint8)
    out = np.frombuffer(dest, dtype=np.uint8)
    got = _LZ4_SAFE(src.ctypes.data, out.ctypes.data, src.size, out.size)
    if got < 0:
        raise RemoteProtocolError("bad lz4 buffer: corrupt block or output past raw_len")
    if got != out.size:
        raise RemoteProtocolError("lz4 buffer has the wrong size", expected=out.size, got=got)


# -- a frame larger than 64 KiB while it arrives ---------------------------------------------------

Allocate = Callable[[Kind, int, int], memoryview]  # (kind, buffer index, nbytes) -> flat view
Inflate = Callable[[Kind, int, memoryview, int], memoryview]  # (kind, index, lz4 block, raw_len)


class PartialFrame:
    """A frame that arrives in pieces: what is known so far and where its body goes."""

    __slots__ = ("version", "kind", "nbuf", "head_len", "body_len", "table", "msg", "bufs",
                 "dest", "pos")

    def __init__(self, prefix: tuple[Any, ...], head_len: int) -> None:
        _, self.version, kind, self.nbuf, _, _, self.body_len = prefix
        self.kind: Kind = KINDS[kind]
        self.head_len = head_len
        self.table: tuple[int, ...] = ()  # flat (codec, wire_len, raw_len) per buffer
        self.msg: Message | None = None  # built (buffers empty) once table + meta are read
        self.bufs: list[memoryview] = []
        self.dest: memoryview | None = None  # where the current buffer's bytes go
        self.pos = 0  # bytes of dest already filled

    def fill(self, view: memoryview, lo: int, hi: int, allocate: Allocate,
             inflate: Inflate) -> int:
        """Copy ``view[lo:hi]`` into the buffers, as far as they take it; returns the new ``lo``.
        The body is whole once ``len(bufs) == nbuf``."""
        while len(self.bufs) < self.nbuf:
            if self.dest is None:
                self._open(allocate)
            assert self.dest is not None
            take = min(self.dest.nbytes - self.pos, hi - lo)
            if take:
                self.dest[self.pos:self.pos + take] = view[lo:lo + take]
                self.pos += take
                lo += take
            if self.pos < self.dest.nbytes:
                return lo
            self._close(inflate)
        return lo

    def _open(self, allocate: Allocate) -> None:
        i = len(self.bufs)
        codec, wire, raw = self.table[3 * i:3 * i + 3]
        self.pos = 0
        if codec == CODEC_LZ4:  # compressed bytes land in a temporary, decompressed on close
            self.dest = np.empty(wire, dtype=np.uint8).data
        else:
            self.dest = allocate(self.kind, i, raw)

    def _close(self, inflate: Inflate) -> None:
        i = len(self.bufs)
        codec, raw = self.table[3 * i], self.table[3 * i + 2]
        assert self.dest is not None
        buf = self.dest
        if codec == CODEC_LZ4:
            buf = inflate(self.kind, i, self.dest, raw)
        self.bufs.append(buf)
        self.dest, self.pos = None, 0


# -- the receiver: bytes in through its own buffers, messages out ---------------------------------

_unpack_prefix = PREFIX.unpack_from


class FrameReceiver(FrameDecoder):
    """``frames.FrameDecoder`` zero-copy: feed it with ``feed(data)`` or with ``get_buffer()``
    then ``buffer_updated(n)`` (the ``asyncio.BufferedProtocol`` pair).

    Frames up to 64 KiB are decoded once they are whole in the scratch buffer (``get_buffer``
    keeps room for them). Larger ones are read stage by stage, and their payload buffers of
    64 KiB or more are read by the caller straight into the memory ``alloc`` returned. After a
    ``RemoteProtocolError`` the decoder stays failed (``error`` is set).
    """

    def __init__(self, *, alloc: Alloc | None = None, limits: Limits = DEFAULT_LIMITS,
                 scratch: int = SCRATCH_BYTES, budget: InflateBudget | None = None) -> None:
        super().__init__(alloc=alloc, limits=limits, scratch=scratch, budget=budget)
        self._buf = bytearray(scratch)  # grows to a frame that needs more (within limits)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0  # unread bytes are _buf[_lo:_hi]
        self._direct = False  # the last get_buffer() handed out the destination itself
        self._frame: PartialFrame | None = None  # a frame larger than 64 KiB, while it arrives

    @classmethod
    def taking_over(cls, decoder: FrameDecoder) -> FrameReceiver:
        """A receiver with ``decoder``'s settings (its very ``limits`` object), to take its
        place before the connection has read a byte: a shell that reads zero-copy swaps it for
        the plain decoder a ``handshake.Connection`` made."""
        if decoder.in_frame:
            raise LocalProtocolError("a decoder is taken over before any byte arrives")
        return cls(alloc=decoder.alloc, limits=decoder.limits, scratch=decoder.scratch,
                   budget=decoder.budget)

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
        super().widen(limits, scratch)
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
            with_buffers(msg, self._copy_body(msg.KIND, table, at + meta_len, body_len))
        self._lo = end
        out.append(msg)
        return True

    def _next_checked(self, prefix: tuple[Any, ...], out: list[Message]) -> bool:
        """``_next`` for a frame not yet whole, or a prefix that fails its one test."""
        try:
            head_len = check_prefix(prefix, self.limits)  # raises what is wrong, if anything
        except RemoteProtocolError as e:
            if e.expected == MAGIC:  # not minips at all: what it sent names it (HTTP, SSH, ...)
                e.got = bytes(self._buf[self._lo:min(self._hi, self._lo + FOREIGN_BYTES)])
            raise
        _, version, kind, nbuf, _, _, body_len = prefix
        at = self._lo + PREFIX.size
        end = at + head_len + body_len
        if end > self._hi:  # not all here yet
            if end - self._lo <= HEAD_FIRST_BYTES:
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
            with_buffers(msg, self._copy_body(msg.KIND, table, at + head_len, body_len))
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
            if codec == CODEC_LZ4:
                dest = self._inflate(kind, i, src, raw)
            else:
                dest = self._allocate(kind, i, raw)
                dest[:] = src
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
            self._lo = f.fill(self._view, self._lo, self._hi, self._allocate, self._inflate)
            if len(f.bufs) < f.nbuf:
                return False
        assert f.msg is not None
        if f.bufs:  # fields were checked at head time; the views are flat "B" already
            with_buffers(f.msg, tuple(f.bufs))
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
        return writable_view(self.alloc(kind, index, nbytes), nbytes)

    def _inflate(self, kind: Kind, index: int, src: memoryview, raw: int) -> memoryview:
        """An lz4 buffer decompressed in place into its destination, its ``raw`` bytes charged
        to the budget first. A fresh array (the default ``alloc``) keeps the charge until it is
        freed; memory an ``alloc`` of the caller's hands out (reused) only while decompressing."""
        self.budget.charge(raw)
        try:
            if self.alloc is default_alloc:
                arr = np.empty(raw, dtype=np.uint8)
                weakref.finalize(arr, self.budget.refund, raw)
                dest = arr.data
            else:
                dest = writable_view(self.alloc(kind, index, raw), raw)
            decompress_into(src, dest)
        except BaseException:
            if self.alloc is not default_alloc:
                self.budget.refund(raw)
            raise
        if self.alloc is not default_alloc:
            self.budget.refund(raw)
        return dest
