"""minips messages of the worker <-> server conversation, and how a peer's map becomes one.

No networking, no clocks, no framing here: a message is a value that knows whether it is valid.
``message_base.py`` holds ``Kind`` and the ``Message`` base class, ``fields.py`` the checks,
``global_messages.py`` the kinds of the global server's conversations with group processes and
evaluators, ``frames.py`` turns messages into bytes and back; docs/protocol.md, section 3,
lists every field.

Invariants:
- ``from_wire`` runs the same checks as a constructor on a map a peer sent
  (``RemoteProtocolError``). Checks cost time in proportion to the fields and values present.
- Each message's msgpack map holds exactly ``meta_keys(kind)``: every field except ``buffers``
  and HELLO's ``version`` (which travels in the frame prefix), in declaration order.
- Only the kinds in ``WITH_BUFFERS`` carry buffers (a vector payload: ``encoding``, ``codec``,
  ``buffers``, sparse_codec.py); they are held as flat ``memoryview``s, never copied.

Public API: ``PROTOCOL_VERSION``, ``Kind``, ``Message`` and the 18 message classes,
``MESSAGE_TYPES``, ``WITH_BUFFERS``, ``ROLES``, field limits (``NONCE_BYTES``, ``MAC_BYTES``,
``MAX_BUFFERS``, ``MAX_TEXT``, ``MAX_NAME``, ``MAX_INT``), ``meta_keys(kind)``,
``from_wire(kind, version, meta, nbuf)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minips.errors import RemoteProtocolError
from minips.wire.fields import (
    MAX_BUFFERS,
    MAX_INT,
    MAX_NAME,
    MAX_TEXT,
    Invalid,
    blob,
    boolean,
    integer,
    ints,
    mapping,
    names,
    number,
    text,
    vector_codec,
    views,
)
from minips.wire.global_messages import Exchange, ExchangeReply, GlobalWeights, InitWeights
from minips.wire.message_base import (
    MAC_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ROLES,
    SCHEMAS,
    Kind,
    Message,
    Reported,
)
from minips.wire.message_base import checked as _f

__all__ = [
    "PROTOCOL_VERSION", "NONCE_BYTES", "MAC_BYTES", "MAX_BUFFERS", "MAX_TEXT", "MAX_NAME",
    "MAX_INT", "ROLES", "Kind", "Message", "Hello", "Challenge", "Auth", "Welcome", "Refuse",
    "Assign", "Stats", "Push", "Ack", "Pull", "Weights", "Heartbeat", "Leave", "Error",
    "Exchange", "ExchangeReply", "GlobalWeights", "InitWeights",
    "MESSAGE_TYPES", "WITH_BUFFERS", "meta_keys", "from_wire",
]

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
    encoding: str = _f(text(MAX_NAME))  # the vector payload: sparse_codec.py
    codec: dict[str, Any] = _f(vector_codec, factory=dict)
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
class Weights(Reported):
    """A group server's answer to a worker's PULL. ``since`` -1: the buffers are the whole
    weights at ``version``; else they name the coordinates that changed from version ``since``
    to ``version`` with their new values. The rest says where the worker stands."""

    KIND = Kind.WEIGHTS
    INFO = ("group", "waited_for", "ratio", "lead", "min_clock", "drift")
    version: int = _f(integer())
    since: int = _f(integer(-1), -1)  # -1: whole weights; else an update of the copy at since
    encoding: str = _f(text(MAX_NAME))
    codec: dict[str, Any] = _f(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = _f(views, ())  # bytes-like; held as flat memoryviews
    done: bool = _f(boolean, False)
    group: int = _f(integer(-1), -1)  # the group server's group
    waited_for: list[int] = _f(ints(), factory=list)  # the workers the answer waited for
    ratio: float = _f(number(0.0, 1.0), 1.0)  # the group's upload ratio (GDTopK)
    lead: int = _f(integer(-MAX_INT), 0)  # steps ahead of the group's slowest worker
    min_clock: int = _f(integer(-1), -1)  # the group's lowest live clock; -1: none
    drift: float = _f(number(-1.0), -1.0)  # compressed downlink: |sent - weights|; -1: dense

    @property
    def info(self) -> dict[str, Any]:
        """The counters for a worker's record (``drift`` only with a compressed downlink)."""
        out = super().info
        if out["drift"] < 0:
            del out["drift"]
        return out


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
                Weights, Heartbeat, Leave, Error, Exchange, ExchangeReply, GlobalWeights,
                InitWeights)
}
WITH_BUFFERS = frozenset(  # frames that carry buffers: the kinds with a vector payload
    kind for kind, cls in MESSAGE_TYPES.items() if "buffers" in cls.__dataclass_fields__)


def meta_keys(kind: Kind) -> tuple[str, ...]:
    """The keys of ``kind``'s msgpack map, in the order they are sent."""
    return SCHEMAS[MESSAGE_TYPES[kind]].meta


def from_wire(kind: int, version: int, meta: dict[str, Any], nbuf: int) -> Message:
    """The message of a frame from its map (buffers still empty); a peer's mistake is remote.

    Same checks as the constructor, without its keyword-argument parsing: the map must hold
    exactly the kind's keys, so every field is present and checked once. HELLO's version (a
    byte of the prefix) and the buffers (views the decoder made) need no check. ``kind`` is
    the prefix's byte (a ``Kind`` or its int).
    """
    cls = MESSAGE_TYPES[kind]
    schema = SCHEMAS[cls]
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
