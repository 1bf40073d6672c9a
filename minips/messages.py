"""minips messages: the kinds, one frozen dataclass per kind, and the checks on their fields.

No networking, no clocks, no framing here: a message is a value that knows whether it is valid.
``frames.py`` turns messages into bytes and back; docs/protocol.md, section 3, lists every field.

Invariants:
- A ``Message`` never exists with an invalid field: ``__post_init__`` runs every field's check
  (a bad value raises ``LocalProtocolError``), and ``from_wire`` runs the same checks on a map a
  peer sent (``RemoteProtocolError``). Checks cost time in proportion to the fields and values
  present; a check may normalise a value (bytes-like -> bytes, buffers -> flat "B" memoryviews).
- Each message's msgpack map holds exactly ``meta_keys(kind)``: every field except ``buffers``
  and HELLO's ``version`` (which travels in the frame prefix), in declaration order.
- Only PUSH and WEIGHTS carry buffers; they are held as flat ``memoryview``s, never copied.

Public API: ``PROTOCOL_VERSION``, ``Kind``, ``Message`` and the 14 message classes,
``MESSAGE_TYPES``, ``ROLES``, field limits (``NONCE_BYTES``, ``MAC_BYTES``, ``MAX_BUFFERS``,
``MAX_TEXT``, ``MAX_NAME``, ``MAX_INT``), ``meta_keys(kind)``, ``from_wire(kind, version, meta,
nbuf)``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

from minips.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "PROTOCOL_VERSION", "NONCE_BYTES", "MAC_BYTES", "MAX_BUFFERS", "MAX_TEXT", "MAX_NAME",
    "MAX_INT", "ROLES", "Kind", "Message", "Hello", "Challenge", "Auth", "Welcome", "Refuse",
    "Assign", "Stats", "Push", "Ack", "Pull", "Weights", "Heartbeat", "Leave", "Error",
    "MESSAGE_TYPES", "WITH_BUFFERS", "meta_keys", "from_wire",
]

PROTOCOL_VERSION = 1
NONCE_BYTES = 32  # fresh random bytes per handshake side, so a recorded handshake cannot replay
MAC_BYTES = 32  # HMAC-SHA256 digest
MAX_BUFFERS = 16  # raw buffers per frame; sparse packets use 2-3
MAX_TEXT = 4096  # characters of a free-text field (reason, address)
MAX_NAME = 64  # characters of a name field (role, code, encoding, capability)
MAX_INT = 2**63 - 1  # ints are signed 64-bit on the wire
MAX_DEPTH = 8  # nesting of lists/maps inside a map field
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
# Field checks: each returns the (normalised) value or raises _Invalid(what was expected).


class _Invalid(Exception):
    pass


Check = Callable[[Any], Any]


def _int(lo: int = 0, hi: int = MAX_INT) -> Check:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:  # type() is: bool is not an int here
            raise _Invalid(f"expected an int in [{lo}, {hi}]")
        return v

    check.fast = (int, lo, hi)  # type: ignore[attr-defined]
    return check


def _float(lo: float = -math.inf, hi: float = math.inf) -> Check:
    def check(v: Any) -> float:
        t = type(v)
        if t is float:
            if lo <= v <= hi and v - v == 0.0:  # v - v is nan for inf and nan: finite only
                return v
        elif t is int and lo <= v <= hi:
            return float(v)
        raise _Invalid(f"expected a finite number in [{lo}, {hi}]")

    # finite bounds for the fast path: inf and nan fail them and go through check()
    fast = (float, max(lo, -sys.float_info.max), min(hi, sys.float_info.max))
    check.fast = fast  # type: ignore[attr-defined]
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
        if type(v) is bytes and len(v) in sizes:
            return v
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
    name = _text(MAX_NAME)
    return tuple([name(x) for x in v])


_PRIMITIVES = frozenset({type(None), bool, int, float, str, bytes})


def _tree(v: Any, depth: int) -> None:
    """Check (without copying) that a list or map holds only primitives, lists/tuples and maps
    with str keys, at most ``depth`` deep. Tuples come back from the wire as lists."""
    if depth <= 0:
        raise _Invalid("nested too deep")
    if isinstance(v, dict):
        for k, x in v.items():
            if type(k) is not str:
                raise _Invalid("map keys must be str")
            if type(x) not in _PRIMITIVES:
                _tree(x, depth - 1)
    elif isinstance(v, (list, tuple)):
        for x in v:
            if type(x) not in _PRIMITIVES:
                _tree(x, depth - 1)
    else:
        raise _Invalid(f"unsupported value of type {type(v).__name__}")


def _map(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _Invalid("expected a map")
    _tree(v, MAX_DEPTH)
    return v


def _flat(b: Any) -> memoryview:
    if type(b) is memoryview and b.format == "B" and b.ndim == 1 and b.c_contiguous:
        return b  # already what we hold (every decoded buffer is one)
    return memoryview(b).cast("B")  # cast() refuses non-contiguous arrays instead of copying


def _buffers(v: Any) -> tuple[memoryview, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_BUFFERS:
        raise _Invalid(f"expected a tuple of <= {MAX_BUFFERS} buffers")
    try:
        return tuple([_flat(b) for b in v])
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
        values = self.__dict__  # frozen: normalised values are written straight into __dict__
        for name, check, typ, lo, hi in _SCHEMAS[type(self)].checks:
            value = values[name]
            if type(value) is typ and lo <= value <= hi:
                continue  # a number within its bounds: valid as it is (the common case)
            try:
                values[name] = check(value)
            except _Invalid as e:
                where = f"{type(self).__name__}.{name}"
                raise LocalProtocolError(f"{where}: {e}", expected=str(e), got=value) from None

    def meta(self) -> dict[str, Any]:
        """The msgpack map of this message: every field except ``buffers`` and HELLO's version."""
        schema = _SCHEMAS[type(self)]
        return dict(zip(schema.meta, schema.values(self.__dict__), strict=True))


