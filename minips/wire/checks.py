"""The frame's layout in numbers, and every check a decoder runs on a frame's bytes before it
trusts them; sans-IO, no state but the process's lz4 budget.

``frames.py`` (the plain codec) and ``receive.py`` (its zero-copy twin) both decode through these:
the prefix's 16 bytes (``check_prefix``: magic, version, kind, the frame, map and buffer-count
limits), the buffer table (``check_table``: it adds up, known codecs, the decompressed limits),
the msgpack map (``unpack_meta``: msgpack's own length limits, and a length claimed past the bytes
that are there is ``LimitExceeded`` too) and one lz4 buffer (``decompress``, output bounded by the
size the table announced and charged to an ``InflateBudget`` first).

``Limits`` holds every size a decoder accepts; a server narrows them to its model with
``Limits.sized_for`` once it knows the model. Over a limit a check raises ``LimitExceeded``
(the peer gets ERROR ``limit_exceeded``), anything else wrong ``RemoteProtocolError``
(docs/protocol.md, sections 1 and 6).
"""

from __future__ import annotations

import dataclasses
import re
import struct
from dataclasses import dataclass
from typing import Any

import lz4.block
import msgpack

from minips.errors import LimitExceeded, RemoteProtocolError
from minips.wire.fields import MAX_BUFFERS
from minips.wire.messages import PROTOCOL_VERSION, Kind

__all__ = [
    "MAGIC",
    "PREFIX",
    "TABLE_ENTRY",
    "KINDS",
    "CODEC_RAW",
    "CODEC_LZ4",
    "MAX_FRAME_BYTES",
    "MAX_META_BYTES",
    "MAX_RAW_BYTES",
    "INFLATE_BUDGET_BYTES",
    "MODEL_SLACK_BYTES",
    "Limits",
    "DEFAULT_LIMITS",
    "InflateBudget",
    "INFLATE_BUDGET",
    "check_prefix",
    "check_table",
    "unpack_meta",
    "decompress",
]


# -- the frame layout and its limits ---------------------------------------------------------------

MAGIC = b"MNPS"
PREFIX = struct.Struct("<4sBBBBII")  # magic, version, kind, nbuf, flags, meta_len, body_len
TABLE_ENTRY = struct.Struct("<B3xII")  # codec, pad, wire_len, raw_len
CODEC_RAW, CODEC_LZ4 = 0, 1

MAX_FRAME_BYTES = 512 << 20  # bytes on the wire per frame; a dense VGG-19 (~80 MB f32) fits
MAX_META_BYTES = 1 << 20  # bytes of the msgpack map; run configs are a few KiB
MAX_RAW_BYTES = 512 << 20  # sum of decompressed buffer sizes per frame (bounds lz4 output)
INFLATE_BUDGET_BYTES = 64 << 20  # lz4 output alive at once in one process, all connections
MODEL_SLACK_BYTES = 64 << 10  # a buffer of a model of n values: <= 5 n + this (Limits.sized_for)
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
