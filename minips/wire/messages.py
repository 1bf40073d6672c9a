"""minips messages, sans-IO: the messages of a training step, each a value that checks itself.

No networking, no clocks, no framing here: a message is a frozen dataclass whose fields carry
their checks (``fields.py``); ``frames.py`` turns messages into bytes and back, and
docs/protocol.md, section 3, lists every field. The file opens with the kinds and the base
class, then the worker <-> server conversation in the order a training step uses it (PULL,
WEIGHTS, PUSH, ACK), then the global server's conversations (with a group process: EXCHANGE and
EXCHANGE_REPLY, GLOBAL_WEIGHTS answering a group's first PULL or an evaluator's; a worker's
INIT_WEIGHTS). The handshake and control messages (HELLO ... ERROR) are ``control.py``; the
table of every kind, and how a peer's map becomes a message (``from_wire``), is ``kinds.py``.

Invariants:
- A ``Message`` never exists with an invalid field: ``__post_init__`` runs every field's check
  (a bad value raises ``LocalProtocolError``).
- ``kinds.from_wire`` runs the same checks as a constructor on a map a peer sent
  (``RemoteProtocolError``). Checks cost time in proportion to the fields and values present.
  The servers read a message's counters as they are, with no further checks; ``info`` is the
  map of a message's counters for the receiver's records and merges.
- Each message's msgpack map holds exactly ``kinds.meta_keys(kind)``: every field in declaration
  order, but HELLO's ``version`` (it travels in the frame prefix), a ``payload`` as two keys.
- Only the kinds in ``kinds.WITH_BUFFERS`` carry buffers: their one vector ``payload`` (a
  ``fields.Payload``; sparse.py has the encodings) goes as ``encoding`` and ``codec`` in the
  map and its buffers as the frame's body, held as flat ``memoryview``s, never copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

from minips.errors import LocalProtocolError
from minips.wire.fields import (
    MAX_INT,
    MAX_NAME,
    SCHEMAS,
    Invalid,
    Payload,
    boolean,
    checked,
    integer,
    ints,
    names,
    number,
    pairs,
    payload,
    text,
)

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_SEQ",
    "MAX_PARAMS",
    "MAX_COUNT",
    "MAX_SECONDS",
    "MAX_BATCH",
    "Kind",
    "Message",
    "Reported",
    "Pull",
    "Weights",
    "Push",
    "Ack",
    "Exchange",
    "ExchangeReply",
    "GlobalWeights",
    "InitWeights",
]


PROTOCOL_VERSION = 4  # what each version changed: docs/protocol.md, section 10
MAX_SEQ = (1 << 53) - 1  # exchange session / seq: ints a double holds exactly
MAX_PARAMS = 1 << 31  # model size initial weights may claim (float32 elements)
MAX_COUNT = 1 << 62  # counters of samples, pushes and bytes
MAX_SECONDS = 1e9  # a time in seconds a counter may claim (step, iteration, run)
MAX_BATCH = 1 << 20  # samples of one worker step a server may ask for (LB-BSP; a PUSH's most)


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
    SCORE = 19


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base class: validates every field with the check in its metadata."""

    KIND: ClassVar[Kind]
    NOT_IN_META: ClassVar[tuple[str, ...]] = ()
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
        """The msgpack map of this message: every field but HELLO's version, a payload as its
        ``encoding`` and ``codec``."""
        values = self.__dict__
        if "payload" not in values:
            return {name: values[name] for name in SCHEMAS[type(self)].meta}
        out = {name: values.get(name) for name in SCHEMAS[type(self)].meta}  # keys in order
        out["encoding"], out["codec"], _ = values["payload"]
        return out


@dataclass(frozen=True, kw_only=True)
class Reported(Message):
    """A message whose counters a receiver writes into its records: ``info`` is the map of the
    fields named in ``INFO`` (a view of typed fields, never a field of its own)."""

    INFO: ClassVar[tuple[str, ...]] = ()

    @property
    def info(self) -> dict[str, Any]:
        values = self.__dict__
        return {name: values[name] for name in self.INFO}


# -- the worker <-> server conversation: one training step ---------------------------------------

@dataclass(frozen=True, kw_only=True)
class Pull(Message):
    """A worker asks for the weights (worker -> group server) once its SSP clock allows."""

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
    payload: Payload = checked(payload)  # the weights, or the changed ones (sparse.py)
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
class Push(Message):
    """A worker's update (worker -> group server): its gradient or change as a vector payload,
    and what the step measured."""

    KIND = Kind.PUSH
    clock: int = checked(integer())
    step_time: float = checked(number(0.0), 0.0)
    loss: float = checked(number(), 0.0)
    samples: int = checked(integer(), 0)
    payload: Payload = checked(payload)  # the gradient or change (sparse.py)


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    """The group server took a PUSH: the worker's clock and the weights version after it."""

    KIND = Kind.ACK
    clock: int = checked(integer())
    version: int = checked(integer(), 0)  # weights version after the push


# -- the global server's conversations: group processes, evaluators, initial weights -------------

@dataclass(frozen=True, kw_only=True)
class Exchange(Reported):
    """A group's exchange (group process -> global server): the delta since its last one, or
    its top entries, and the group's counters since then. ``(session, seq)`` names it, so a
    repeat is merged once."""

    KIND = Kind.EXCHANGE
    INFO = ("session", "seq", "version", "final", "pushes", "samples", "step_time", "loss",
            "iter_time", "bytes_in", "bytes_out", "min_clock", "max_clock", "pull_workers",
            "pull_leads", "pull_waits_us", "iter_workers", "iter_us", "compute_us", "events",
            "event_workers", "event_ms")
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
    # (at most 4096 on the wire, checks.Limits.max_array_len; a group sends the latest 4096,
    # exchange.MAX_PULLS): the worker, its lead (clocks ahead of the group's slowest worker when
    # answered: its staleness) and how long the SSP bound held it (microseconds)
    pull_workers: list[int] = checked(ints(lo=0), factory=list)
    pull_leads: list[int] = checked(ints(lo=0), factory=list)
    pull_waits_us: list[int] = checked(ints(lo=0), factory=list)
    # the workers whose iteration the group timed since its last exchange, one entry each in the
    # three lists: the worker, its mean iteration (PUSH to PUSH less the SSP hold between) and
    # its mean compute time (the step time its PUSHes said), microseconds (ssp.Iterations)
    iter_workers: list[int] = checked(ints(lo=0), factory=list)
    iter_us: list[int] = checked(ints(lo=0), factory=list)
    compute_us: list[int] = checked(ints(lo=0), factory=list)
    # what the group saw happen to its workers since its last exchange, for the operator (the
    # global server's console), one entry each in the three lists: the event
    # (``conversation.GROUP_EVENTS``), the worker, and milliseconds (silent for, back after; 0
    # for an expired lease)
    events: tuple[str, ...] = checked(names, factory=tuple)
    event_workers: list[int] = checked(ints(lo=0), factory=list)
    event_ms: list[int] = checked(ints(lo=0), factory=list)
    payload: Payload = checked(payload)


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
    payload: Payload = checked(payload)


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
    payload: Payload = checked(payload)


@dataclass(frozen=True, kw_only=True)
class InitWeights(Reported):
    """A worker's initial weights (worker -> global server, once, when WELCOME said
    ``need_init``): dense, ``size`` parameters. No reply."""

    KIND = Kind.INIT_WEIGHTS
    INFO = ("size",)
    size: int = checked(integer(1, MAX_PARAMS))
    payload: Payload = checked(payload)
