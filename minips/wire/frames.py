"""minips framing, sans-IO: messages in, bytes out, and bytes in, messages out.

No networking code at all, no clocks and no connection state (``handshake.py``). The file holds,
in order: the fixed prefix, the buffer table and the limits; ``encode``; the checks a decoder
runs on each part of a frame, in the order its bytes arrive; ``PartialFrame``, a frame larger
than 64 KiB while it arrives (its prefix, table and message so far, and the buffers its body is
copied into); and ``FrameDecoder``, which takes bytes with ``feed(data)`` or, zero-copy, through
``get_buffer()`` / ``buffer_updated(n)`` (the ``asyncio.BufferedProtocol`` pair) and returns the
messages they complete.

A frame is (all integers little-endian; docs/protocol.md, section 1, has every byte):

    prefix  16 bytes   magic b"MNPS" | version u8 | kind u8 | nbuf u8 | flags u8 (0)
                       | meta_len u32 | body_len u32
    table   12 bytes per buffer: codec u8 (0 raw, 1 lz4 block) | 3 zero bytes | wire_len u32
                       | raw_len u32
    meta    meta_len bytes: a msgpack map with exactly the message's fields
    body    body_len bytes: the buffers back to back, wire_len bytes each, never through msgpack

Invariants:
- Every length is checked against a named limit (``Limits``; a server narrows them to its model
  with ``Limits.sized_for``) before anything of that size is allocated; lz4 output is bounded
  by the raw_len the table announced, charged to the process's ``InflateBudget`` before it is
  inflated, and inflated in place into its destination (``decompress_into``): one copy.
- Decoding any bytes gives messages or raises ``RemoteProtocolError`` (``LimitExceeded`` for a
  limit), never another exception; after one the decoder stays failed (``error``). Misuse on
  our side raises ``LocalProtocolError``.
- HELLO, REFUSE and ERROR are decoded whatever the version byte says (their layout is frozen),
  so a peer speaking another version can still be refused with a readable reason.
- A frame of up to 64 KiB is decoded in one step once it is whole in the scratch buffer (the
  common case: ACKs, PULLs, sparse PUSHes); ``get_buffer`` always keeps room for the rest of it
  (a smaller scratch buffer, as a server uses before the handshake, grows to the frame's size).
- ``widen(limits)`` raises the limits and the scratch buffer (a server, once the peer has
  authenticated); ``release()`` frees a frame in progress and the scratch (connection ended).
- A bigger frame is read stage by stage (prefix, head, buffers: ``PartialFrame``) through the
  same checks; its payload buffers of 64 KiB or more are received straight into the memory
  ``alloc`` returns, 64 KiB per read. A buffer of the table is filled in order, exactly
  ``wire_len`` bytes; a raw one lands in the memory ``allocate`` returns (no copy after it), an
  lz4 one in a temporary that is decompressed into its destination once whole.
- Decoded buffers are flat writable ``memoryview``s: into one private copy of a small body, or
  into ``alloc``'s memory.

Public API: ``MAGIC``, ``PREFIX``, ``TABLE_ENTRY``, the ``MAX_*`` limits, ``Limits``,
``encode(msg, *, compress=False) -> list[buffer]``, the decoder's checks (``check_prefix``,
``check_table``, ``unpack_meta``, ``decompress``), ``PartialFrame``, ``Allocate``, ``Alloc``,
``default_alloc``, ``FrameDecoder``, ``InflateBudget`` and the process's ``INFLATE_BUDGET``,
``decompress_into``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lz4.block
import lz4.block._block as _lz4_ext
import msgpack
import numpy as np

from minips.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from minips.wire.messages import (
    MAX_BUFFERS,
    PROTOCOL_VERSION,
    WITH_BUFFERS,
    Kind,
    Message,
    from_wire,
)

__all__ = [
    "wire_size",
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
    "DIRECT_MIN_BYTES",
    "DIRECT_READ_BYTES",
    "Limits",
    "DEFAULT_LIMITS",
    "InflateBudget",
    "INFLATE_BUDGET",
    "encode",
    "check_prefix",
    "check_table",
    "unpack_meta",
    "decompress",
    "decompress_into",
    "PartialFrame",
    "Allocate",
    "Alloc",
    "default_alloc",
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
SCRATCH_BYTES = 256 << 10  # receive buffer for prefixes, maps and small frames
DIRECT_MIN_BYTES = 64 << 10  # a payload this large is received straight into its destination
# ... in reads of at most this much: small reads follow the sender closely, so the bytes are still
# in the cache when copied out of the kernel (1.3-1.5x the throughput of one huge read on loopback)
DIRECT_READ_BYTES = 64 << 10
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
    does not fit; the charge is returned when the decoded buffer is freed. With the per-frame
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


# ---------------------------------------------------------------------------------------------
# Encoding


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
    buffers = msg.__dict__["buffers"] if kind in WITH_BUFFERS else ()
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


# ---------------------------------------------------------------------------------------------
# Checks a decoder runs on a frame, in the order its bytes arrive


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


# -- the frame decoder: bytes in, messages out -----------------------------------------------------

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
                 scratch: int = SCRATCH_BYTES, budget: InflateBudget | None = None) -> None:
        self.alloc: Alloc = alloc or default_alloc
        self.limits = limits
        self.budget = budget or INFLATE_BUDGET
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
        return self._checked(self.alloc(kind, index, nbytes), nbytes)

    @staticmethod
    def _checked(got: Any, nbytes: int) -> memoryview:
        view = memoryview(got).cast("B")
        if view.readonly or view.nbytes < nbytes:
            raise LocalProtocolError("alloc returned a read-only or short buffer", expected=nbytes,
                                     got=view.nbytes)
        return view[:nbytes]

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
                dest = self._checked(self.alloc(kind, index, raw), raw)
            decompress_into(src, dest)
        except BaseException:
            if self.alloc is not default_alloc:
                self.budget.refund(raw)
            raise
        if self.alloc is not default_alloc:
            self.budget.refund(raw)
        return dest
