"""minips framing, sans-IO: a message in, the bytes of its frame out; bytes in, messages out.

No networking code at all, no clocks and no connection state (``handshake.py``). A frame is
(all integers little-endian; docs/protocol.md, section 1, has every byte):

    prefix  16 bytes   magic b"MNPS" | version u8 | kind u8 | nbuf u8 | flags u8 (0)
                       | meta_len u32 | body_len u32
    table   12 bytes per buffer: codec u8 (0 raw, 1 lz4 block) | 3 zero bytes | wire_len u32
                       | raw_len u32
    meta    meta_len bytes: a msgpack map with exactly the message's fields
    body    body_len bytes: the buffers back to back, wire_len bytes each, never through msgpack

The file reads in the order a frame is made and taken apart: ``encode``; ``decode_frame``, one
whole frame's bytes to its message; and ``FrameDecoder``, which collects the bytes a peer sends
(``feed``) and returns the messages they complete. The layout's numbers, the limits (``Limits``,
and ``InflateBudget``, what lz4 output may cost a process) and the checks a decoder runs on each
part in the order its bytes arrive (``check_prefix``, ``check_table``, ``unpack_meta``,
``decompress``) are ``checks.py``. ``receive.py`` holds the zero-copy twin of ``FrameDecoder``
that the asyncio shell uses, behind the same interface; tests/test_decoders.py holds the two
equal.

Invariants:
- Every length is checked against a named limit (``Limits``; a server narrows them to its model
  with ``Limits.sized_for``) before anything of that size is allocated: the prefix as soon as
  its 16 bytes are in, the rest once the frame is whole. lz4 output is bounded by the raw_len
  the table announced and charged to an ``InflateBudget`` (the process's unless given another)
  before it is inflated; ``FrameDecoder`` returns the charge once the frame is decoded.
- Decoding any bytes gives messages or raises ``RemoteProtocolError`` (``LimitExceeded`` for a
  limit), never another exception; after one the decoder stays failed (``error``), and the
  messages completed before it are returned first. Misuse on our side (a frame too large to
  send, an ``alloc`` that returns a short buffer) raises ``LocalProtocolError``.
- HELLO, REFUSE and ERROR are decoded whatever the version byte says (their layout is frozen),
  so a peer speaking another version can still be refused with a readable reason.
- Decoded buffers are flat writable ``memoryview``s into the memory ``alloc`` returns (fresh
  numpy arrays by default); ``encode`` never copies a buffer of 16 KiB or more.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import lz4.block
import msgpack
import numpy as np

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.wire.checks import (
    CODEC_LZ4,
    CODEC_RAW,
    DEFAULT_LIMITS,
    INFLATE_BUDGET,
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
from minips.wire.fields import MAX_BUFFERS
from minips.wire.kinds import WITH_BUFFERS, from_wire, with_buffers
from minips.wire.messages import PROTOCOL_VERSION, Kind, Message

__all__ = [
    "TABLES",
    "LZ4_MIN_BYTES",
    "COALESCE_BYTES",
    "SCRATCH_BYTES",
    "HEAD_FIRST_BYTES",
    "encode",
    "wire_size",
    "Alloc",
    "default_alloc",
    "writable_view",
    "frame_size",
    "check_head",
    "decode_frame",
    "FrameDecoder",
]


# -- the frame's head as precompiled structs, and sizes -------------------------------------------

# prefix + table of n buffers as one precompiled struct: one pack/unpack call per frame
_ENTRY = TABLE_ENTRY.format.lstrip("<")  # checks.py holds the layout; these only repeat it
_HEADS = [struct.Struct(PREFIX.format + _ENTRY * n) for n in range(MAX_BUFFERS + 1)]
TABLES = [struct.Struct("<" + _ENTRY * n) for n in range(MAX_BUFFERS + 1)]
LZ4_MIN_BYTES = 4096  # smaller buffers are not worth compressing
COALESCE_BYTES = 16 << 10  # smaller buffers are copied into the header write: fewer iovecs
# a decoder's receive buffer for prefixes, maps and small frames (``receive.FrameReceiver``'s
# scratch; ``FrameDecoder`` keeps the number for the receiver that takes its place)
SCRATCH_BYTES = 256 << 10
# a frame larger than this has its head (table and map) checked as soon as the head is in, before
# its body is read; a smaller one once it is whole (docs/protocol.md, section 1.1)
HEAD_FIRST_BYTES = 64 << 10


# -- encoding: a message in, the bytes of its frame out -------------------------------------------

_packer = msgpack.Packer(use_bin_type=True)  # reused: msgpack.packb builds one per call


def encode(msg: Message, *, compress: bool = False, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    """Frame ``msg`` as [prefix + table + meta (+ small buffers), big buffer, ...] for writelines.

    Buffers of 16 KiB or more are passed through as the caller's memoryviews (no copy): do not
    modify them until the bytes are sent. With ``compress`` a buffer of >= 4 KiB is
    lz4-compressed when that makes it smaller.
    """
    meta = _packer.pack(msg.meta())
    kind = msg.KIND
    version = msg.__dict__["version"] if kind == Kind.HELLO else PROTOCOL_VERSION
    buffers = msg.__dict__["payload"].buffers if kind in WITH_BUFFERS else ()
    if not buffers:
        if PREFIX.size + len(meta) > limits.max_frame_bytes or len(meta) > limits.max_meta_bytes:
            raise _unsendable(PREFIX.size + len(meta), limits)
        return [PREFIX.pack(MAGIC, version, kind, 0, 0, len(meta), 0) + meta]
    table: list[int] = []  # codec, wire_len, raw_len per buffer, flat
    wires = []
    for buf in buffers:
        codec, wire = CODEC_RAW, buf
        if compress and buf.nbytes >= LZ4_MIN_BYTES:
            packed = lz4.block.compress(buf, store_size=False)
            if len(packed) < buf.nbytes:
                codec, wire = CODEC_LZ4, memoryview(packed)
        table += (codec, wire.nbytes, buf.nbytes)
        wires.append(wire)
    body_len = sum(table[1::3])
    n = len(buffers)
    total = _HEADS[n].size + len(meta) + body_len
    if total > limits.max_frame_bytes or len(meta) > limits.max_meta_bytes:
        raise _unsendable(total, limits)
    head = _HEADS[n].pack(MAGIC, version, kind, n, 0, len(meta), body_len, *table)
    if body_len < COALESCE_BYTES:  # every buffer is small: one bytes object
        return [b"".join([head, meta, *wires])]
    return _coalesce([head, meta], wires)


def wire_size(msg: Message) -> int:
    """Bytes ``msg`` takes on the wire: its whole frame (prefix, table, header and buffers; no
    TLS). An in-process exchange counts what a `minips group` process would send and get."""
    return sum(memoryview(b).nbytes for b in encode(msg))


def _unsendable(total: int, limits: Limits) -> LocalProtocolError:
    return LocalProtocolError("frame too large to send", expected=limits.max_frame_bytes,
                              got=total)


def _coalesce(run: list[Any], wires: list[memoryview]) -> list[Any]:
    """Join small pieces into one bytes object; big buffers stay separate, uncopied."""
    out: list[Any] = []
    for wire in wires:
        if wire.nbytes < COALESCE_BYTES:
            run.append(wire)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(wire)
    if run:
        out.append(b"".join(run))
    return out


# -- decoding: one whole frame's bytes in, its message out -----------------------------------------

Alloc = Callable[[Kind, int, int], Any]  # (kind, buffer index, nbytes) -> writable buffer


def default_alloc(kind: Kind, index: int, nbytes: int) -> memoryview:
    """A fresh uninitialised uint8 array per buffer (np.empty does not zero it)."""
    return np.empty(nbytes, dtype=np.uint8).data


def writable_view(got: Any, nbytes: int) -> memoryview:
    """The first ``nbytes`` of what an ``alloc`` returned, as a flat writable view."""
    view = memoryview(got).cast("B")
    if view.readonly or view.nbytes < nbytes:
        raise LocalProtocolError("alloc returned a read-only or short buffer", expected=nbytes,
                                 got=view.nbytes)
    return view[:nbytes]


def frame_size(prefix: tuple[Any, ...], limits: Limits) -> int:
    """Bytes of the whole frame an unpacked (and not yet checked) prefix announces."""
    return PREFIX.size + check_prefix(prefix, limits) + prefix[6]


def check_head(frame: bytes | bytearray | memoryview, prefix: tuple[Any, ...],
               limits: Limits) -> tuple[tuple[int, ...], Message]:
    """Check the table and the map that follow a checked ``prefix`` at the start of ``frame``;
    return the flat table (codec, wire_len, raw_len per buffer) and the message, its buffers
    still empty."""
    _, version, kind, nbuf, _, meta_len, body_len = prefix
    table: tuple[int, ...] = ()
    if nbuf or body_len:
        table = TABLES[nbuf].unpack_from(frame, PREFIX.size)
        check_table(table, body_len, limits)
    at = PREFIX.size + TABLE_ENTRY.size * nbuf  # where the map starts
    return table, from_wire(kind, version, unpack_meta(frame[at:at + meta_len], limits), nbuf)


def decode_frame(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
                 alloc: Alloc = default_alloc,
                 budget: InflateBudget | None = None) -> Message:
    """The message of ``frame``, the bytes of exactly one frame: prefix, table, map and body
    checked in that order, the buffers copied (or inflated) into the memory ``alloc`` returns."""
    view = memoryview(frame).cast("B")
    prefix = PREFIX.unpack_from(view) if view.nbytes >= PREFIX.size else None
    if prefix is None or view.nbytes != frame_size(prefix, limits):
        raise RemoteProtocolError("not one whole frame", got=view.nbytes)
    table, msg = check_head(view, prefix, limits)
    if table:
        body = view[view.nbytes - prefix[6]:]
        with_buffers(msg, _buffers(msg.KIND, table, body, alloc, budget or INFLATE_BUDGET))
    return msg


def _buffers(kind: Kind, table: tuple[int, ...], body: memoryview, alloc: Alloc,
             budget: InflateBudget) -> tuple[memoryview, ...]:
    """The body's buffers in ``alloc``'s memory; lz4 output is charged to ``budget`` before
    it is inflated, and the charge returned once all of the frame's buffers are done."""
    bufs, at, charged = [], 0, 0
    try:
        for i in range(len(table) // 3):
            codec, wire, raw = table[3 * i:3 * i + 3]
            if codec == CODEC_LZ4:
                budget.charge(raw)
                charged += raw
            dest = writable_view(alloc(kind, i, raw), raw)
            src = body[at:at + wire]
            dest[:] = decompress(src, raw) if codec == CODEC_LZ4 else src
            bufs.append(dest)
            at += wire
    finally:
        budget.refund(charged)
    return tuple(bufs)


# -- the frame decoder: bytes in as they arrive, messages out --------------------------------------

class FrameDecoder:
    """Bytes in, messages out: ``feed(data)`` keeps the bytes until a frame is whole, then
    decodes it (``decode_frame``). The prefix is checked as soon as its 16 bytes are in, and the
    head of a frame over ``HEAD_FIRST_BYTES`` as soon as it is in, so a frame over a limit is
    refused before its body is kept. After a ``RemoteProtocolError`` the decoder stays failed
    (``error`` is set).

    ``receive.FrameReceiver`` is the same decoder for an asyncio shell: zero-copy, big frames
    stage by stage. Both take ``alloc`` (where buffers go), ``limits``, ``scratch`` (the
    receiver's receive buffer) and ``budget`` (lz4 output), and ``widen``/``release`` alike.
    """

    def __init__(self, *, alloc: Alloc | None = None, limits: Limits = DEFAULT_LIMITS,
                 scratch: int = SCRATCH_BYTES, budget: InflateBudget | None = None) -> None:
        self.alloc: Alloc = alloc or default_alloc
        self.limits = limits
        self.scratch = scratch  # bytes of receive buffer a zero-copy receiver would hold
        self.budget = budget or INFLATE_BUDGET
        self.error: RemoteProtocolError | None = None
        self._pending = bytearray()  # bytes of a frame not yet whole
        self._head_checked = False  # the head of the frame in _pending (a large one) passed

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has arrived but not all of it."""
        return bool(self._pending)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Decode the frames ``data`` completes; keep the rest for the next call. Messages
        completed before an error are returned and the error is raised on the next call."""
        if self.error is not None:
            raise self.error
        self._pending += memoryview(data).cast("B")
        out: list[Message] = []
        try:
            while (frame := self._whole_frame()) is not None:
                out.append(decode_frame(frame, self.limits, self.alloc, self.budget))
        except RemoteProtocolError as e:
            self.error = e
            if not out:
                raise
        return out

    def widen(self, limits: Limits, scratch: int = SCRATCH_BYTES) -> None:
        """Accept frames up to ``limits`` from now on (a server widens a connection's small
        handshake limits once the peer authenticated)."""
        self.limits = limits
        self.scratch = max(self.scratch, scratch)

    def release(self) -> None:
        """Drop the bytes of a frame in progress (the connection ended)."""
        self._pending = bytearray()

    def _whole_frame(self) -> bytes | None:
        """The first frame of the pending bytes, taken out of them once it is all here."""
        pending = self._pending
        if len(pending) < PREFIX.size:
            return None
        prefix = PREFIX.unpack_from(pending)
        size = frame_size(prefix, self.limits)
        if len(pending) >= size:
            with memoryview(pending) as view:
                frame = bytes(view[:size])
            del pending[:size]
            self._head_checked = False
            return frame
        if size > HEAD_FIRST_BYTES and not self._head_checked and len(pending) >= size - prefix[6]:
            check_head(pending, prefix, self.limits)  # a large frame: its head before its body
            self._head_checked = True
        return None
