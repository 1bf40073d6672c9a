"""The conversation after the handshake, sans-IO: which message a peer may send next once its
connection is OPEN, per role, and what a server checks in a message beyond the wire schema. No
networking code, no clocks.

The handshake (handshake.py) ends in OPEN, where every data message may pass in its direction.
What follows has an order of its own, one per role of the peer:

- a **worker on its group server**: the join's ACK, then PULL -> WEIGHTS -> PUSH -> ACK, again
  and again: a PUSH follows its PULL and carries the clock after the PULL's;
- a **worker's control channel** to the global server: STATS and LEAVE, INIT_WEIGHTS at
  most once, dense float32, and the calibration's link probe: a PULL, answered with
  GLOBAL_WEIGHTS, then a PUSH of clock 1 that the server times and drops (no INIT_WEIGHTS
  after it);
- a **group process** on the global server: PULL before EXCHANGE (the server's record of what the
  group holds starts with the connection's first PULL);
- an **evaluator**: PULL, as often as it likes.

A server reads a peer's next message only once it answered the last, so a peer's message can
never overtake the server's answer. ``TURN_TRANSITIONS`` lists every allowed (sender, turn,
kind); ``REFUSALS`` words the refusals a peer is told about in their own terms; any other
message is "not allowed from a ... here". A peer's message out of turn raises
``RemoteProtocolError`` (ERROR ``invalid``; an EXCHANGE before the first PULL ``OrderError``,
ERROR ``order``), our own ``LocalProtocolError``. The server's messages that move no state
(ASSIGN at any time, the global server's answers) have no rows: only a worker's group server
answers in turns.

The checks of meaning that only a server knows (ranges of counters and times, a STATS ``data``
map, the lengths of an EXCHANGE's PULL lists) are plain functions here too (``check_push``,
``check_stats``, ``check_exchange``): a violation raises ``RemoteProtocolError`` before the
message touches the model. Clocks that go backwards are the SSP table's (``ssp.ClockError``).
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Any

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.wire import control, messages
from minips.wire.fields import Invalid
from minips.wire.handshake import Side
from minips.wire.messages import Kind

__all__ = ["MAX_SAMPLES", "MAX_STEP_S", "MAX_EXCHANGE_COUNT", "INIT_ENCODING", "OrderError",
           "Role", "Turn", "FIRST", "TURN_TRANSITIONS", "REFUSALS", "Conversation", "check_push",
           "check_stats", "check_exchange", "GROUP_EVENTS"]

MAX_SAMPLES = 1 << 20  # samples one push may claim (a batch); more is a broken or hostile peer
MAX_STEP_S = 1e5  # seconds one step may claim to take (a day); beyond that it is garbage
# samples (or pushes) one EXCHANGE may claim: a group's pushes since its last exchange, 2^20
# samples each at most; 2^40 is a million full pushes, and 2^22 exchanges of it still fit in the
# run's counters (messages.MAX_COUNT, 2^62), which GlobalCore bounds cumulatively
MAX_EXCHANGE_COUNT = 1 << 40
INIT_ENCODING = "dense-f32"  # the one encoding of INIT_WEIGHTS: the weights exactly as trained
# what a group process reports of its workers in EXCHANGE's ``events``: a connection silent for
# three heartbeats, bytes on it again, a lease run out, a connection broken without LEAVE
GROUP_EVENTS = ("link_lost", "link_back", "expired", "left")


class OrderError(RemoteProtocolError):
    """A message before the one it must follow (an EXCHANGE before its connection's first
    PULL): ERROR ``order``."""

    code = "order"


# ---------------------------------------------------------------------------------------------
# The table


class Role(IntEnum):
    """Who the peer is, on which server: it picks the conversation's first state."""

    WORKER = 0  # a worker on its group server
    CONTROL = 1  # a worker's control channel to the global server
    GROUP = 2  # a group process (`minips group`) on the global server
    EVALUATOR = 3  # an evaluator on the global server


