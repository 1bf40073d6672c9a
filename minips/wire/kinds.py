"""The table of message kinds, sans-IO: which class a frame's kind byte names, which kinds carry
buffers, and how a peer's msgpack map becomes a message (``from_wire``) with the same checks a
constructor runs.

``messages.py`` holds the kinds of the training step and the global server's conversations,
``control.py`` the handshake and control messages; ``frames.py`` and ``receive.py`` decode
through this table.

Invariants:
- ``from_wire`` runs the same checks as a constructor on a map a peer sent
  (``RemoteProtocolError``); the map must hold exactly ``meta_keys(kind)``.
- Only the kinds in ``WITH_BUFFERS`` carry buffers: their one vector ``payload`` goes as
  ``encoding`` and ``codec`` in the map, and the decoder puts the received buffers in with
  ``with_buffers``.
"""

from __future__ import annotations

from typing import Any

from minips.errors import RemoteProtocolError
from minips.wire.control import (
    Assign,
    Auth,
    Challenge,
    Error,
    Heartbeat,
    Hello,
    Leave,
    Refuse,
    Score,
    Stats,
    Welcome,
)
from minips.wire.fields import SCHEMAS, Invalid, Payload
from minips.wire.messages import (
    Ack,
    Exchange,
    ExchangeReply,
    GlobalWeights,
    InitWeights,
    Kind,
    Message,
    Pull,
    Push,
    Weights,
)

__all__ = ["MESSAGE_TYPES", "WITH_BUFFERS", "meta_keys", "from_wire", "with_buffers"]


MESSAGE_TYPES: dict[int, type[Message]] = {  # Kind (an int) -> class
    cls.KIND: cls
    for cls in (Hello, Challenge, Auth, Welcome, Refuse, Assign, Stats, Push, Ack, Pull,
                Weights, Heartbeat, Leave, Error, Exchange, ExchangeReply, GlobalWeights,
                InitWeights, Score)
}
WITH_BUFFERS = frozenset(  # frames that carry buffers: the kinds with a vector payload
    kind for kind, cls in MESSAGE_TYPES.items() if "payload" in cls.__dataclass_fields__)


def meta_keys(kind: Kind) -> tuple[str, ...]:
    """The keys of ``kind``'s msgpack map, in the order they are sent."""
    return SCHEMAS[MESSAGE_TYPES[kind]].meta


def from_wire(kind: int, version: int, meta: dict[str, Any], nbuf: int) -> Message:
    """The message of a frame from its map (buffers still empty); a peer's mistake is remote.

    Same checks as the constructor, without its keyword-argument parsing: the map must hold
    exactly the kind's keys (a field of its ``MAY_OMIT`` may be left out: its default is put
    in), so every field is present and checked once. HELLO's version (a
    byte of the prefix) and the buffers (views the decoder made) need no check. ``kind`` is
    the prefix's byte (a ``Kind`` or its int).
    """
    cls = MESSAGE_TYPES[kind]
    schema = SCHEMAS[cls]
    for name, default in schema.omissible:  # fields a peer may leave out (MAY_OMIT)
        if name not in meta:
            meta[name] = default()
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
    if kind in WITH_BUFFERS and not nbuf:  # with buffers, the decoder makes the payload
        meta["payload"] = Payload(meta.pop("encoding"), meta.pop("codec"), ())  # (with_buffers)
    elif cls is Hello:
        meta["version"] = version
    msg = cls.__new__(cls)
    object.__setattr__(msg, "__dict__", meta)  # the checked map becomes the fields, no copy
    return msg


def with_buffers(msg: Message, buffers: tuple[memoryview, ...]) -> None:
    """Make ``msg``'s payload of the ``encoding`` and ``codec`` its map held and a received
    frame's ``buffers`` (the decoder's views). Every decoder calls it exactly when the frame
    has buffers (``nbuf`` > 0), once its body is in."""
    values = msg.__dict__
    values["payload"] = Payload(values.pop("encoding"), values.pop("codec"), buffers)
