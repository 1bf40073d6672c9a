"""minips messages: the kinds and one frozen dataclass per kind, each field with its check.

No networking, no clocks, no framing here: a message is a value that knows whether it is valid.
``fields.py`` holds the checks, ``frames.py`` turns messages into bytes and back;
docs/protocol.md, section 3, lists every field.

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
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.fields import (
    MAX_BUFFERS,
    MAX_INT,
    MAX_NAME,
    MAX_TEXT,
    Check,
    Invalid,
    blob,
    boolean,
    integer,
    mapping,
    names,
    number,
    text,
    views,
)

__all__ = [
    "PROTOCOL_VERSION", "NONCE_BYTES", "MAC_BYTES", "MAX_BUFFERS", "MAX_TEXT", "MAX_NAME",
    "MAX_INT", "ROLES", "Kind", "Message", "Hello", "Challenge", "Auth", "Welcome", "Refuse",
    "Assign", "Stats", "Push", "Ack", "Pull", "Weights", "Heartbeat", "Leave", "Error",
    "MESSAGE_TYPES", "WITH_BUFFERS", "meta_keys", "from_wire",
]

PROTOCOL_VERSION = 2  # 2: WEIGHTS.since (a sparse update of a held copy, docs/protocol.md)
NONCE_BYTES = 32  # fresh random bytes per handshake side, so a recorded handshake cannot replay
MAC_BYTES = 32  # HMAC-SHA256 digest
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
            except Invalid as e:
                where = f"{type(self).__name__}.{name}"
                raise LocalProtocolError(f"{where}: {e}", expected=str(e), got=value) from None

    def meta(self) -> dict[str, Any]:
        """The msgpack map of this message: every field except ``buffers`` and HELLO's version."""
        values = self.__dict__
        return {name: values[name] for name in _SCHEMAS[type(self)].meta}


@dataclass(frozen=True)
class _Schema:
    """What the code needs of a class's fields, computed once (dataclasses.fields() is slow)."""

    # (field, check, type, lo, hi) in declaration order; a value of exactly that type within
    # [lo, hi] is valid without calling check (numbers only; type None for other fields)
    checks: tuple[tuple[str, Check, Any, Any, Any], ...]
    wire_checks: tuple[tuple[str, Check, Any, Any, Any], ...]  # those of the map's fields
    meta: tuple[str, ...]  # the fields in the msgpack map, in order
    meta_set: frozenset[str]


class _Schemas(dict[type, _Schema]):
    """class -> _Schema, computed on first use; a hit is a plain dict lookup (no Python call)."""

    def __missing__(self, cls: type[Message]) -> _Schema:
        fields = dataclasses.fields(cls)
        meta = tuple(f.name for f in fields if f.name not in cls.NOT_IN_META)
        checks = tuple((f.name, f.metadata["check"], *getattr(f.metadata["check"], "fast",
                                                               (None, 0, 0))) for f in fields)
        wire_checks = tuple(c for c in checks if c[0] in meta)
        schema = self[cls] = _Schema(checks, wire_checks, meta, frozenset(meta))
        return schema


