"""The minips wire protocol, sans-IO: the one place to import it from.

This package part contains no networking code at all: no asyncio, no sockets, no clocks. Bytes
go in, messages come out (``FrameDecoder``); a message goes in, a list of buffers comes out
(``encode``). docs/protocol.md describes every byte. The code lives in these modules, read in
this order:

- ``fields.py``    the checks a message field can have (ints, finite numbers, text, maps, ...).
- ``message_base.py`` ``Kind`` and the ``Message`` base class (a frozen dataclass, fields checked).
- ``messages.py``  one class per kind of the worker <-> server conversation; ``from_wire``.
- ``global_messages.py`` the kinds of the global server's conversations with group processes,
  evaluators and a worker bringing the initial weights.
- ``frames.py``    the 16-byte prefix, the buffer table, ``Limits``, ``encode``, frame checks.
- ``decoder.py``   ``FrameDecoder``: bytes in (whole or in pieces, zero-copy), messages out;
  ``partial_frame.py`` holds a big frame while it arrives.
- ``handshake.py`` connection ``State`` and ``TRANSITIONS``, ``Connection``, the HMAC handshake.

Invariants (each module states its own in full):
- Decoding any bytes gives messages or raises ``RemoteProtocolError`` (``LimitExceeded`` for a
  limit), never another exception. Misuse on our side raises ``LocalProtocolError``.
- Every length is checked against ``Limits`` before anything of that size is allocated.
- Messages validate their own fields; buffers are held as flat ``memoryview``s, never copied.
- HELLO, REFUSE and ERROR keep their layout in every protocol version.
"""

from __future__ import annotations

from minips.wire.decoder import Alloc, FrameDecoder, default_alloc
from minips.wire.frames import (
    COALESCE_BYTES,
    CODEC_LZ4,
    CODEC_RAW,
    DEFAULT_LIMITS,
    DIRECT_MIN_BYTES,
    DIRECT_READ_BYTES,
    LZ4_MIN_BYTES,
    MAGIC,
    MAX_FRAME_BYTES,
    MAX_META_BYTES,
    MAX_RAW_BYTES,
    PREFIX,
    SCRATCH_BYTES,
    TABLE_ENTRY,
    Limits,
    encode,
)
from minips.wire.handshake import (
    CLIENT_LABEL,
    SERVER_LABEL,
    TRANSITIONS,
    ClientHandshake,
    Connection,
    ServerHandshake,
    Side,
    State,
    make_mac,
    new_nonce,
)
from minips.wire.messages import (
    MAC_BYTES,
    MAX_BUFFERS,
    MAX_INT,
    MAX_NAME,
    MAX_TEXT,
    MESSAGE_TYPES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ROLES,
    WITH_BUFFERS,
    Ack,
    Assign,
    Auth,
    Challenge,
    Error,
    Exchange,
    ExchangeReply,
    GlobalWeights,
    Heartbeat,
    Hello,
    InitWeights,
    Kind,
    Leave,
    Message,
    Pull,
    Push,
    Refuse,
    Stats,
    Weights,
    Welcome,
)

__all__ = [
    "PROTOCOL_VERSION", "MAGIC", "PREFIX", "TABLE_ENTRY", "NONCE_BYTES", "MAC_BYTES",
    "MAX_FRAME_BYTES", "MAX_META_BYTES", "MAX_BUFFERS", "MAX_RAW_BYTES", "MAX_TEXT", "MAX_NAME",
    "MAX_INT", "ROLES", "CODEC_RAW", "CODEC_LZ4", "LZ4_MIN_BYTES", "COALESCE_BYTES",
    "SCRATCH_BYTES", "DIRECT_MIN_BYTES", "DIRECT_READ_BYTES", "DEFAULT_LIMITS",
    "Kind", "Message", "Hello", "Challenge", "Auth", "Welcome", "Refuse", "Assign", "Stats",
    "Push", "Ack", "Pull", "Weights", "Heartbeat", "Leave", "Error", "Exchange",
    "ExchangeReply", "GlobalWeights", "InitWeights", "MESSAGE_TYPES",
    "WITH_BUFFERS",
    "Limits", "Alloc", "encode", "default_alloc", "FrameDecoder", "Side", "State", "TRANSITIONS",
    "Connection", "CLIENT_LABEL", "SERVER_LABEL", "new_nonce", "make_mac", "ClientHandshake",
    "ServerHandshake",
]
