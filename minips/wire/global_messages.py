"""minips messages of the global server's conversations: with a group process (EXCHANGE and
its EXCHANGE_REPLY; GLOBAL_WEIGHTS answering its first PULL), with an evaluator
(GLOBAL_WEIGHTS answering each PULL) and with a worker that brings the initial weights
(INIT_WEIGHTS). Each carries one vector payload (``encoding``, ``codec``, ``buffers``:
sparse_codec.py) and its counters as typed fields; docs/protocol.md, section 3, lists them.

Invariant: every field has its check (``fields.py``), run by the constructor and, for a peer's
map, by ``messages.from_wire``; the servers read the counters as they are, with no further
checks. ``info`` is the map of a message's counters for the receiver's records and merges.

Public API: ``Exchange``, ``ExchangeReply``, ``GlobalWeights``, ``InitWeights``, ``MAX_SEQ``,
``MAX_PARAMS``, ``MAX_COUNT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minips.wire.fields import (
    MAX_NAME,
    boolean,
    integer,
    ints,
    number,
    pairs,
    text,
    vector_codec,
    views,
)
from minips.wire.message_base import Kind, Reported
from minips.wire.message_base import checked as _f

__all__ = ["Exchange", "ExchangeReply", "GlobalWeights", "InitWeights", "MAX_SEQ", "MAX_PARAMS",
           "MAX_COUNT"]

MAX_SEQ = (1 << 53) - 1  # exchange session / seq: ints a double holds exactly
MAX_PARAMS = 1 << 31  # model size initial weights may claim (float32 elements)
MAX_COUNT = 1 << 62  # counters of samples, pushes and bytes
MAX_SECONDS = 1e9  # a time in seconds a counter may claim (step, iteration, run)


@dataclass(frozen=True, kw_only=True)
class Exchange(Reported):
    """A group's exchange (group process -> global server): the delta since its last one, or
    its top entries, and the group's counters since then. ``(session, seq)`` names it, so a
    repeat is merged once."""

    KIND = Kind.EXCHANGE
    INFO = ("session", "seq", "version", "final", "pushes", "samples", "step_time", "loss",
            "iter_time", "bytes_in", "bytes_out", "min_clock", "max_clock")
    session: int = _f(integer(0, MAX_SEQ))  # random per group process run
    seq: int = _f(integer(0, MAX_SEQ))  # 1, 2, ... within the session
    version: int = _f(integer(), 0)  # the group's weights version
    final: bool = _f(boolean, False)  # the group's last exchange (its workers are done)
    pushes: int = _f(integer(0, MAX_COUNT), 0)  # worker pushes since the last exchange
    samples: int = _f(integer(0, MAX_COUNT), 0)  # their samples
    step_time: float = _f(number(0.0, MAX_SECONDS), 0.0)  # their mean step time (s)
    loss: float = _f(number(-1e30, 1e30), 0.0)  # their mean loss
    iter_time: float = _f(number(0.0, MAX_SECONDS), 0.0)  # mean iteration time (GDTopK)
    bytes_in: int = _f(integer(0, MAX_COUNT), 0)  # worker -> group bytes so far
    bytes_out: int = _f(integer(0, MAX_COUNT), 0)  # group -> worker bytes so far
    min_clock: int = _f(integer(-1), -1)  # the group's lowest / highest live clock; -1: none
    max_clock: int = _f(integer(-1), -1)
    encoding: str = _f(text(MAX_NAME))
    codec: dict[str, Any] = _f(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = _f(views, ())


@dataclass(frozen=True, kw_only=True)
class ExchangeReply(Reported):
    """The global server's answer to an EXCHANGE: the merged global weights (dense) or the
    entries of the group's copy to set (sparse, replica.py), the run's samples, and the
    exchanges of this group its last two checkpoint snapshots hold (unsaved.py)."""

    KIND = Kind.EXCHANGE_REPLY
    INFO = ("samples", "saved_exchanges")
    version: int = _f(integer())  # the global weights' version
    done: bool = _f(boolean, False)  # the budget is spent
    samples: int = _f(integer(0, MAX_COUNT), 0)  # all groups' samples merged so far
    saved_exchanges: list[list[int]] = _f(pairs, factory=list)  # [session, seq] per snapshot
    encoding: str = _f(text(MAX_NAME))
    codec: dict[str, Any] = _f(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = _f(views, ())


@dataclass(frozen=True, kw_only=True)
class GlobalWeights(Reported):
    """The global weights, whole and dense, answering a PULL on the global server: a group
    process's first (``members``, ``last_exchange``) or an evaluator's (the run's counters)."""

    KIND = Kind.GLOBAL_WEIGHTS
    INFO = ("samples", "version", "t", "size", "members", "train_s", "done_reason",
            "bytes_up", "bytes_down", "last_exchange")
    version: int = _f(integer())
    done: bool = _f(boolean, False)
    size: int = _f(integer(0, MAX_PARAMS))  # parameters of the model
    samples: int = _f(integer(0, MAX_COUNT), 0)  # all groups' samples merged so far
    t: float = _f(number(), 0.0)  # seconds since the run's start
    train_s: float = _f(number(0.0), 0.0)  # seconds since the groups were formed
    done_reason: str = _f(text(MAX_NAME), "")  # why the run ended ("": not yet)
    bytes_up: int = _f(integer(0, MAX_COUNT), 0)  # worker -> group bytes, all groups
    bytes_down: int = _f(integer(0, MAX_COUNT), 0)  # group -> worker bytes, all groups
    members: list[int] = _f(ints(lo=0), factory=list)  # a group process's workers
    last_exchange: list[int] = _f(ints(2, -1), factory=list)  # [session, seq] it merged last
    encoding: str = _f(text(MAX_NAME))
    codec: dict[str, Any] = _f(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = _f(views, ())


@dataclass(frozen=True, kw_only=True)
class InitWeights(Reported):
    """A worker's initial weights (worker -> global server, once, when WELCOME said
    ``need_init``): dense, ``size`` parameters. No reply."""

    KIND = Kind.INIT_WEIGHTS
    INFO = ("size",)
    size: int = _f(integer(1, MAX_PARAMS))
    encoding: str = _f(text(MAX_NAME))
    codec: dict[str, Any] = _f(vector_codec, factory=dict)
    buffers: tuple[Any, ...] = _f(views, ())