_SCHEMAS = _Schemas()


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Client opens a session. ``version`` travels in the frame prefix, not in the map."""

    KIND = Kind.HELLO
    NOT_IN_META = ("buffers", "version")
    version: int = _f(integer(0, 255), PROTOCOL_VERSION)
    role: str = _f(text(MAX_NAME, ROLES), "worker")
    worker_id: int = _f(integer(-1), -1)  # -1: let the server choose
    nonce: bytes = _f(blob(NONCE_BYTES))
    capabilities: tuple[str, ...] = _f(names, ())
    address: str = _f(text(MAX_TEXT), "")  # "host:port" a group server accepts workers on
    group: int = _f(integer(-1), -1)  # -1: none


@dataclass(frozen=True, kw_only=True)
class Challenge(Message):
    KIND = Kind.CHALLENGE
    nonce: bytes = _f(blob(NONCE_BYTES))


@dataclass(frozen=True, kw_only=True)
class Auth(Message):
    KIND = Kind.AUTH
    mac: bytes = _f(blob(0, MAC_BYTES))  # empty: the client has no secret


@dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    KIND = Kind.WELCOME
    worker_id: int = _f(integer(-1))
    mac: bytes = _f(blob(0, MAC_BYTES))  # empty only from a server without a secret
    info: dict[str, Any] = _f(mapping, factory=dict)


@dataclass(frozen=True, kw_only=True)
class Refuse(Message):
    KIND = Kind.REFUSE
    code: str = _f(text(MAX_NAME))
    reason: str = _f(text(MAX_TEXT))


@dataclass(frozen=True, kw_only=True)
class Assign(Message):
    KIND = Kind.ASSIGN
    group: int = _f(integer())
    address: str = _f(text(MAX_TEXT))
    ratio: float = _f(number(0.0, 1.0))
    staleness: int = _f(integer(-1))  # -1: no bound (ASP)


@dataclass(frozen=True, kw_only=True)
class Stats(Message):
    KIND = Kind.STATS
    clock: int = _f(integer())
    step_time: float = _f(number(0.0))  # seconds per step
    loss: float = _f(number())
    samples: int = _f(integer(), 0)


@dataclass(frozen=True, kw_only=True)
class Push(Message):
    KIND = Kind.PUSH
    clock: int = _f(integer())
    step_time: float = _f(number(0.0), 0.0)
    loss: float = _f(number(), 0.0)
    samples: int = _f(integer(), 0)
    encoding: str = _f(text(MAX_NAME))  # meaning of buffers, defined by sparse.py
    codec: dict[str, Any] = _f(mapping, factory=dict)
    buffers: tuple[Any, ...] = _f(views, ())  # bytes-like; held as flat memoryviews


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    KIND = Kind.ACK
    clock: int = _f(integer())
    version: int = _f(integer(), 0)  # weights version after the push


@dataclass(frozen=True, kw_only=True)
class Pull(Message):
    KIND = Kind.PULL
    clock: int = _f(integer())
    since: int = _f(integer(-1), -1)  # version of the weights the client holds; -1: none


@dataclass(frozen=True, kw_only=True)
class Weights(Message):
    """``since`` -1: the buffers are the whole weights at ``version``; else they name the
    coordinates that changed from version ``since`` to ``version`` with their new values."""

    KIND = Kind.WEIGHTS
    version: int = _f(integer())
    since: int = _f(integer(-1), -1)  # -1: whole weights; else an update of the copy at since
    encoding: str = _f(text(MAX_NAME))
    codec: dict[str, Any] = _f(mapping, factory=dict)
    buffers: tuple[Any, ...] = _f(views, ())  # bytes-like; held as flat memoryviews
    done: bool = _f(boolean, False)
    info: dict[str, Any] = _f(mapping, factory=dict)


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    KIND = Kind.HEARTBEAT
    seq: int = _f(integer(), 0)


@dataclass(frozen=True, kw_only=True)
class Leave(Message):
    KIND = Kind.LEAVE
    reason: str = _f(text(MAX_TEXT), "")  # "done" from a server: training is over


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    KIND = Kind.ERROR
    code: str = _f(text(MAX_NAME))
    reason: str = _f(text(MAX_TEXT))


MESSAGE_TYPES: dict[int, type[Message]] = {  # Kind (an int) -> class
    cls.KIND: cls
    for cls in (Hello, Challenge, Auth, Welcome, Refuse, Assign, Stats, Push, Ack, Pull,
                Weights, Heartbeat, Leave, Error)
}
WITH_BUFFERS = frozenset({Kind.PUSH, Kind.WEIGHTS})  # the kinds whose frames carry buffers


def meta_keys(kind: Kind) -> tuple[str, ...]:
    """The keys of ``kind``'s msgpack map, in the order they are sent."""
    return _SCHEMAS[MESSAGE_TYPES[kind]].meta



def from_wire(kind: int, version: int, meta: dict[str, Any], nbuf: int) -> Message:
    """The message of a frame from its map (buffers still empty); a peer's mistake is remote.

    Same checks as the constructor, without its keyword-argument parsing: the map must hold
    exactly the kind's keys, so every field is present and checked once. HELLO's version (a
    byte of the prefix) and the buffers (views the decoder made) need no check. ``kind`` is
    the prefix's byte (a ``Kind`` or its int).
    """
    cls = MESSAGE_TYPES[kind]
    schema = _SCHEMAS[cls]
    if meta.keys() != schema.meta_set:
        raise RemoteProtocolError(f"{cls.KIND.name} header map has the wrong keys",
                                  expected=sorted(schema.meta), got=sorted(map(str, meta)))
    if nbuf and kind not in WITH_BUFFERS:
        raise RemoteProtocolError(f"{cls.KIND.name} carries no buffers", expected=0, got=nbuf)
    for name, check, typ, lo, hi in schema.wire_checks:
        value = meta[name]
        if type(value) is typ and lo <= value <= hi:
            continue
        try:
            meta[name] = check(value)
        except Invalid as e:
            raise RemoteProtocolError(f"invalid {cls.KIND.name}: {cls.__name__}.{name}: {e}",
                                      expected=str(e), got=meta[name]) from None
    if kind in WITH_BUFFERS:
        meta["buffers"] = ()  # the decoder sets the received buffers when the body is in
    elif cls is Hello:
        meta["version"] = version
    msg = cls.__new__(cls)
    object.__setattr__(msg, "__dict__", meta)  # the checked map becomes the fields, no copy
    return msg
