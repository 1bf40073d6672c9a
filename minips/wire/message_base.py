"""minips message machinery: the kinds, the ``Message`` base class and its field schemas.

No networking, no clocks, no framing here. A message is a frozen dataclass whose fields each
carry a check from ``fields.py``; ``messages.py`` (the worker <-> server conversation) and
``global_messages.py`` (the global server's conversations with group processes, evaluators
and a worker's initial weights) declare the kinds on top of this.

Invariants:
- A ``Message`` never exists with an invalid field: ``__post_init__`` runs every field's check
  (a bad value raises ``LocalProtocolError``). A check may normalise a value (bytes-like ->
  bytes, buffers -> flat "B" memoryviews).
- A message's msgpack map holds every field except those in ``NOT_IN_META`` (``buffers``, and
  HELLO's ``version``, which travels in the frame prefix), in declaration order.

Public API: ``PROTOCOL_VERSION``, ``NONCE_BYTES``, ``MAC_BYTES``, ``ROLES``, ``Kind``,
``Message``, ``Reported`` (a message whose counters also read as an ``info`` map), ``Schema``,
``SCHEMAS`` (class -> ``Schema``), ``checked`` (a dataclass field with its check).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

from minips.errors import LocalProtocolError
from minips.wire.fields import Check, Invalid

__all__ = ["PROTOCOL_VERSION", "NONCE_BYTES", "MAC_BYTES", "ROLES", "Kind", "Message",
           "Reported", "Schema", "SCHEMAS", "checked"]

# 2: WEIGHTS.since (a sparse update of a held copy); 3: typed conversations (EXCHANGE,
# EXCHANGE_REPLY, GLOBAL_WEIGHTS, INIT_WEIGHTS; WEIGHTS' counters as fields; a checked codec)
PROTOCOL_VERSION = 3
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
    EXCHANGE = 15
    EXCHANGE_REPLY = 16
    GLOBAL_WEIGHTS = 17
    INIT_WEIGHTS = 18


def checked(check: Check, default: Any = dataclasses.MISSING,
            factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field validated by ``check`` (``fields.py``)."""
    return field(default=default, default_factory=factory, metadata={"check": check})


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base class: validates every field with the check in its metadata."""

    KIND: ClassVar[Kind]
    NOT_IN_META: ClassVar[tuple[str, ...]] = ("buffers",)

    def __post_init__(self) -> None:
        values = self.__dict__  # frozen: normalised values are written straight into __dict__
        for name, check, typ, lo, hi in SCHEMAS[type(self)].checks:
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
        return {name: values[name] for name in SCHEMAS[type(self)].meta}


@dataclass(frozen=True, kw_only=True)
class Reported(Message):
    """A message whose counters a receiver writes into its records: ``info`` is the map of the
    fields named in ``INFO`` (a view of typed fields, never a field of its own)."""

    INFO: ClassVar[tuple[str, ...]] = ()

    @property
    def info(self) -> dict[str, Any]:
        values = self.__dict__
        return {name: values[name] for name in self.INFO}


@dataclass(frozen=True)
class Schema:
    """What the code needs of a class's fields, computed once (dataclasses.fields() is slow)."""

    # (field, check, type, lo, hi) in declaration order; a value of exactly that type within
    # [lo, hi] is valid without calling check (numbers only; type None for other fields)
    checks: tuple[tuple[str, Check, Any, Any, Any], ...]
    wire_checks: tuple[tuple[str, Check, Any, Any, Any], ...]  # those of the map's fields
    meta: tuple[str, ...]  # the fields in the msgpack map, in order
    meta_set: frozenset[str]


class _Schemas(dict[type, Schema]):
    """class -> Schema, computed on first use; a hit is a plain dict lookup (no Python call)."""

    def __missing__(self, cls: type[Message]) -> Schema:
        fields = dataclasses.fields(cls)
        meta = tuple(f.name for f in fields if f.name not in cls.NOT_IN_META)
        checks = tuple((f.name, f.metadata["check"], *getattr(f.metadata["check"], "fast",
                                                               (None, 0, 0))) for f in fields)
        wire_checks = tuple(c for c in checks if c[0] in meta)
        schema = self[cls] = Schema(checks, wire_checks, meta, frozenset(meta))
        return schema


SCHEMAS = _Schemas()