# IntEnum, as handshake.State: TURN_TRANSITIONS is looked up per message.
class Turn(IntEnum):
    # a worker on its group server
    JOINED = 0  # the worker connected; the server owes the join's ACK (its starting clock)
    READY = 1  # an ACK went out; the worker owes a PULL (a PUSH now has no PULL before it)
    PULLING = 2  # a PULL at clock c came; the server owes WEIGHTS (SSP may hold them back)
    PULLED = 3  # WEIGHTS went out; the worker may PUSH at clock c + 1, or PULL again
    PUSHING = 4  # a PUSH came; the server owes its ACK
    # a worker's control channel
    CONTROL = 5  # STATS, LEAVE, and INIT_WEIGHTS (dense f32) once
    INITIALIZED = 6  # INIT_WEIGHTS came: a second one is refused
    # a group process
    ASSIGNED = 7  # it has its group but has not pulled: an EXCHANGE would be refused (order)
    SYNCED = 8  # its connection's first PULL came: EXCHANGE may follow
    # an evaluator
    EVALUATING = 9  # PULL as often as it likes
    LEFT = 10  # LEAVE came: the session is over, nothing more passes
    # a worker's control channel again: the calibration's link probe
    PROBING = 11  # its PULL came (answered with GLOBAL_WEIGHTS): it owes the probe's PUSH


# where each role's conversation starts
FIRST = {Role.WORKER: Turn.JOINED, Role.CONTROL: Turn.CONTROL, Role.GROUP: Turn.ASSIGNED,
         Role.EVALUATOR: Turn.EVALUATING}
_P, _S = Side.CLIENT, Side.SERVER  # the peer, the server
_T = Turn

# (sender, turn, kind) -> next turn. HEARTBEAT never reaches the table (the channel absorbs it).
TURN_TRANSITIONS: dict[tuple[Side, Turn, Kind], Turn] = {
    (_S, _T.JOINED, Kind.ACK): _T.READY,
    (_P, _T.READY, Kind.PULL): _T.PULLING,
    (_P, _T.READY, Kind.LEAVE): _T.LEFT,
    (_S, _T.PULLING, Kind.WEIGHTS): _T.PULLED,
    (_P, _T.PULLED, Kind.PUSH): _T.PUSHING,  # at the clock after the PULL's (Conversation)
    (_P, _T.PULLED, Kind.PULL): _T.PULLING,
    (_P, _T.PULLED, Kind.LEAVE): _T.LEFT,
    (_S, _T.PUSHING, Kind.ACK): _T.READY,
    (_P, _T.CONTROL, Kind.STATS): _T.CONTROL,
    (_P, _T.CONTROL, Kind.INIT_WEIGHTS): _T.INITIALIZED,  # dense f32 only (Conversation)
    (_P, _T.CONTROL, Kind.LEAVE): _T.LEFT,
    (_P, _T.INITIALIZED, Kind.STATS): _T.INITIALIZED,
    (_P, _T.INITIALIZED, Kind.LEAVE): _T.LEFT,
    (_P, _T.CONTROL, Kind.PULL): _T.PROBING,  # the link probe (roster.Roster.probe_pulled)
    (_P, _T.INITIALIZED, Kind.PULL): _T.PROBING,
    (_P, _T.PROBING, Kind.PUSH): _T.INITIALIZED,  # clock 1, after the probe's PULL at 0
    (_P, _T.PROBING, Kind.STATS): _T.PROBING,  # a worker that gave up waiting for the answer
    (_P, _T.PROBING, Kind.LEAVE): _T.LEFT,
    (_P, _T.ASSIGNED, Kind.PULL): _T.SYNCED,
    (_P, _T.ASSIGNED, Kind.LEAVE): _T.LEFT,
    (_P, _T.SYNCED, Kind.PULL): _T.SYNCED,
    (_P, _T.SYNCED, Kind.EXCHANGE): _T.SYNCED,
    (_P, _T.SYNCED, Kind.LEAVE): _T.LEFT,
    (_P, _T.EVALUATING, Kind.PULL): _T.EVALUATING,
    (_P, _T.EVALUATING, Kind.SCORE): _T.EVALUATING,
    (_P, _T.EVALUATING, Kind.LEAVE): _T.LEFT,
}

