"""The minips wire protocol, sans-IO: frames, messages, limits, connection state, handshake MACs.

This module contains no networking code at all: no asyncio, no sockets, no clocks. Bytes go in,
messages come out (``FrameDecoder``); a message goes in, a list of buffers comes out (``encode``).
docs/protocol.md describes every byte. A frame is (all integers little-endian):

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
  limit), never another exception. Misuse on our side raises ``LocalProtocolError``.
- Messages are frozen dataclasses that validate their own fields; ``MESSAGE_TYPES`` maps each
  ``Kind`` to its class. Buffers are held as flat ``memoryview``s (format "B"), never copied.
- HELLO, REFUSE and ERROR keep their layout in every protocol version, so a peer speaking another
  version can still be refused with a readable reason.

Public API: ``PROTOCOL_VERSION``, ``MAGIC``, ``Kind``, the message classes, ``MESSAGE_TYPES``,
``Limits``, ``encode(msg, *, compress=False) -> list[buffer]``, ``FrameDecoder(alloc=, limits=)``
with ``feed(data) -> list[Message]`` and ``get_buffer()`` / ``buffer_updated(n)`` for
``asyncio.BufferedProtocol``, ``State``, ``Connection`` (state machine), ``make_mac``,
``ClientHandshake`` / ``ServerHandshake``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import secrets
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import lz4.block
import msgpack
import numpy as np

from minips.errors import AuthError, LimitExceeded, LocalProtocolError, RemoteProtocolError

__all__ = [
    "PROTOCOL_VERSION", "MAGIC", "PREFIX", "TABLE_ENTRY", "NONCE_BYTES", "MAC_BYTES",
    "MAX_FRAME_BYTES", "MAX_META_BYTES", "MAX_BUFFERS", "MAX_RAW_BYTES", "ROLES",
    "Kind", "Message", "Hello", "Challenge", "Auth", "Welcome", "Refuse", "Assign", "Stats",
    "Push", "Ack", "Pull", "Weights", "Heartbeat", "Leave", "Error", "MESSAGE_TYPES",
    "Limits", "Alloc", "encode", "FrameDecoder", "Side", "State", "Connection",
    "new_nonce", "make_mac", "ClientHandshake", "ServerHandshake",
]

PROTOCOL_VERSION = 1
MAGIC = b"MNPS"
PREFIX = struct.Struct("<4sBBBBII")  # magic, version, kind, nbuf, flags, meta_len, body_len
TABLE_ENTRY = struct.Struct("<B3xII")  # codec, pad, wire_len, raw_len
CODEC_RAW, CODEC_LZ4 = 0, 1
NONCE_BYTES = 32  # fresh random bytes per handshake side, so a recorded handshake cannot replay
MAC_BYTES = 32  # HMAC-SHA256 digest

MAX_FRAME_BYTES = 512 << 20  # bytes on the wire per frame; a dense VGG-19 (~80 MB f32) fits
MAX_META_BYTES = 1 << 20  # bytes of the msgpack map; run configs are a few KiB
MAX_BUFFERS = 16  # raw buffers per frame; sparse packets use 2-3
MAX_RAW_BYTES = 512 << 20  # sum of decompressed buffer sizes per frame (bounds lz4 output)
MAX_TEXT = 4096  # characters of a free-text field (reason, address)
MAX_NAME = 64  # characters of a name field (role, code, encoding, capability)
MAX_INT = 2**63 - 1
LZ4_MIN_BYTES = 4096  # smaller buffers are not worth compressing
ROLES = ("worker", "group", "evaluator")


class Kind(IntEnum):
    """Message kind, the byte at offset 5 of every frame."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    REFUSE = 5
    ASSIGN = 6
    STATS = 7
    PUSH = 8
    ACK = 9
    PULL = 10
    WEIGHTS = 11
    HEARTBEAT = 12
    LEAVE = 13
    ERROR = 14


# ---------------------------------------------------------------------------------------------
# Field checks: each returns the (normalised) value or raises _Invalid.


class _Invalid(Exception):
    pass


Check = Callable[[Any], Any]


def _int(lo: int = 0, hi: int = MAX_INT) -> Check:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise _Invalid(f"expected an int in [{lo}, {hi}]")
        return v

    return check