@dataclass(frozen=True)
class _Schema:
    """What the code needs of a class's fields, computed once (dataclasses.fields() is slow)."""

    # (field, check, type, lo, hi) in declaration order; a value of exactly that type within
    # [lo, hi] is valid without calling check (numbers only; type None for other fields)
    checks: tuple[tuple[str, Check, Any, Any, Any], ...]
    wire_checks: tuple[tuple[str, Check, Any, Any, Any], ...]  # those of the map's fields
    meta: tuple[str, ...]  # the fields in the msgpack map, in order
    meta_set: frozenset[str]
    values: Callable[[dict[str, Any]], tuple[Any, ...]]  # __dict__ -> values of meta, in order


def _one(name: str) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """What itemgetter(name) would be if it returned a 1-tuple."""
    return lambda values: (values[name],)


class _Schemas(dict[type, _Schema]):
    """class -> _Schema, computed on first use; a hit is a plain dict lookup (no Python call)."""

    def __missing__(self, cls: type[Message]) -> _Schema:
        fields = dataclasses.fields(cls)
        meta = tuple(f.name for f in fields if f.name not in cls.NOT_IN_META)
        checks = tuple((f.name, f.metadata["check"], *getattr(f.metadata["check"], "fast",
                                                               (None, 0, 0))) for f in fields)
        wire_checks = tuple(c for c in checks if c[0] in meta)
        values = operator.itemgetter(*meta) if len(meta) > 1 else _one(meta[0])
        schema = self[cls] = _Schema(checks, wire_checks, meta, frozenset(meta), values)
        return schema


_SCHEMAS = _Schemas()


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
WITH_BUFFERS = frozenset({Kind.PUSH, Kind.WEIGHTS})  # the kinds whose frames carry buffers


def meta_keys(kind: Kind) -> tuple[str, ...]:
    """The keys of ``kind``'s msgpack map, in the order they are sent."""
    return _SCHEMAS[MESSAGE_TYPES[kind]].meta


def _remote(msg: str, **data: Any) -> RemoteProtocolError:
    return RemoteProtocolError(msg, expected=data.get("expected"), got=data.get("got"))


def from_wire(kind: Kind, version: int, meta: dict[str, Any], nbuf: int) -> Message:
    """The message of a frame from its map (buffers still empty); a peer's mistake is remote.

    Same checks as the constructor, without its keyword-argument parsing: the map must hold
    exactly the kind's keys, so every field is present and checked once. HELLO's version (a
    byte of the prefix) and the buffers (views the decoder made) need no check.
    """
    cls = MESSAGE_TYPES[kind]
    schema = _SCHEMAS[cls]
    if meta.keys() != schema.meta_set:
        raise _remote(f"{kind.name} header map has the wrong keys",
                      expected=sorted(schema.meta), got=sorted(map(str, meta)))
    if nbuf and kind not in WITH_BUFFERS:
        raise _remote(f"{kind.name} carries no buffers", expected=0, got=nbuf)
    for name, check, typ, lo, hi in schema.wire_checks:
        value = meta[name]
        if type(value) is typ and lo <= value <= hi:
            continue
        try:
            meta[name] = check(value)
        except _Invalid as e:
            raise _remote(f"invalid {kind.name}: {cls.__name__}.{name}: {e}", expected=str(e),
                          got=meta[name]) from None
    if kind == Kind.HELLO:
        meta["version"] = version
    elif kind in WITH_BUFFERS:
        meta["buffers"] = ()  # the decoder sets the received buffers when the body is in
    msg = cls.__new__(cls)
    msg.__dict__.update(meta)
    return msg