# (sender, turn, kind) -> (error, reason, expected, got): a peer's message out of turn that is
# refused in its own words; any other message without a row is "not allowed ... here".
REFUSALS: dict[tuple[Side, Turn, Kind], tuple[type[RemoteProtocolError], str, Any, Any]] = {
    (_P, _T.READY, Kind.PUSH): (RemoteProtocolError,
                                "PUSH must follow a PULL at the clock before it", None, None),
    (_P, _T.INITIALIZED, Kind.INIT_WEIGHTS): (RemoteProtocolError,
                                              "INIT_WEIGHTS sent twice in one session",
                                              "at most one", "a second"),
    (_P, _T.ASSIGNED, Kind.EXCHANGE): (OrderError, "EXCHANGE before this connection's first PULL",
                                       "PULL", "EXCHANGE"),
}

# how a refusal names the peer ("PUSH not allowed from a worker here")
_NAMES = {Role.WORKER: "worker", Role.CONTROL: "worker on the control channel",
          Role.GROUP: "group server", Role.EVALUATOR: "evaluator"}


class Conversation:
    """One connection's conversation after OPEN, seen from the server: checks every message
    the peer sends (``receive``) and every answer that moves the turn (``send``) against
    ``TURN_TRANSITIONS``. For a worker on its group server it also keeps what the turns carry:
    the clock of its last PULL (``pull_clock``) and the version the last WEIGHTS brought it to
    (``sent_version``, -1 before any)."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self.turn = FIRST[role]
        self.pull_clock = -1  # clock of the PULL being answered or last answered
        self.sent_version = -1  # version of the last WEIGHTS sent on this connection

    @property
    def left(self) -> bool:
        """True once the peer said LEAVE: the session is over."""
        return self.turn == Turn.LEFT

    def receive(self, msg: messages.Message) -> None:
        """The peer sent ``msg``: advance, or raise ``RemoteProtocolError`` saying why not."""
        nxt = TURN_TRANSITIONS.get((_P, self.turn, msg.KIND))
        if nxt is None:
            raise self._refusal(msg)
        if isinstance(msg, messages.Push):
            _check_push_clock(self.pull_clock, msg.clock)
        elif isinstance(msg, messages.InitWeights):
            _check_init_encoding(msg.payload.encoding)
        elif isinstance(msg, messages.Pull):
            self.pull_clock = msg.clock
        self.turn = nxt

    def send(self, msg: messages.Message) -> None:
        """We answer with ``msg``: advance, or raise ``LocalProtocolError`` (our bug)."""
        nxt = TURN_TRANSITIONS.get((_S, self.turn, msg.KIND))
        if nxt is None:
            raise LocalProtocolError(f"the server may not send {msg.KIND.name} in turn "
                                     f"{self.turn.name}", expected=self._allowed(_S),
                                     got=msg.KIND.name)
        if isinstance(msg, messages.Weights):
            self.sent_version = int(msg.version)
        self.turn = nxt

    def _refusal(self, msg: messages.Message) -> RemoteProtocolError:
        """The error for the peer's ``msg`` out of turn: its own words, or "not allowed"."""
        worded = REFUSALS.get((_P, self.turn, msg.KIND))
        if worded is not None:
            err, reason, expected, got = worded  # got None: the message's clock
            return err(reason, expected=expected, got=getattr(msg, "clock", got) if got is None
                       else got)
        return RemoteProtocolError(f"{type(msg).__name__.upper()} not allowed from a "
                                   f"{_NAMES[self.role]} here", got=type(msg).__name__)

    def _allowed(self, sender: Side) -> list[str]:
        return sorted(k.name for (s, t, k) in TURN_TRANSITIONS if s == sender and t == self.turn)