def _float(lo: float = -math.inf, hi: float = math.inf) -> Check:
    def check(v: Any) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
            raise _Invalid(f"expected a finite number in [{lo}, {hi}]")
        return float(v)

    return check


def _text(maxlen: int, choices: tuple[str, ...] = ()) -> Check:
    def check(v: Any) -> str:
        if type(v) is not str or len(v) > maxlen or (choices and v not in choices):
            within = f" in {choices}" if choices else ""
            raise _Invalid(f"expected a str of <= {maxlen} chars{within}")
        return v

    return check


def _blob(*sizes: int) -> Check:
    def check(v: Any) -> bytes:
        if not isinstance(v, (bytes, bytearray, memoryview)) or len(v) not in sizes:
            raise _Invalid(f"expected bytes of length {' or '.join(map(str, sizes))}")
        return bytes(v)

    return check


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _Invalid("expected a bool")
    return v


def _names(v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NAME:
        raise _Invalid(f"expected a list of <= {MAX_NAME} names")
    return tuple(_text(MAX_NAME)(x) for x in v)


_PRIMITIVES = frozenset({type(None), bool, int, float, str, bytes})


def _tree(v: Any, depth: int = 8) -> Any:
    """Check (without copying) that ``v`` is a msgpack-able tree: primitives, lists/tuples and
    maps with str keys, at most ``depth`` deep. Tuples come back from the wire as lists."""
    if type(v) in _PRIMITIVES:
        return v
    if depth <= 0:
        raise _Invalid("nested too deep")
    items: Iterable[Any]
    if isinstance(v, dict):
        if not all(type(k) is str for k in v):
            raise _Invalid("map keys must be str")
        items = v.values()
    elif isinstance(v, (list, tuple)):
        items = v
    else:
        raise _Invalid(f"unsupported value of type {type(v).__name__}")
    for x in items:
        if type(x) not in _PRIMITIVES:
            _tree(x, depth - 1)
    return v


def _map(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _Invalid("expected a map")
    out: dict[str, Any] = _tree(v)
    return out


def _buffers(v: Any) -> tuple[memoryview, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_BUFFERS:
        raise _Invalid(f"expected a tuple of <= {MAX_BUFFERS} buffers")
    try:  # a flat byte view of each; cast() refuses non-contiguous arrays instead of copying
        return tuple(memoryview(b).cast("B") for b in v)
    except TypeError as e:
        raise _Invalid(f"buffers must be C-contiguous bytes-like objects ({e})") from None


def _f(check: Check, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    return field(default=default, default_factory=factory, metadata={"check": check})


# ---------------------------------------------------------------------------------------------
# Messages: docs/architecture.md has the table of who sends what.


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base class: validates every field with the check in its metadata."""

    KIND: ClassVar[Kind]
    NOT_IN_META: ClassVar[tuple[str, ...]] = ("buffers",)

    def __post_init__(self) -> None:
        for name, check in _checks(type(self)):
            value = getattr(self, name)
            try:
                checked = check(value)
                if checked is not value:  # a normalised value (tuple, bytes, flat view)
                    object.__setattr__(self, name, checked)
            except _Invalid as e:
                where = f"{type(self).__name__}.{name}"
                raise LocalProtocolError(f"{where}: {e}", expected=str(e), got=value) from None

    def meta(self) -> dict[str, Any]:
        """The msgpack map of this message: every field except ``buffers`` and HELLO's version."""
        return {name: getattr(self, name) for name in _meta_names(type(self))}


_CHECKS: dict[type, tuple[tuple[str, Check], ...]] = {}  # class -> (field, check) pairs
_META_NAMES: dict[type, tuple[str, ...]] = {}  # class -> fields in its msgpack map


def _checks(cls: type[Message]) -> tuple[tuple[str, Check], ...]:
    if cls not in _CHECKS:  # dataclasses.fields() is slow; look it up once per class
        _CHECKS[cls] = tuple((f.name, f.metadata["check"]) for f in dataclasses.fields(cls))
    return _CHECKS[cls]


def _meta_names(cls: type[Message]) -> tuple[str, ...]:
    if cls not in _META_NAMES:
        fields = dataclasses.fields(cls)
        _META_NAMES[cls] = tuple(f.name for f in fields if f.name not in cls.NOT_IN_META)
    return _META_NAMES[cls]


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Client opens a session. ``version`` travels in the frame prefix, not in the map."""

    KIND = Kind.HELLO
    NOT_IN_META = ("buffers", "version")
    version: int = _f(_int(0, 255), PROTOCOL_VERSION)
    role: str = _f(_text(MAX_NAME, ROLES), "worker")
    worker_id: int = _f(_int(-1), -1)  # -1: let the server choose
    nonce: bytes = _f(_blob(NONCE_BYTES))
    capabilities: tuple[str, ...] = _f(_names, ())
    address: str = _f(_text(MAX_TEXT), "")  # "host:port" a group server accepts workers on
    group: int = _f(_int(-1), -1)  # -1: none


@dataclass(frozen=True, kw_only=True)
class Challenge(Message):
    KIND = Kind.CHALLENGE
    nonce: bytes = _f(_blob(NONCE_BYTES))


@dataclass(frozen=True, kw_only=True)
class Auth(Message):
    KIND = Kind.AUTH
    mac: bytes = _f(_blob(0, MAC_BYTES))  # empty: the client has no secret


@dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    KIND = Kind.WELCOME
    worker_id: int = _f(_int(-1))
    mac: bytes = _f(_blob(0, MAC_BYTES))  # empty only from a server without a secret
    info: dict[str, Any] = _f(_map, factory=dict)


@dataclass(frozen=True, kw_only=True)
class Refuse(Message):
    KIND = Kind.REFUSE
    code: str = _f(_text(MAX_NAME))
    reason: str = _f(_text(MAX_TEXT))


@dataclass(frozen=True, kw_only=True)
class Assign(Message):
    KIND = Kind.ASSIGN
    group: int = _f(_int())
    address: str = _f(_text(MAX_TEXT))
    ratio: float = _f(_float(0.0, 1.0))
    staleness: int = _f(_int(-1))  # -1: no bound (ASP)


@dataclass(frozen=True, kw_only=True)
class Stats(Message):
    KIND = Kind.STATS
    clock: int = _f(_int())
    step_time: float = _f(_float(0.0))  # seconds per step
    loss: float = _f(_float())
    samples: int = _f(_int(), 0)


@dataclass(frozen=True, kw_only=True)
class Push(Message):
    KIND = Kind.PUSH
    clock: int = _f(_int())
    step_time: float = _f(_float(0.0), 0.0)
    loss: float = _f(_float(), 0.0)
    samples: int = _f(_int(), 0)
    encoding: str = _f(_text(MAX_NAME))  # meaning of buffers, defined by sparse.py
    codec: dict[str, Any] = _f(_map, factory=dict)
    buffers: tuple[Any, ...] = _f(_buffers, ())  # bytes-like; held as flat memoryviews


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    KIND = Kind.ACK
    clock: int = _f(_int())
    version: int = _f(_int(), 0)  # weights version after the push


@dataclass(frozen=True, kw_only=True)
class Pull(Message):
    KIND = Kind.PULL
    clock: int = _f(_int())
    since: int = _f(_int(-1), -1)  # -1: full weights, else a delta since that version


@dataclass(frozen=True, kw_only=True)
class Weights(Message):
    KIND = Kind.WEIGHTS
    version: int = _f(_int())
    encoding: str = _f(_text(MAX_NAME))
    codec: dict[str, Any] = _f(_map, factory=dict)
    buffers: tuple[Any, ...] = _f(_buffers, ())  # bytes-like; held as flat memoryviews
    done: bool = _f(_bool, False)
    info: dict[str, Any] = _f(_map, factory=dict)


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    KIND = Kind.HEARTBEAT
    seq: int = _f(_int(), 0)


@dataclass(frozen=True, kw_only=True)
class Leave(Message):
    KIND = Kind.LEAVE
    reason: str = _f(_text(MAX_TEXT), "")  # "done" from a server: training is over


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    KIND = Kind.ERROR
    code: str = _f(_text(MAX_NAME))
    reason: str = _f(_text(MAX_TEXT))


MESSAGE_TYPES: dict[Kind, type[Message]] = {
    cls.KIND: cls
    for cls in (Hello, Challenge, Auth, Welcome, Refuse, Assign, Stats, Push, Ack, Pull,
                Weights, Heartbeat, Leave, Error)
}
_META_KEYS = {k: frozenset(_meta_names(c)) for k, c in MESSAGE_TYPES.items()}
_KIND_OF = {int(k): k for k in Kind}  # faster than calling Kind(byte)
_ANY_VERSION = (Kind.HELLO, Kind.REFUSE, Kind.ERROR)  # layout frozen across versions


@dataclass(frozen=True)
class Limits:
    """Sizes a decoder accepts; over one of them it raises ``LimitExceeded`` before allocating."""

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


COALESCE_BYTES = 16 << 10  # smaller buffers are copied into the header write: fewer iovecs
_packer = msgpack.Packer(use_bin_type=True)  # reused: msgpack.packb builds one per call


def encode(msg: Message, *, compress: bool = False, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    """Frame ``msg`` as [prefix + table + meta (+ small buffers), big buffer, ...] for writelines.

    Buffers of 16 KiB or more are passed through as the caller's memoryviews (no copy): do not
    modify them until the bytes are sent. With ``compress`` a buffer of >= 4 KiB is
    lz4-compressed when that makes it smaller.
    """
    meta = _packer.pack(msg.meta())
    buffers: tuple[memoryview, ...] = msg.buffers if isinstance(msg, (Push, Weights)) else ()
    table, wires = bytearray(), []
    for buf in buffers:
        codec, wire = CODEC_RAW, buf
        if compress and buf.nbytes >= LZ4_MIN_BYTES:
            packed = lz4.block.compress(buf, store_size=False)
            if len(packed) < buf.nbytes:
                codec, wire = CODEC_LZ4, memoryview(packed)
        table += TABLE_ENTRY.pack(codec, len(wire), buf.nbytes)
        wires.append(wire)
    body_len = sum(map(len, wires))
    total = PREFIX.size + len(table) + len(meta) + body_len
    if total > limits.max_frame_bytes or len(meta) > limits.max_meta_bytes:
        raise LocalProtocolError("frame too large to send", expected=limits.max_frame_bytes,
                                 got=total)
    version = msg.version if isinstance(msg, Hello) else PROTOCOL_VERSION
    head = bytearray(PREFIX.pack(MAGIC, version, msg.KIND, len(buffers), 0, len(meta), body_len))
    head += table
    head += meta
    out: list[Any] = [head]
    for wire in wires:
        if len(wire) >= COALESCE_BYTES:
            out.append(wire)
        elif isinstance(out[-1], bytearray):
            out[-1] += wire
        else:
            out.append(bytearray(wire))
    return out


# ---------------------------------------------------------------------------------------------
# Decoding

Alloc = Callable[[Kind, int, int], Any]  # (kind, buffer index, nbytes) -> writable buffer
SCRATCH_BYTES = 256 << 10  # receive buffer for prefixes, maps and small frames
DIRECT_MIN_BYTES = 64 << 10  # a payload this large is received straight into its destination


def default_alloc(kind: Kind, index: int, nbytes: int) -> memoryview:
    """A fresh uninitialised uint8 array per buffer (np.empty does not zero it)."""
    return np.empty(nbytes, dtype=np.uint8).data


def _remote(msg: str, **data: Any) -> RemoteProtocolError:
    return RemoteProtocolError(msg, expected=data.get("expected"), got=data.get("got"))


def _check_limit(what: str, got: int, limit: int) -> None:
    if got > limit:
        raise LimitExceeded(f"{what} is {got}, over the limit of {limit}", expected=limit, got=got)


class _Partial:
    """A frame whose prefix was read: what is known so far and where its body goes."""

    __slots__ = ("version", "kind", "nbuf", "head_len", "body_len", "entries", "msg", "bufs",
                 "dest", "pos")

    def __init__(self, version: int, kind: Kind, nbuf: int, head_len: int, body_len: int) -> None:
        self.version, self.kind, self.nbuf = version, kind, nbuf
        self.head_len, self.body_len = head_len, body_len
        self.entries: list[tuple[int, int, int]] = []  # (codec, wire_len, raw_len) per buffer
        self.msg: Message | None = None  # built (buffers empty) once table + meta are read
        self.bufs: list[memoryview] = []
        self.dest: memoryview | None = None  # where the current buffer's bytes go
        self.pos = 0  # bytes of dest already filled


class FrameDecoder:
    """Bytes in, messages out. Feed it with ``feed(data)`` or, zero-copy, with ``get_buffer()``
    then ``buffer_updated(n)`` (the ``asyncio.BufferedProtocol`` pair).

    Payload buffers of 64 KiB or more are read by the caller straight into the memory ``alloc``
    returned. After a ``RemoteProtocolError`` the decoder stays failed (``error`` is set).
    """

    def __init__(self, *, alloc: Alloc | None = None, limits: Limits = DEFAULT_LIMITS) -> None:
        self._alloc = alloc or default_alloc
        self.limits = limits
        self._buf = bytearray(SCRATCH_BYTES)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0  # unread bytes are _buf[_lo:_hi]
        self._direct = False  # the last get_buffer() handed out the destination itself
        self._frame: _Partial | None = None
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
        if self.error is not None:
            raise self.error
        f = self._frame
        if f is not None and f.dest is not None and self._lo == self._hi:
            if f.dest.nbytes - f.pos >= DIRECT_MIN_BYTES:
                self._direct = True
                return f.dest[f.pos:]
        self._direct = False
        if self._lo == self._hi:
            self._lo = self._hi = 0
        need = f.head_len if f is not None and f.msg is None else PREFIX.size
        if len(self._buf) - self._hi < max(DIRECT_MIN_BYTES, need):
            self._compact(need)
        return self._view[self._hi:]

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
            while self._step(out):
                pass
        except RemoteProtocolError as e:
            self.error = e
            if not out:
                raise
        return out

    def _step(self, out: list[Message]) -> bool:
        """Advance by one stage if the bytes allow; False when more bytes are needed."""
        f = self._frame
        if f is None:
            if self._hi - self._lo < PREFIX.size:
                return False
            f = self._frame = self._read_prefix(self._view[self._lo:self._lo + PREFIX.size])
            self._lo += PREFIX.size
        if f.msg is None:
            if self._hi - self._lo < f.head_len:
                return False
            self._read_head(f, self._view[self._lo:self._lo + f.head_len])
            self._lo += f.head_len
        if f.nbuf and not (self._small_body(f) or self._fill_body(f)):
            return False
        assert f.msg is not None
        if f.bufs:  # fields were checked at head time; the views are flat "B" already
            object.__setattr__(f.msg, "buffers", tuple(f.bufs))
        out.append(f.msg)
        self._frame = None
        return True

    def _read_prefix(self, raw: memoryview) -> _Partial:
        magic, version, kind, nbuf, flags, meta_len, body_len = PREFIX.unpack(raw)
        if magic != MAGIC:
            raise _remote("bad magic: not a minips frame", expected=MAGIC, got=bytes(magic))
        if kind not in _KIND_OF:
            raise _remote(f"unknown message kind {kind}", got=kind)
        if version != PROTOCOL_VERSION and kind not in _ANY_VERSION:
            raise _remote(f"protocol version {version}", expected=PROTOCOL_VERSION, got=version)
        if flags != 0:
            raise _remote("reserved flags byte is not zero", expected=0, got=flags)
        lim = self.limits
        _check_limit("buffer count", nbuf, lim.max_buffers)
        _check_limit("msgpack header size", meta_len, lim.max_meta_bytes)
        head_len = TABLE_ENTRY.size * nbuf + meta_len
        _check_limit("frame size", PREFIX.size + head_len + body_len, lim.max_frame_bytes)
        return _Partial(version, _KIND_OF[kind], nbuf, head_len, body_len)

    def _read_head(self, f: _Partial, raw: memoryview) -> None:
        table_len = TABLE_ENTRY.size * f.nbuf
        if f.nbuf or f.body_len:
            f.entries = list(TABLE_ENTRY.iter_unpack(raw[:table_len]))
            self._check_table(f.entries, f.body_len)
        meta = self._unpack_meta(raw[table_len:])
        f.msg = _build(f.kind, f.version, meta, f.nbuf)

    def _check_table(self, entries: list[tuple[int, int, int]], body_len: int) -> None:
        for codec, wire, raw in entries:
            if codec not in (CODEC_RAW, CODEC_LZ4):
                raise _remote(f"unknown buffer codec {codec}", got=codec)
            if codec == CODEC_RAW and wire != raw:
                raise _remote("raw buffer with wire_len != raw_len", expected=wire, got=raw)
        wire_sum = sum(e[1] for e in entries)
        if wire_sum != body_len:
            raise _remote("buffer table does not add up to body_len", expected=body_len,
                          got=wire_sum)
        raw_sum = sum(e[2] for e in entries)
        _check_limit("decompressed frame size", raw_sum, self.limits.max_raw_bytes)

    def _unpack_meta(self, raw: memoryview) -> dict[str, Any]:
        lim = self.limits
        try:
            meta = msgpack.unpackb(
                raw, raw=False, strict_map_key=True, max_str_len=lim.max_str_len,
                max_bin_len=lim.max_bin_len, max_array_len=lim.max_array_len,
                max_map_len=lim.max_map_len, max_ext_len=0,
            )
        except Exception as e:  # msgpack raises several types (ExtraData, ValueError, ...)
            raise _remote(f"bad msgpack header: {type(e).__name__}: {e}") from None
        if not isinstance(meta, dict):
            raise _remote("msgpack header is not a map", got=type(meta).__name__)
        return meta

    def _small_body(self, f: _Partial) -> bool:
        """Fast path: a small raw body already in scratch becomes one copy, buffers view into it."""
        if (f.bufs or f.dest is not None or f.body_len >= DIRECT_MIN_BYTES
                or self._hi - self._lo < f.body_len or self._alloc is not default_alloc
                or any(codec != CODEC_RAW for codec, _, _ in f.entries)):
            return False
        body = memoryview(bytearray(self._view[self._lo:self._lo + f.body_len]))
        self._lo += f.body_len
        at = 0
        for _, wire, _ in f.entries:
            f.bufs.append(body[at:at + wire])
            at += wire
        return True

    def _fill_body(self, f: _Partial) -> bool:
        """Copy what scratch holds into the current buffer(s); True once every buffer is done."""
        while len(f.bufs) < f.nbuf:
            if f.dest is None:
                self._open_buffer(f)
            assert f.dest is not None
            take = min(f.dest.nbytes - f.pos, self._hi - self._lo)
            if take:
                f.dest[f.pos:f.pos + take] = self._view[self._lo:self._lo + take]
                f.pos += take
                self._lo += take
            if f.pos < f.dest.nbytes:
                return False
            self._close_buffer(f)
        return True

    def _open_buffer(self, f: _Partial) -> None:
        codec, wire, raw = f.entries[len(f.bufs)]
        f.pos = 0
        if codec == CODEC_LZ4:  # compressed bytes land in a temporary, decompressed on close
            f.dest = np.empty(wire, dtype=np.uint8).data
        else:
            f.dest = self._allocate(f.kind, len(f.bufs), raw)

    def _allocate(self, kind: Kind, index: int, nbytes: int) -> memoryview:
        view = memoryview(self._alloc(kind, index, nbytes)).cast("B")
        if view.readonly or view.nbytes < nbytes:
            raise LocalProtocolError("alloc returned a read-only or short buffer", expected=nbytes,
                                     got=view.nbytes)
        return view[:nbytes]

    def _close_buffer(self, f: _Partial) -> None:
        codec, wire, raw = f.entries[len(f.bufs)]
        assert f.dest is not None
        buf = f.dest
        if codec == CODEC_LZ4:
            try:
                data = lz4.block.decompress(f.dest, uncompressed_size=raw)
            except Exception as e:  # lz4.block.LZ4BlockError and friends
                raise _remote(f"bad lz4 buffer: {e}") from None
            if len(data) != raw:
                raise _remote("lz4 buffer has the wrong size", expected=raw, got=len(data))
            buf = self._allocate(f.kind, len(f.bufs), raw)
            buf[:] = data
        f.bufs.append(buf)
        f.dest, f.pos = None, 0


def _build(kind: Kind, version: int, meta: dict[str, Any], nbuf: int) -> Message:
    """The message of a frame from its map (buffers still empty); peer mistakes become remote."""
    cls = MESSAGE_TYPES[kind]
    if meta.keys() != _META_KEYS[kind]:
        raise _remote(f"{kind.name} header map has the wrong keys",
                      expected=sorted(_META_KEYS[kind]), got=sorted(map(str, meta)))
    if nbuf and kind not in (Kind.PUSH, Kind.WEIGHTS):
        raise _remote(f"{kind.name} carries no buffers", expected=0, got=nbuf)
    extra = {"version": version} if kind == Kind.HELLO else {}
    try:
        return cls(**meta, **extra)
    except LocalProtocolError as e:
        raise _remote(f"invalid {kind.name}: {e}", expected=e.expected, got=e.got) from None


# ---------------------------------------------------------------------------------------------
# Connection state


# IntEnum rather than Enum: Enum hashes in Python, and TRANSITIONS is looked up per message.
class Side(IntEnum):
    CLIENT = 0  # opened the TCP connection
    SERVER = 1  # accepted it


class State(IntEnum):
    START = 0  # nothing has passed yet; the client owes HELLO
    HELLO = 1  # HELLO passed; the server owes CHALLENGE (or REFUSE)
    CHALLENGE = 2  # CHALLENGE passed; the client owes AUTH
    AUTH = 3  # AUTH passed; the server owes WELCOME (or REFUSE)
    OPEN = 4  # handshake done; data messages flow, each in its direction
    CLOSED = 5  # REFUSE or ERROR passed; nothing more may be sent or received


_C, _S = Side.CLIENT, Side.SERVER
# (sender, state, kind) -> next state. ERROR is allowed from either side in any state but CLOSED.
TRANSITIONS: dict[tuple[Side, State, Kind], State] = {
    (_C, State.START, Kind.HELLO): State.HELLO,
    (_S, State.HELLO, Kind.CHALLENGE): State.CHALLENGE,
    (_S, State.HELLO, Kind.REFUSE): State.CLOSED,
    (_C, State.CHALLENGE, Kind.AUTH): State.AUTH,
    (_S, State.AUTH, Kind.WELCOME): State.OPEN,
    (_S, State.AUTH, Kind.REFUSE): State.CLOSED,
    **{(_C, State.OPEN, k): State.OPEN for k in (Kind.STATS, Kind.PUSH, Kind.PULL)},
    **{(_S, State.OPEN, k): State.OPEN for k in (Kind.ASSIGN, Kind.ACK, Kind.WEIGHTS)},
    **{(s, State.OPEN, k): State.OPEN for s in Side for k in (Kind.HEARTBEAT, Kind.LEAVE)},
    **{(s, st, Kind.ERROR): State.CLOSED for s in Side for st in State if st != State.CLOSED},
}


class Connection:
    """One side of a connection: checks every message sent or received against ``TRANSITIONS``.

    Our own out-of-order message raises ``LocalProtocolError``; the peer's raises
    ``RemoteProtocolError``. ``decoder`` is exposed for the zero-copy receive path.
    """

    def __init__(self, side: Side, *, alloc: Alloc | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.side = side
        self.peer = _S if side == _C else _C
        self.state = State.START
        self.limits = limits
        self.decoder = FrameDecoder(alloc=alloc, limits=limits)

    def send(self, msg: Message, *, compress: bool = False) -> list[Any]:
        """Check that we may send ``msg`` now, advance the state, return its frame buffers."""
        self._advance(self.side, msg.KIND)
        return encode(msg, compress=compress, limits=self.limits)

    def receive(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Feed bytes from the peer; return the messages they complete, state-checked."""
        return self.received(self.decoder.feed(data))

    def received(self, msgs: list[Message]) -> list[Message]:
        """State-check messages the decoder produced (zero-copy path); return them."""
        for msg in msgs:
            self._advance(self.peer, msg.KIND)
        return msgs

    def _advance(self, sender: Side, kind: Kind) -> None:
        nxt = TRANSITIONS.get((sender, self.state, kind))
        if nxt is None:
            allowed = sorted(k.name for (s, st, k) in TRANSITIONS
                             if s == sender and st == self.state)
            err = LocalProtocolError if sender == self.side else RemoteProtocolError
            raise err(f"{sender.name.lower()} may not send {kind.name} in state "
                      f"{self.state.name}",
                      expected=allowed, got=kind.name)
        self.state = nxt


# ---------------------------------------------------------------------------------------------
# Handshake: HELLO -> CHALLENGE -> AUTH -> WELCOME | REFUSE, HMAC-SHA256 over the transcript.

CLIENT_LABEL = b"minips-client-v1\x00"
SERVER_LABEL = b"minips-server-v1\x00"


def new_nonce() -> bytes:
    """32 fresh random bytes (a replayed handshake fails because the other side's nonce changed)."""
    return secrets.token_bytes(NONCE_BYTES)


def _key(token: str | bytes | None) -> bytes | None:
    if token is None or token in ("", b""):
        return None
    return token.encode() if isinstance(token, str) else bytes(token)


def make_mac(token: str | bytes, label: bytes, hello: Hello, server_nonce: bytes) -> bytes:
    """HMAC-SHA256(token, label | version u8 | len(role) u8 | role | worker_id i64 LE
    | client nonce | server nonce). The secret itself never crosses the wire."""
    role = hello.role.encode()
    transcript = b"".join([label, bytes([hello.version, len(role)]), role,
                           struct.pack("<q", hello.worker_id), hello.nonce, server_nonce])
    key = _key(token)
    if key is None:
        raise LocalProtocolError("make_mac needs a non-empty token")
    return hmac.new(key, transcript, hashlib.sha256).digest()


class ClientHandshake:
    """The client's half: build HELLO, answer CHALLENGE with AUTH, verify WELCOME's MAC."""

    def __init__(self, token: str | bytes | None, *, nonce: bytes | None = None, **hello: Any):
        self.token = _key(token)
        self.hello = Hello(nonce=nonce or new_nonce(), **hello)
        self._server_nonce = b""

    def on_challenge(self, ch: Challenge) -> Auth:
        self._server_nonce = ch.nonce
        if self.token is None:
            return Auth(mac=b"")
        return Auth(mac=make_mac(self.token, CLIENT_LABEL, self.hello, ch.nonce))

    def on_reply(self, msg: Message) -> Welcome:
        """WELCOME -> itself (after checking the server's MAC); REFUSE or ERROR -> AuthError."""
        if isinstance(msg, (Refuse, Error)):
            raise AuthError(f"refused by server ({msg.code}): {msg.reason}")
        if not isinstance(msg, Welcome):
            raise _remote("expected WELCOME or REFUSE", expected="WELCOME", got=msg.KIND.name)
        if self.token is not None:
            want = make_mac(self.token, SERVER_LABEL, self.hello, self._server_nonce)
            if not hmac.compare_digest(msg.mac, want):
                raise AuthError("the server failed to prove the shared secret (wrong token?)")
        return msg


class ServerHandshake:
    """The server's half: check HELLO's version, send CHALLENGE, check AUTH, build WELCOME."""

    def __init__(self, token: str | bytes | None, *, nonce: bytes | None = None) -> None:
        self.token = _key(token)
        self.nonce = nonce or new_nonce()
        self.hello: Hello | None = None

    def on_hello(self, hello: Hello) -> Challenge | Refuse:
        self.hello = hello
        if hello.version != PROTOCOL_VERSION:
            return Refuse(code="version", reason=f"protocol version mismatch: server speaks "
                          f"{PROTOCOL_VERSION}, client sent {hello.version}")
        return Challenge(nonce=self.nonce)

    def on_auth(self, auth: Auth) -> Refuse | None:
        """None when the client proved the secret (or the server has none)."""
        if self.token is None:
            return None
        if not auth.mac:
            return Refuse(code="auth", reason="missing token: this server requires a shared "
                          "secret (set MINIPS_TOKEN)")
        assert self.hello is not None
        want = make_mac(self.token, CLIENT_LABEL, self.hello, self.nonce)
        if not hmac.compare_digest(auth.mac, want):
            return Refuse(code="auth", reason="wrong token: HMAC check failed")
        return None

    def welcome(self, worker_id: int, info: dict[str, Any]) -> Welcome:
        assert self.hello is not None
        if self.token is None:
            return Welcome(worker_id=worker_id, mac=b"", info=info)
        mac = make_mac(self.token, SERVER_LABEL, self.hello, self.nonce)
        return Welcome(worker_id=worker_id, mac=mac, info=info)
