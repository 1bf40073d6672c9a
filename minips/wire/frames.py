"""minips framing, sans-IO: a message in, the bytes of its frame out; bytes in, messages out.

No networking code at all, no clocks and no connection state (``handshake.py``). A frame is
(all integers little-endian; docs/protocol.md, section 1, has every byte):

    prefix  16 bytes   magic b"MNPS" | version u8 | kind u8 | nbuf u8 | flags u8 (0)
                       | meta_len u32 | body_len u32
    table   12 bytes per buffer: codec u8 (0 raw, 1 lz4 block) | 3 zero bytes | wire_len u32
                       | raw_len u32
    meta    meta_len bytes: a msgpack map with exactly the message's fields
    body    body_len bytes: the buffers back to back, wire_len bytes each, never through msgpack

The file reads in the order a frame is made and taken apart: the layout and its limits
(``Limits``, and ``InflateBudget``, what lz4 output may cost a process); ``encode``; the checks
a decoder runs on each part, in the order its bytes arrive (``check_prefix``, ``check_table``,
``unpack_meta``, ``decompress``); ``decode_frame``, one whole frame's bytes to its message; and
``FrameDecoder``, which collects the bytes a peer sends (``feed``) and returns the messages
they complete. ``receive.py`` holds the zero-copy twin of ``FrameDecoder`` that the asyncio
shell uses, behind the same interface; tests/test_decoders.py holds the two equal.

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

import dataclasses
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lz4.block
import msgpack
import numpy as np

from minips.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from minips.wire.fields import MAX_BUFFERS
from minips.wire.messages import (
    PROTOCOL_VERSION,
    WITH_BUFFERS,
    Kind,
    Message,
    from_wire,
    with_buffers,
)

__all__ = [
    "MAGIC",
    "PREFIX",
    "TABLE_ENTRY",
    "TABLES",
    "KINDS",
    "CODEC_RAW",
    "CODEC_LZ4",
    "MAX_FRAME_BYTES",
    "MAX_META_BYTES",
    "MAX_RAW_BYTES",
    "INFLATE_BUDGET_BYTES",
    "MODEL_SLACK_BYTES",
    "LZ4_MIN_BYTES",
    "COALESCE_BYTES",
    "SCRATCH_BYTES",
    "HEAD_FIRST_BYTES",
    "Limits",
    "DEFAULT_LIMITS",
    "InflateBudget",
    "INFLATE_BUDGET",
    "encode",
    "wire_size",
    "check_prefix",
    "check_table",
    "unpack_meta",
    "decompress",
    "Alloc",
    "default_alloc",
    "writable_view",
    "frame_size",
    "check_head",
    "decode_frame",
    "FrameDecoder",
]


# -- the frame layout: prefix, buffer table, limits ------------------------------------------------

MAGIC = b"MNPS"
PREFIX = struct.Struct("<4sBBBBII")  # magic, version, kind, nbuf, flags, meta_len, body_len
TABLE_ENTRY = struct.Struct("<B3xII")  # codec, pad, wire_len, raw_len
CODEC_RAW, CODEC_LZ4 = 0, 1
# prefix + table of n buffers as one precompiled struct: one pack/unpack call per frame
_HEADS = [struct.Struct("<4sBBBBII" + "B3xII" * n) for n in range(MAX_BUFFERS + 1)]
TABLES = [struct.Struct("<" + "B3xII" * n) for n in range(MAX_BUFFERS + 1)]

MAX_FRAME_BYTES = 512 << 20  # bytes on the wire per frame; a dense VGG-19 (~80 MB f32) fits
MAX_META_BYTES = 1 << 20  # bytes of the msgpack map; run configs are a few KiB
MAX_RAW_BYTES = 512 << 20  # sum of decompressed buffer sizes per frame (bounds lz4 output)
INFLATE_BUDGET_BYTES = 64 << 20  # lz4 output alive at once in one process, all connections
MODEL_SLACK_BYTES = 64 << 10  # a buffer of a model of n values: <= 5 n + this (Limits.sized_for)
LZ4_MIN_BYTES = 4096  # smaller buffers are not worth compressing
COALESCE_BYTES = 16 << 10  # smaller buffers are copied into the header write: fewer iovecs
# a decoder's receive buffer for prefixes, maps and small frames (``receive.FrameReceiver``'s
# scratch; ``FrameDecoder`` keeps the number for the receiver that takes its place)
SCRATCH_BYTES = 256 << 10
# a frame larger than this has its head (table and map) checked as soon as the head is in, before
# its body is read; a smaller one once it is whole (docs/protocol.md, section 1.1)
HEAD_FIRST_BYTES = 64 << 10
KINDS = {int(k): k for k in Kind}  # faster than calling Kind(byte)
_ANY_VERSION = frozenset({Kind.HELLO, Kind.REFUSE, Kind.ERROR})  # layout frozen across versions


@dataclass(frozen=True)
class Limits:
    """Sizes a decoder accepts; over one of them it raises ``LimitExceeded`` (the peer gets
    ERROR ``limit_exceeded``): the frame, meta and buffer limits on the prefix and table, before
    allocating; the msgpack lengths while the map is decoded."""

    max_frame_bytes: int = MAX_FRAME_BYTES
    max_meta_bytes: int = MAX_META_BYTES
    max_buffers: int = MAX_BUFFERS
    max_raw_bytes: int = MAX_RAW_BYTES
    max_buffer_bytes: int = MAX_RAW_BYTES  # raw_len of one buffer
    max_str_len: int = 1 << 16  # msgpack string length
    max_bin_len: int = 1 << 16  # msgpack bin length (nonces, MACs, small codec tables)
    max_array_len: int = 4096  # msgpack array length
    max_map_len: int = 1024  # msgpack map size

    def sized_for(self, n: int) -> Limits:
        """These limits narrowed to a model of ``n`` values, once a server knows it: the largest
        buffer any payload of such a model needs (dense f32: 4 n bytes; varint indices of a
        sparse one: at most 5 n) plus ``MODEL_SLACK_BYTES``, a frame two such buffers (indices
        and values) plus its map. Nothing wider is ever sent for that model, so nothing wider
        is decompressed or allocated."""
        buf = 5 * n + MODEL_SLACK_BYTES
        frame = PREFIX.size + TABLE_ENTRY.size * self.max_buffers + self.max_meta_bytes + 2 * buf
        return dataclasses.replace(self, max_buffer_bytes=min(buf, self.max_buffer_bytes),
                                   max_raw_bytes=min(2 * buf, self.max_raw_bytes),
                                   max_frame_bytes=min(frame, self.max_frame_bytes))


DEFAULT_LIMITS = Limits()


class InflateBudget:
    """Bytes of lz4 output alive at once in this process, over every connection: a buffer is
    charged its ``raw_len`` before it is decompressed and refused (``LimitExceeded``) when that
    does not fit; the charge is returned once the frame is decoded (``FrameDecoder``) or when
    the decoded buffer is freed (``receive.FrameReceiver``). With the per-frame
    limits (``Limits``) this bounds what compressed input can cost a server, however many
    connections send it. ``at_least`` raises the cap (a server of a large model makes room for
    two whole frames of it)."""

    def __init__(self, cap: int = INFLATE_BUDGET_BYTES) -> None:
        self.cap = cap
        self.used = 0

    def at_least(self, cap: int) -> None:
        self.cap = max(self.cap, cap)

    def charge(self, nbytes: int) -> None:
        if self.used + nbytes > self.cap:
            raise LimitExceeded(
                f"decompressing {nbytes} bytes would take this process's lz4 budget past "
                f"{self.cap} ({self.used} in use)", expected=self.cap - self.used, got=nbytes)
        self.used += nbytes

    def refund(self, nbytes: int) -> None:
        self.used -= nbytes


INFLATE_BUDGET = InflateBudget()  # the process's: every decoder charges it unless given another


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


# -- the checks a decoder runs on a frame, in the order its bytes arrive ---------------------------

def _check_limit(what: str, got: int, limit: int) -> None:
    if got > limit:
        raise LimitExceeded(f"{what} is {got}, over the limit of {limit}", expected=limit, got=got)


def check_prefix(prefix: tuple[Any, ...], limits: Limits) -> int:
    """Check an unpacked prefix against the protocol and ``limits``; return the head length
    (table + meta) that follows it."""
    magic, version, kind, nbuf, flags, meta_len, body_len = prefix
    head_len: int = TABLE_ENTRY.size * nbuf + meta_len
    if (magic == MAGIC and version == PROTOCOL_VERSION and not flags and kind in KINDS
            and nbuf <= limits.max_buffers and meta_len <= limits.max_meta_bytes
            and PREFIX.size + head_len + body_len <= limits.max_frame_bytes):
        return head_len  # the common case in one test; otherwise find what is wrong below
    if magic != MAGIC:
        raise RemoteProtocolError("bad magic: not a minips frame", expected=MAGIC, got=bytes(magic))
    if kind not in KINDS:
        raise RemoteProtocolError(f"unknown message kind {kind}", got=kind)
    if version != PROTOCOL_VERSION and kind not in _ANY_VERSION:
        raise RemoteProtocolError(f"protocol version {version}", expected=PROTOCOL_VERSION,
                                  got=version)
    if flags != 0:
        raise RemoteProtocolError("reserved flags byte is not zero", expected=0, got=flags)
    if (nbuf > limits.max_buffers or meta_len > limits.max_meta_bytes
            or PREFIX.size + head_len + body_len > limits.max_frame_bytes):  # one test if fine
        _check_limit("buffer count", nbuf, limits.max_buffers)
        _check_limit("msgpack header size", meta_len, limits.max_meta_bytes)
        _check_limit("frame size", PREFIX.size + head_len + body_len, limits.max_frame_bytes)
    return head_len


def check_table(table: tuple[int, ...], body_len: int, limits: Limits) -> None:
    """``table`` is flat: codec, wire_len, raw_len per buffer."""
    wires, raws = table[1::3], table[2::3]
    if sum(wires) != body_len:
        raise RemoteProtocolError("buffer table does not add up to body_len", expected=body_len,
                                  got=sum(wires))
    if wires != raws or any(table[0::3]):  # some buffer is not raw: look at each one
        for codec, wire, raw in zip(table[0::3], wires, raws, strict=True):
            if codec not in (CODEC_RAW, CODEC_LZ4):
                raise RemoteProtocolError(f"unknown buffer codec {codec}", got=codec)
            if codec == CODEC_RAW and wire != raw:
                raise RemoteProtocolError("raw buffer with wire_len != raw_len", expected=wire,
                                          got=raw)
    if sum(raws) > limits.max_raw_bytes:
        _check_limit("decompressed frame size", sum(raws), limits.max_raw_bytes)
    if raws and max(raws) > limits.max_buffer_bytes:
        _check_limit("decompressed buffer size", max(raws), limits.max_buffer_bytes)


# msgpack's own words for a length over one of its max_*_len limits: "70000 exceeds
# max_str_len(65536)" (the C and the pure-Python unpacker say it alike)
_MSGPACK_LIMIT = re.compile(r"(\d+) exceeds (max_(?:str|bin|array|map)_len)\((\d+)\)")


_FIXED_SIZES = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
                0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}  # msgpack nil, bools, floats, ints: payload
_LENGTHS = {0xd9: (1, "max_str_len"), 0xda: (2, "max_str_len"), 0xdb: (4, "max_str_len"),
            0xc4: (1, "max_bin_len"), 0xc5: (2, "max_bin_len"), 0xc6: (4, "max_bin_len")}
_CONTAINERS = {0xdc: 2, 0xdd: 4, 0xde: 2, 0xdf: 4}  # array16/32, map16/32: their count's bytes


def _claimed_over_limit(raw: bytes | bytearray | memoryview,
                        limits: Limits) -> LimitExceeded | None:
    """The first str or bin header in ``raw`` whose length is over its limit, found by walking
    the msgpack tokens as far as the bytes go; None if there is none. msgpack checks an array's
    or a map's count at its header but a str's or bin's length only once its bytes are there,
    so a str32 claiming 70,000 bytes past ``meta_len`` would read as bad data; one rule for the
    four (protocol.md, section 6): a length over its limit is ``limit_exceeded``."""
    view, pos = memoryview(raw).cast("B"), 0
    while pos < len(view):
        b = view[pos]
        pos += 1
        if b <= 0x9f or b >= 0xe0:  # fixint, fixmap, fixarray, negative fixint: no payload
            continue
        if b <= 0xbf:  # fixstr
            pos += b & 0x1f
        elif b in _FIXED_SIZES:
            pos += _FIXED_SIZES[b]
        elif b in _CONTAINERS:
            pos += _CONTAINERS[b]
        elif b in _LENGTHS:
            size, what = _LENGTHS[b]
            n = int.from_bytes(view[pos:pos + size], "big")
            limit = getattr(limits, what)
            if pos + size <= len(view) and n > limit:
                return LimitExceeded(f"msgpack {what} is {n}, over the limit of {limit}",
                                     expected=limit, got=n)
            pos += size + n
        else:  # ext types and the unused byte: msgpack's own error stands
            return None
    return None


def unpack_meta(raw: bytes | bytearray | memoryview, limits: Limits) -> dict[str, Any]:
    """The frame's msgpack map; a string, bin, array or map over its ``Limits`` length raises
    ``LimitExceeded`` like every other limit, whether or not the bytes it claims are there
    (``_claimed_over_limit``), anything else wrong ``RemoteProtocolError``."""
    try:
        meta = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len, max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len, max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several types (ExtraData, ValueError, ...)
        over = _MSGPACK_LIMIT.fullmatch(str(e)) if type(e) is ValueError else None
        if over is not None:
            got, what, limit = int(over[1]), over[2], int(over[3])
            raise LimitExceeded(f"msgpack {what} is {got}, over the limit of {limit}",
                                expected=limit, got=got) from None
        claimed = _claimed_over_limit(raw, limits)
        if claimed is not None:
            raise claimed from None
        raise RemoteProtocolError(f"bad msgpack header: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict):
        raise RemoteProtocolError("msgpack header is not a map", got=type(meta).__name__)
    return meta


def decompress(wire: memoryview, raw: int) -> bytes:
    """Decompress one lz4 block of exactly ``raw`` bytes (output bounded by ``raw``)."""
    try:
        data: bytes = lz4.block.decompress(wire, uncompressed_size=raw)
    except Exception as e:  # lz4.block.LZ4BlockError and friends
        raise RemoteProtocolError(f"bad lz4 buffer: {e}") from None
    if len(data) != raw:
        raise RemoteProtocolError("lz4 buffer has the wrong size", expected=raw, got=len(data))
    return data


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