def _check_push_clock(pulled: int, clock: int) -> None:
    """A worker's PUSH carries the clock after its PULL's."""
    if clock != pulled + 1:
        raise RemoteProtocolError("PUSH must follow a PULL at the clock before it",
                                  expected=pulled + 1, got=clock)


def _check_init_encoding(encoding: str) -> None:
    """INIT_WEIGHTS are the weights exactly as trained: dense float32."""
    if encoding != INIT_ENCODING:
        raise RemoteProtocolError("initial weights must be dense float32", expected=INIT_ENCODING,
                                  got=encoding)


# ---------------------------------------------------------------------------------------------
# What a server checks in a message beyond the wire schema


def _number(name: str, value: Any, lo: float, hi: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not lo <= value <= hi:
        raise RemoteProtocolError(f"{name} out of range", expected=f"[{lo}, {hi}]", got=value)


def check_push(msg: messages.Push) -> None:
    """A worker's PUSH counters: samples, step time, loss (the gradient is checked on decode)."""
    _number("samples", msg.samples, 0, MAX_SAMPLES)
    _number("step_time", msg.step_time, 0.0, MAX_STEP_S)
    _number("loss", msg.loss, -1e30, 1e30)


def check_stats(msg: control.Stats) -> None:
    """A worker's STATS: a positive finite step time, a sample count and, in ``data``, at most
    the keys of ``control.DATA_KEYS`` with their types (on the wire ``data`` is any map: its
    keys are the server's to check, answered ``invalid``). Its clock is not compared with the
    last one: it counts steps in the worker's current group, and starts again when the worker
    moves to another group or its group server restarts."""
    _number("step_time", msg.step_time, 1e-9, MAX_STEP_S)
    _number("samples", msg.samples, 0, 1 << 62)
    try:
        control.data_origin(msg.data)
    except Invalid as e:
        raise RemoteProtocolError(f"STATS data: {e}", expected=str(e),
                                  got=repr(msg.data)[:200]) from None


def check_exchange(msg: messages.Exchange) -> None:
    """A group process's EXCHANGE counters per message: ``samples`` and ``pushes`` at most
    ``MAX_EXCHANGE_COUNT`` (the run's sums are bounded by ``GlobalCore.merge``); its answered
    PULLs, one entry per PULL in each of the three lists (equal lengths), and likewise its
    timed workers (``iter_*``, ``compute_us``)."""
    _number("samples", msg.samples, 0, MAX_EXCHANGE_COUNT)
    _number("pushes", msg.pushes, 0, MAX_EXCHANGE_COUNT)
    n = len(msg.pull_workers)
    if not len(msg.pull_leads) == len(msg.pull_waits_us) == n:
        raise RemoteProtocolError("EXCHANGE's pull_* lists differ in length",
                                  expected=f"{n} entries each",
                                  got=[n, len(msg.pull_leads), len(msg.pull_waits_us)])
    n = len(msg.iter_workers)  # and its timed workers, one entry per worker in each
    if not len(msg.iter_us) == len(msg.compute_us) == n:
        raise RemoteProtocolError("EXCHANGE's iter_workers, iter_us, compute_us differ in "
                                  "length", expected=f"{n} entries each",
                                  got=[n, len(msg.iter_us), len(msg.compute_us)])
    n = len(msg.events)  # and what it saw happen, one entry per event in each
    if not len(msg.event_workers) == len(msg.event_ms) == n:
        raise RemoteProtocolError("EXCHANGE's events, event_workers, event_ms differ in length",
                                  expected=f"{n} entries each",
                                  got=[n, len(msg.event_workers), len(msg.event_ms)])
    unknown = sorted(set(msg.events) - set(GROUP_EVENTS))
    if unknown:
        raise RemoteProtocolError("EXCHANGE names an event this server does not know",
                                  expected=sorted(GROUP_EVENTS), got=unknown)
