"""minips framing, sans-IO: the fixed prefix, the buffer table, limits, ``encode``, and the
checks a decoder (``decoder.py``) runs on each part of a frame. No networking code at all.

A frame is (all integers little-endian; docs/protocol.md, section 1, has every byte):

    prefix  16 bytes   magic b"MNPS" | version u8 | kind u8 | nbuf u8 | flags u8 (0)
                       | meta_len u32 | body_len u32
    table   12 bytes per buffer: codec u8 (0 raw, 1 lz4 block) | 3 zero bytes | wire_len u32
                       | raw_len u32
    meta    meta_len bytes: a msgpack map with exactly the message's fields
    body    body_len bytes: the buffers back to back, wire_len bytes each, never through msgpack

Invariants:
- Every length is checked against a named limit (``Limits``) before anything of that size is
  allocated; lz4 output is bounded by the raw_len the table announced.
- Decoding any bytes gives messages or raises ``RemoteProtocolError`` (``LimitExceeded`` for a
  limit), never another exception; after one the decoder stays failed. Misuse on our side raises
  ``LocalProtocolError``.
- HELLO, REFUSE and ERROR are decoded whatever the version byte says (their layout is frozen),
  so a peer speaking another version can still be refused with a readable reason.
- A frame already whole in the scratch buffer is decoded in one step (the common case for small
  messages); a frame that arrives in pieces goes through the same checks stage by stage, and its
  large payload buffers are received straight into the memory ``alloc`` returns.

Public API: ``MAGIC``, ``PREFIX``, ``TABLE_ENTRY``, the ``MAX_*`` limits, ``Limits``, ``Alloc``,
``default_alloc``, ``encode(msg, *, compress=False) -> list[buffer]``, ``FrameDecoder``.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import lz4.block
import msgpack

from minips.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from minips.wire.messages import (
    MAX_BUFFERS,
    PROTOCOL_VERSION,
    WITH_BUFFERS,
    Kind,
    Message,
)

__all__ = [
    "MAGIC", "PREFIX", "TABLE_ENTRY", "TABLES", "KINDS", "CODEC_RAW", "CODEC_LZ4",
    "MAX_FRAME_BYTES", "MAX_META_BYTES", "MAX_RAW_BYTES", "LZ4_MIN_BYTES", "COALESCE_BYTES",
    "SCRATCH_BYTES", "DIRECT_MIN_BYTES", "DIRECT_READ_BYTES", "Limits", "DEFAULT_LIMITS", "encode",
    "check_prefix", "check_table", "unpack_meta", "decompress",
]

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
    max_str_len: int = 1 << 16  # msgpack string length
    max_bin_len: int = 1 << 16  # msgpack bin length (nonces, MACs, small codec tables)
    max_array_len: int = 4096  # msgpack array length
    max_map_len: int = 1024  # msgpack map size


DEFAULT_LIMITS = Limits()


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


# msgpack's own words for a length over one of its max_*_len limits: "70000 exceeds
# max_str_len(65536)" (the C and the pure-Python unpacker say it alike)
_MSGPACK_LIMIT = re.compile(r"(\d+) exceeds (max_(?:str|bin|array|map)_len)\((\d+)\)")


def unpack_meta(raw: bytes | bytearray | memoryview, limits: Limits) -> dict[str, Any]:
    """The frame's msgpack map; a string, bin, array or map over its ``Limits`` length raises
    ``LimitExceeded`` like every other limit, anything else wrong ``RemoteProtocolError``."""
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
