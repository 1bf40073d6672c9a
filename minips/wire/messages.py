"""minips messages, sans-IO: every kind of message a peer may send, as a value that checks itself.

No networking, no clocks, no framing here: a message is a frozen dataclass that knows whether it
is valid; ``frames.py`` turns messages into bytes and back. docs/protocol.md, section 3, lists
every field. The file holds, in order:

- the field checks: each takes a value and returns it (normalised) or raises ``Invalid`` saying
  what was expected; every message field carries one;
- the message machinery: ``PROTOCOL_VERSION``, ``Kind``, the ``Message`` base class,
  ``Reported`` and the field schemas;
- the global server's conversations: with a group process (EXCHANGE and its EXCHANGE_REPLY;
  GLOBAL_WEIGHTS answering its first PULL), with an evaluator (GLOBAL_WEIGHTS answering each
  PULL) and with a worker that brings the initial weights (INIT_WEIGHTS). Each carries one
  vector payload (``encoding``, ``codec``, ``buffers``: sparse.py) and its counters as typed
  fields;
- the worker <-> server conversation, then the table of kinds and how a peer's map becomes a
  message (``from_wire``).

Invariants:
- A check accepts exactly what docs/protocol.md, section 2, allows: ints are exact ``int`` (not
  bool) in range, numbers are finite, text and names are bounded, maps have str keys and nest at
  most ``MAX_DEPTH`` deep, buffers are C-contiguous bytes-like objects.
- A check never copies what it accepts, except to normalise (int -> float, bytes-like -> bytes,
  buffer -> flat "B" memoryview). Number checks carry ``fast = (type, lo, hi)``: a value of
  exactly that type within [lo, hi] passes without calling the check.
- A ``Message`` never exists with an invalid field: ``__post_init__`` runs every field's check
  (a bad value raises ``LocalProtocolError``).
- ``from_wire`` runs the same checks as a constructor on a map a peer sent
  (``RemoteProtocolError``). Checks cost time in proportion to the fields and values present.
  The servers read a message's counters as they are, with no further checks; ``info`` is the
  map of a message's counters for the receiver's records and merges.
- Each message's msgpack map holds exactly ``meta_keys(kind)``: every field except those in
  ``NOT_IN_META`` (``buffers``, and HELLO's ``version``, which travels in the frame prefix), in
  declaration order.
- Only the kinds in ``WITH_BUFFERS`` carry buffers (a vector payload: ``encoding``, ``codec``,
  ``buffers``, sparse.py); they are held as flat ``memoryview``s, never copied.

Public API:
- checks: ``Invalid``, ``Check``, ``integer``, ``number``, ``text``, ``blob``, ``boolean``,
  ``names``, ``ints`` (a list of ints), ``pairs`` (a list of [int, int]), ``mapping``,
  ``data_origin`` (a worker's data provenance: ``DATA_KEYS``),
  ``vector_codec`` (the codec map of a vector payload: ``VALUE_TYPES``, ``INDEX_SCHEMES``),
  ``views`` (a tuple of buffers);
- limits: ``MAX_INT``, ``MAX_TEXT``, ``MAX_NAME``, ``MAX_BUFFERS``, ``MAX_DEPTH``, ``MAX_LIST``,
  ``NONCE_BYTES``, ``MAC_BYTES``, ``MAX_SEQ``, ``MAX_PARAMS``, ``MAX_COUNT``;
- machinery: ``PROTOCOL_VERSION``, ``ROLES``, ``Kind``, ``Message``, ``Reported`` (a message
  whose counters also read as an ``info`` map), ``Schema``, ``SCHEMAS`` (class -> ``Schema``),
  ``checked`` (a dataclass field with its check);
- the 18 message classes (``Exchange``, ``ExchangeReply``, ``GlobalWeights``, ``InitWeights``
  and the worker <-> server kinds ``Hello`` ... ``Error``), ``MESSAGE_TYPES``, ``WITH_BUFFERS``,
  ``meta_keys(kind)``, ``from_wire(kind, version, meta, nbuf)``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

from minips.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_INT",
    "MAX_TEXT",
    "MAX_NAME",
    "MAX_BUFFERS",
    "MAX_DEPTH",
    "Invalid",
    "DATA_KEYS",
    "data_origin",
    "Check",
    "integer",
    "number",
    "text",
    "blob",
    "boolean",
    "names",
    "ints",
    "pairs",
    "mapping",
    "views",
    "vector_codec",
    "VALUE_TYPES",
    "INDEX_SCHEMES",
    "MAX_LIST",
    "PROTOCOL_VERSION",
    "NONCE_BYTES",
    "MAC_BYTES",
    "ROLES",
    "Kind",
    "Message",
    "Reported",
    "Schema",
    "SCHEMAS",
    "checked",
    "Exchange",
    "ExchangeReply",
    "GlobalWeights",
    "InitWeights",
    "MAX_SEQ",
    "MAX_PARAMS",
    "MAX_COUNT",
    "MAX_BATCH",
    "Hello",
    "Challenge",
    "Auth",
    "Welcome",
    "Refuse",
    "Assign",
    "Stats",
    "Push",
    "Ack",
    "Pull",
    "Weights",
    "Heartbeat",
    "Leave",
    "Error",
    "MESSAGE_TYPES",
    "WITH_BUFFERS",
    "meta_keys",
    "from_wire",
]


# -- the field checks: a value in, the value (normalised) or Invalid out ---------------------------

MAX_BUFFERS = 16  # raw buffers per frame; sparse packets use 2-3
MAX_TEXT = 4096  # characters of a free-text field (reason, address)
MAX_NAME = 64  # characters of a name field (role, code, encoding, capability)
MAX_INT = 2**63 - 1  # ints are signed 64-bit on the wire
MAX_DEPTH = 8  # nesting of lists/maps inside a map field
MAX_LIST = 1 << 16  # ints in a list field (a group's members, the workers a PULL waited for)
VALUE_TYPES = ("f32", "f16")  # a vector payload's value type (codec "value")
INDEX_SCHEMES = ("varint", "u32")  # a sparse payload's index coding (codec "index")


class Invalid(Exception):
    """A value a field does not allow; the message says what was expected."""


Check = Callable[[Any], Any]


def integer(lo: int = 0, hi: int = MAX_INT) -> Check:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:  # type() is: bool is not an int here
            raise Invalid(f"expected an int in [{lo}, {hi}]")
        return v

    check.fast = (int, lo, hi)  # type: ignore[attr-defined]
    return check


def number(lo: float = -math.inf, hi: float = math.inf) -> Check:
    def check(v: Any) -> float:
        t = type(v)
        if t is float:
            if lo <= v <= hi and v - v == 0.0:  # v - v is nan for inf and nan: finite only
                return v
        elif t is int and lo <= v <= hi:
            return float(v)
        elif t is not int:  # a numpy scalar, a string, ...: say so, the value may look right
            raise Invalid(f"expected a finite number (a Python float or int, not "
                          f"{t.__name__}) in [{lo}, {hi}]")
        raise Invalid(f"expected a finite number in [{lo}, {hi}]")

    # finite bounds for the fast path: inf and nan fail them and go through check()
    fast = (float, max(lo, -sys.float_info.max), min(hi, sys.float_info.max))
    check.fast = fast  # type: ignore[attr-defined]
    return check


def text(maxlen: int, choices: tuple[str, ...] = ()) -> Check:
    def check(v: Any) -> str:
        if type(v) is not str or len(v) > maxlen or (choices and v not in choices):
            within = f" in {choices}" if choices else ""
            raise Invalid(f"expected a str of <= {maxlen} chars{within}")
        return v

    return check


def blob(*sizes: int) -> Check:
    def check(v: Any) -> bytes:
        if type(v) is bytes and len(v) in sizes:
            return v
        if not isinstance(v, (bytes, bytearray, memoryview)) or len(v) not in sizes:
            raise Invalid(f"expected bytes of length {' or '.join(map(str, sizes))}")
        return bytes(v)

    return check


def boolean(v: Any) -> bool:
    if type(v) is not bool:
        raise Invalid("expected a bool")
    return v


def names(v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NAME:
        raise Invalid(f"expected a list of <= {MAX_NAME} names")
    name = text(MAX_NAME)
    return tuple([name(x) for x in v])


def ints(maxlen: int = MAX_LIST, lo: int = -MAX_INT) -> Check:
    def check(v: Any) -> list[int]:
        if (not isinstance(v, (list, tuple)) or len(v) > maxlen
                or not all(type(x) is int and lo <= x <= MAX_INT for x in v)):
            raise Invalid(f"expected a list of <= {maxlen} ints >= {lo}")
        return list(v)  # a list, as msgpack gives it back (records keep JSON lists)

    return check


def pairs(v: Any) -> list[list[int]]:
    """A short list of [int, int] (an exchange's session and seq; -1: none)."""
    pair = ints(2, -1)
    if not isinstance(v, (list, tuple)) or len(v) > MAX_NAME:
        raise Invalid(f"expected a list of <= {MAX_NAME} [int, int] pairs")
    out = [pair(x) for x in v]
    if any(len(x) != 2 for x in out):
        raise Invalid("expected [int, int] pairs")
    return out


_PRIMITIVES = frozenset({type(None), bool, int, float, str, bytes})


def _tree(v: Any, depth: int) -> None:
    """Check (without copying) that a list or map holds only primitives, lists/tuples and maps
    with str keys, at most ``depth`` deep. Tuples come back from the wire as lists."""
    if depth <= 0:
        raise Invalid("nested too deep")
    if isinstance(v, dict):
        for k, x in v.items():
            if type(k) is not str:
                raise Invalid("map keys must be str")
            if type(x) not in _PRIMITIVES:
                _tree(x, depth - 1)
    elif isinstance(v, (list, tuple)):
        for x in v:
            if type(x) not in _PRIMITIVES:
                _tree(x, depth - 1)
    else:
        raise Invalid(f"unsupported value of type {type(v).__name__}")


DATA_KEYS = {"dataset": str, "split": str, "synthetic": bool, "source": str, "reason": str}


def data_origin(v: Any) -> dict[str, Any]:
    """Where a worker's training data came from (STATS ``data``): a map of at most the keys
    of ``DATA_KEYS``, each of its type (strings of <= MAX_TEXT chars); empty: not said. Not a
    field check: on the wire ``data`` is a ``mapping``, and a server applies this one to it
    (``validation.check_stats``: ERROR ``invalid``, protocol.md section 9)."""
    if not isinstance(v, dict) or any(
            k not in DATA_KEYS or type(x) is not DATA_KEYS[k]
            or (type(x) is str and len(x) > MAX_TEXT) for k, x in v.items()):
        raise Invalid(f"expected a map of {', '.join(DATA_KEYS)} (str, synthetic: bool)")
    return v


def mapping(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise Invalid("expected a map")
    _tree(v, MAX_DEPTH)
    return v


def _flat(b: Any) -> memoryview:
    if type(b) is memoryview and b.format == "B" and b.ndim == 1 and b.c_contiguous:
        return b  # already what we hold (every decoded buffer is one)
    return memoryview(b).cast("B")  # cast() refuses non-contiguous arrays instead of copying


def views(v: Any) -> tuple[memoryview, ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_BUFFERS:
        raise Invalid(f"expected a tuple of <= {MAX_BUFFERS} buffers")
    try:
        return tuple([_flat(b) for b in v])
    except TypeError as e:
        raise Invalid(f"buffers must be C-contiguous bytes-like objects ({e})") from None


def vector_codec(v: Any) -> dict[str, Any]:
    """The codec map of a vector payload (sparse.py): ``k`` (entries of a sparse
    vector), ``index`` and ``value`` (its index coding and value type). Other keys are
    refused; what depends on the model's size is checked on decode."""
    if type(v) is not dict:
        raise Invalid("expected a codec map")
    for key, x in v.items():
        if key == "k":
            ok = type(x) is int and 0 <= x <= MAX_INT
        elif key == "index":
            ok = x in INDEX_SCHEMES
        elif key == "value":
            ok = x in VALUE_TYPES
        else:
            raise Invalid("codec keys are k, index and value")
        if not ok:
            raise Invalid(f"bad codec {key!r}: k is an int >= 0, index one of {INDEX_SCHEMES}, "
                          f"value one of {VALUE_TYPES}")
    return v


# -- the message machinery: kinds, the Message base class, field schemas ---------------------------

# 2: WEIGHTS.since (a sparse update of a held copy); 3: typed conversations (EXCHANGE,
# EXCHANGE_REPLY, GLOBAL_WEIGHTS, INIT_WEIGHTS; WEIGHTS' counters as fields; a checked codec)
PROTOCOL_VERSION = 4  # 4: EXCHANGE pull_* (answered PULLs), WEIGHTS lr_factor, progress,
# local_steps and batch, ASSIGN local_steps
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
    """A dataclass field validated by ``check`` (one of the field checks above)."""
    return field(default=default, default_factory=factory, metadata={"check": check})


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base class: validates every field with the check in its metadata."""

    KIND: ClassVar[Kind]
    NOT_IN_META: ClassVar[tuple[str, ...]] = ("buffers",)
    # map fields a peer may leave out (added after the kind was first sent): their default then
    MAY_OMIT: ClassVar[tuple[str, ...]] = ()

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
    omissible: tuple[tuple[str, Callable[[], Any]], ...]  # MAY_OMIT's fields, their defaults


def _default_of(f: dataclasses.Field[Any]) -> Callable[[], Any]:
    """A field's default as a function: its factory, or one returning its value."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory
    value = f.default
    return lambda: value


class _Schemas(dict[type, Schema]):
    """class -> Schema, computed on first use; a hit is a plain dict lookup (no Python call)."""

    def __missing__(self, cls: type[Message]) -> Schema:
        fields = dataclasses.fields(cls)
        meta = tuple(f.name for f in fields if f.name not in cls.NOT_IN_META)
        checks = tuple((f.name, f.metadata["check"], *getattr(f.metadata["check"], "fast",
                                                               (None, 0, 0))) for f in fields)
        wire_checks = tuple(c for c in checks if c[0] in meta)
        omissible = tuple((f.name, _default_of(f)) for f in fields if f.name in cls.MAY_OMIT)
        schema = self[cls] = Schema(checks, wire_checks, meta, frozenset(meta), omissible)
        return schema


SCHEMAS = _Schemas()


# -- the global server's conversations: group processes, evaluators, initial weights ---------------

MAX_SEQ = (1 << 53) - 1  # exchange session / seq: ints a double holds exactly
MAX_PARAMS = 1 << 31  # model size initial weights may claim (float32 elements)
MAX_COUNT = 1 << 62  # counters of samples, pushes and bytes
MAX_SECONDS = 1e9  # a time in seconds a counter may claim (step, iteration, run)
MAX_BATCH = 1 << 20  # samples of one worker step a server may ask for (LB-BSP; a PUSH's most)


@dataclass(frozen=True, kw_only=True)
class Exchange(Reported):
    """A group's exchange (group process -> global server): the delta since its last one, or
    its top entries, and the group's counters since then. ``(session, seq)`` names it, so a
    repeat is merged once."""

    KIND = Kind.EXCHANGE
    INFO = ("session", "seq", "version", "final", "pushes", "samples", "step_time", "loss",
            "iter_time", "bytes_in", "bytes_out", "min_clock", "max_clock", "pull_workers",
            "pull_leads", "pull_waits_us")
    session: int = checked(integer(0, MAX_SEQ))  # random per group process run
    seq: int = checked(integer(0, MAX_SEQ))  # 1, 2, ... within the session
    version: int = checked(integer(), 0)  # the group's weights version
    final: bool = checked(boolean, False)  # the group's last exchange (its workers are done)
    pushes: int = checked(integer(0, MAX_COUNT), 0)  # worker pushes since the last exchange
    samples: int = checked(integer(0, MAX_COUNT), 0)  # their samples
    step_time: float = checked(number(0.0, MAX_SECONDS), 0.0)  # their mean step time (s)
    loss: float = checked(number(-1e30, 1e30), 0.0)  # their mean loss
    iter_time: float = checked(number(0.0, MAX_SECONDS), 0.0)  # mean iteration time (GDTopK)
    bytes_in: int = checked(integer(0, MAX_COUNT), 0)  # worker -> group bytes so far
    bytes_out: int = checked(integer(0, MAX_COUNT), 0)  # group -> worker bytes so far
    min_clock: int = checked(integer(-1), -1)  # the group's lowest / highest live clock; -1: none
    max_clock: int = checked(integer(-1), -1)
    # the PULLs the group answered since its last exchange, one entry each in the three lists
    # (at most 4096 on the wire, frames.Limits.max_array_len; a group sends the latest 4096,
    # exchange.MAX_PULLS): the worker, its lead (clocks ahead of the group's slowest worker when
    # answered: its staleness) and how long the SSP bound held it (microseconds)
    pull_workers: list[int] = checked(ints(lo=0), factory=list)
    pull_leads: list[int] = checked(ints(lo=0), factory=list)
    pull_waits_us: list[int] = checked(ints(lo=0), factory=list)
    encoding: str = checked(text(MAX_NAME))
    codec: dict[str, Any] = checked(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = checked(views, ())


@dataclass(frozen=True, kw_only=True)
class ExchangeReply(Reported):
    """The global server's answer to an EXCHANGE: the merged global weights (dense) or the
    entries of the group's copy to set (sparse, exchange.py), the run's samples, and the
    exchanges of this group its last two checkpoint snapshots hold (exchange.py)."""

    KIND = Kind.EXCHANGE_REPLY
    INFO = ("samples", "saved_exchanges")
    version: int = checked(integer())  # the global weights' version
    done: bool = checked(boolean, False)  # the budget is spent
    samples: int = checked(integer(0, MAX_COUNT), 0)  # all groups' samples merged so far
    saved_exchanges: list[list[int]] = checked(pairs, factory=list)  # [session, seq] per snapshot
    encoding: str = checked(text(MAX_NAME))
    codec: dict[str, Any] = checked(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = checked(views, ())


@dataclass(frozen=True, kw_only=True)
class GlobalWeights(Reported):
    """The global weights, whole and dense, answering a PULL on the global server: a group
    process's first (``members``, ``last_exchange``) or an evaluator's (the run's counters)."""

    KIND = Kind.GLOBAL_WEIGHTS
    INFO = ("samples", "version", "t", "size", "members", "train_s", "done_reason",
            "bytes_up", "bytes_down", "last_exchange")
    version: int = checked(integer())
    done: bool = checked(boolean, False)
    size: int = checked(integer(0, MAX_PARAMS))  # parameters of the model
    samples: int = checked(integer(0, MAX_COUNT), 0)  # all groups' samples merged so far
    t: float = checked(number(), 0.0)  # seconds since the run's start
    train_s: float = checked(number(0.0), 0.0)  # seconds since the groups were formed
    done_reason: str = checked(text(MAX_NAME), "")  # why the run ended ("": not yet)
    bytes_up: int = checked(integer(0, MAX_COUNT), 0)  # worker -> group bytes, all groups
    bytes_down: int = checked(integer(0, MAX_COUNT), 0)  # group -> worker bytes, all groups
    members: list[int] = checked(ints(lo=0), factory=list)  # a group process's workers
    last_exchange: list[int] = checked(ints(2, -1), factory=list)  # [session, seq] it merged last
    encoding: str = checked(text(MAX_NAME))
    codec: dict[str, Any] = checked(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = checked(views, ())


@dataclass(frozen=True, kw_only=True)
class InitWeights(Reported):
    """A worker's initial weights (worker -> global server, once, when WELCOME said
    ``need_init``): dense, ``size`` parameters. No reply."""

    KIND = Kind.INIT_WEIGHTS
    INFO = ("size",)
    size: int = checked(integer(1, MAX_PARAMS))
    encoding: str = checked(text(MAX_NAME))
    codec: dict[str, Any] = checked(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = checked(views, ())


# -- the worker <-> server conversation, and how a peer's map becomes a message --------------------

@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Client opens a session. ``version`` travels in the frame prefix, not in the map."""

    KIND = Kind.HELLO
    NOT_IN_META = ("buffers", "version")
    version: int = checked(integer(0, 255), PROTOCOL_VERSION)
    role: str = checked(text(MAX_NAME, ROLES), "worker")
    worker_id: int = checked(integer(-1), -1)  # -1: let the server choose
    nonce: bytes = checked(blob(NONCE_BYTES))
    capabilities: tuple[str, ...] = checked(names, ())
    address: str = checked(text(MAX_TEXT), "")  # "host:port" a group server accepts workers on
    group: int = checked(integer(-1), -1)  # -1: none


@dataclass(frozen=True, kw_only=True)
class Challenge(Message):
    KIND = Kind.CHALLENGE
    nonce: bytes = checked(blob(NONCE_BYTES))


@dataclass(frozen=True, kw_only=True)
class Auth(Message):
    KIND = Kind.AUTH
    mac: bytes = checked(blob(0, MAC_BYTES))  # empty: the client has no secret


@dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    KIND = Kind.WELCOME
    worker_id: int = checked(integer(-1))
    mac: bytes = checked(blob(0, MAC_BYTES))  # empty only from a server without a secret
    info: dict[str, Any] = checked(mapping, factory=dict)


@dataclass(frozen=True, kw_only=True)
class Refuse(Message):
    KIND = Kind.REFUSE
    code: str = checked(text(MAX_NAME))
    reason: str = checked(text(MAX_TEXT))


@dataclass(frozen=True, kw_only=True)
class Assign(Message):
    KIND = Kind.ASSIGN
    group: int = checked(integer())
    address: str = checked(text(MAX_TEXT))
    ratio: float = checked(number(0.0, 1.0))
    staleness: int = checked(integer(-1))  # -1: no bound (ASP)
    local_steps: int = checked(integer(0), 0)  # the group's H (local steps); 0: the run's


@dataclass(frozen=True, kw_only=True)
class Stats(Message):
    KIND = Kind.STATS
    MAY_OMIT = ("data",)  # only a worker's first STATS says where its data came from
    clock: int = checked(integer())
    step_time: float = checked(number(0.0))  # seconds per step
    loss: float = checked(number())
    samples: int = checked(integer(), 0)
    # its training data (data_origin's keys; a server checks them: validation.check_stats)
    data: dict[str, Any] = checked(mapping, factory=dict)


@dataclass(frozen=True, kw_only=True)
class Push(Message):
    KIND = Kind.PUSH
    clock: int = checked(integer())
    step_time: float = checked(number(0.0), 0.0)
    loss: float = checked(number(), 0.0)
    samples: int = checked(integer(), 0)
    encoding: str = checked(text(MAX_NAME))  # the vector payload: sparse.py
    codec: dict[str, Any] = checked(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = checked(views, ())  # bytes-like; held as flat memoryviews


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    KIND = Kind.ACK
    clock: int = checked(integer())
    version: int = checked(integer(), 0)  # weights version after the push


@dataclass(frozen=True, kw_only=True)
class Pull(Message):
    KIND = Kind.PULL
    clock: int = checked(integer())
    since: int = checked(integer(-1), -1)  # version of the weights the client holds; -1: none


@dataclass(frozen=True, kw_only=True)
class Weights(Reported):
    """A group server's answer to a worker's PULL. ``since`` -1: the buffers are the whole
    weights at ``version``; else they name the coordinates that changed from version ``since``
    to ``version`` with their new values. The rest says where the worker stands."""

    KIND = Kind.WEIGHTS
    INFO = ("group", "waited_for", "ratio", "batch", "lead", "min_clock", "drift")
    version: int = checked(integer())
    since: int = checked(integer(-1), -1)  # -1: whole weights; else an update of the copy at since
    encoding: str = checked(text(MAX_NAME))
    codec: dict[str, Any] = checked(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = checked(views, ())  # bytes-like; held as flat memoryviews
    done: bool = checked(boolean, False)
    group: int = checked(integer(-1), -1)  # the group server's group
    waited_for: list[int] = checked(ints(), factory=list)  # the workers the answer waited for
    ratio: float = checked(number(0.0, 1.0), 1.0)  # the group's upload ratio (GDTopK)
    batch: int = checked(integer(0, MAX_BATCH), 0)  # LB-BSP: next step's samples; 0: the run's
    lead: int = checked(integer(-MAX_INT), 0)  # steps ahead of the group's slowest worker
    min_clock: int = checked(integer(-1), -1)  # the group's lowest live clock; -1: none
    drift: float = checked(number(-1.0), -1.0)  # compressed downlink: |sent - weights|; -1: dense
    lr_factor: float = checked(number(0.0), 1.0)  # of the run's lr, for the worker's next update
    progress: float = checked(number(0.0, 1.0), 0.0)  # fraction of the run's samples budget done
    local_steps: int = checked(integer(1), 1)  # H: local steps of the worker's next push

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
    seq: int = checked(integer(), 0)


@dataclass(frozen=True, kw_only=True)
class Leave(Message):
    KIND = Kind.LEAVE
    reason: str = checked(text(MAX_TEXT), "")  # "done" from a server: training is over


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    KIND = Kind.ERROR
    code: str = checked(text(MAX_NAME))
    reason: str = checked(text(MAX_TEXT))


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
    if kind in WITH_BUFFERS:
        meta["buffers"] = ()  # the decoder sets the received buffers when the body is in
    elif cls is Hello:
        meta["version"] = version
    msg = cls.__new__(cls)
    object.__setattr__(msg, "__dict__", meta)  # the checked map becomes the fields, no copy
    return msg
