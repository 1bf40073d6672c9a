"""The conversation after the handshake, driven without a socket: every row of the table, the
refusals in their own words (ERROR ``invalid``, or ``order`` for an EXCHANGE before the first
PULL), and any sequence of messages gives the table's turns or a ``RemoteProtocolError``.

The same refusals over real connections: test_exactly_once (order), test_control_flood
(INIT_WEIGHTS twice or not dense f32), test_hostile and test_server (a PUSH with no PULL).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.sparse import encode_vector
from minips.wire import control, conversation, messages
from minips.wire.conversation import (
    FIRST,
    REFUSALS,
    TURN_TRANSITIONS,
    Conversation,
    OrderError,
    Role,
    Turn,
)
from minips.wire.handshake import Side
from minips.wire.messages import Kind


def payload(values: np.ndarray | None = None) -> dict[str, Any]:
    return {"payload": encode_vector(np.zeros(4, np.float32) if values is None else values)}


def make(kind: Kind, clock: int = 0) -> messages.Message:
    """A well-formed message of ``kind`` (PULL, PUSH and ACK at ``clock``)."""
    vec = payload()
    build = {
        Kind.HELLO: lambda: control.Hello(nonce=bytes(32)),
        Kind.CHALLENGE: lambda: control.Challenge(nonce=bytes(32)),
        Kind.AUTH: lambda: control.Auth(mac=b""),
        Kind.WELCOME: lambda: control.Welcome(worker_id=0, mac=b""),
        Kind.REFUSE: lambda: control.Refuse(code="auth", reason="test"),
        Kind.ASSIGN: lambda: control.Assign(group=0, address="127.0.0.1:1", ratio=1.0,
                                             staleness=0),
        Kind.STATS: lambda: control.Stats(clock=0, step_time=0.01, loss=1.0),
        Kind.PUSH: lambda: messages.Push(clock=clock, **vec),
        Kind.ACK: lambda: messages.Ack(clock=clock, version=0),
        Kind.PULL: lambda: messages.Pull(clock=clock),
        Kind.WEIGHTS: lambda: messages.Weights(version=7, **vec),
        Kind.HEARTBEAT: lambda: control.Heartbeat(),
        Kind.LEAVE: lambda: control.Leave(reason="bye"),
        Kind.ERROR: lambda: control.Error(code="invalid", reason="test"),
        Kind.EXCHANGE: lambda: messages.Exchange(session=1, seq=1, **vec),
        Kind.EXCHANGE_REPLY: lambda: messages.ExchangeReply(version=1, **vec),
        Kind.GLOBAL_WEIGHTS: lambda: messages.GlobalWeights(version=1, size=4, **vec),
        Kind.INIT_WEIGHTS: lambda: messages.InitWeights(size=4, **vec),
        Kind.SCORE: lambda: control.Score(version=1, accuracy=0.5, loss=1.0),
    }
    return build[kind]()


def role_of(turn: Turn) -> Role:
    """The role whose conversation passes through ``turn`` (LEFT: any)."""
    return {Turn.JOINED: Role.WORKER, Turn.READY: Role.WORKER, Turn.PULLING: Role.WORKER,
            Turn.PULLED: Role.WORKER, Turn.PUSHING: Role.WORKER, Turn.CONTROL: Role.CONTROL,
            Turn.INITIALIZED: Role.CONTROL, Turn.ASSIGNED: Role.GROUP, Turn.SYNCED: Role.GROUP,
            Turn.EVALUATING: Role.EVALUATOR, Turn.PROBING: Role.CONTROL}[turn]


# the shortest way from a role's first turn to each turn: (sender, kind) steps
PATHS: dict[Turn, list[tuple[Side, Kind]]] = {
    Turn.JOINED: [],
    Turn.READY: [(Side.SERVER, Kind.ACK)],
    Turn.PULLING: [(Side.SERVER, Kind.ACK), (Side.CLIENT, Kind.PULL)],
    Turn.PULLED: [(Side.SERVER, Kind.ACK), (Side.CLIENT, Kind.PULL), (Side.SERVER, Kind.WEIGHTS)],
    Turn.PUSHING: [(Side.SERVER, Kind.ACK), (Side.CLIENT, Kind.PULL), (Side.SERVER, Kind.WEIGHTS),
                   (Side.CLIENT, Kind.PUSH)],
    Turn.CONTROL: [],
    Turn.INITIALIZED: [(Side.CLIENT, Kind.INIT_WEIGHTS)],
    Turn.ASSIGNED: [],
    Turn.SYNCED: [(Side.CLIENT, Kind.PULL)],
    Turn.EVALUATING: [],
    Turn.PROBING: [(Side.CLIENT, Kind.PULL)],
}


def feed(conv: Conversation, sender: Side, kind: Kind) -> None:
    """``kind`` from ``sender``; a PUSH carries the clock after the last PULL's (PULLs at 4)."""
    msg = make(kind, clock=conv.pull_clock + 1 if kind == Kind.PUSH else 4)
    (conv.receive if sender == Side.CLIENT else conv.send)(msg)


def at(turn: Turn) -> Conversation:
    conv = Conversation(role_of(turn))
    for sender, kind in PATHS[turn]:
        feed(conv, sender, kind)
    assert conv.turn == turn
    return conv


def test_every_role_starts_where_the_table_says_and_every_turn_is_reachable() -> None:
    assert {r: Conversation(r).turn for r in Role} == FIRST
    assert set(PATHS) | {Turn.LEFT} == set(Turn)
    for turn in PATHS:
        at(turn)


@pytest.mark.parametrize("row", sorted(TURN_TRANSITIONS),
                         ids=lambda r: f"{r[0].name}-{r[1].name}-{r[2].name}")
def test_every_row_of_the_table_passes_and_leads_where_it_says(
        row: tuple[Side, Turn, Kind]) -> None:
    sender, turn, kind = row
    conv = at(turn)
    feed(conv, sender, kind)
    assert conv.turn == TURN_TRANSITIONS[row]
    assert conv.left == (conv.turn == Turn.LEFT)


@pytest.mark.parametrize("turn", sorted(PATHS), ids=lambda t: t.name)
def test_every_message_without_a_row_is_refused_and_the_turn_stays(turn: Turn) -> None:
    for kind in Kind:
        if (Side.CLIENT, turn, kind) in TURN_TRANSITIONS:
            continue
        conv = at(turn)
        with pytest.raises(RemoteProtocolError) as refused:
            conv.receive(make(kind))
        assert conv.turn == turn
        worded = REFUSALS.get((Side.CLIENT, turn, kind))
        if worded is not None:
            assert type(refused.value) is worded[0] and str(refused.value) == worded[1]
        else:
            assert type(refused.value) is RemoteProtocolError
            assert str(refused.value).startswith(f"{type(make(kind)).__name__.upper()} not "
                                                 "allowed from a ")


def test_only_an_exchange_before_the_first_pull_is_an_order_error() -> None:
    """ERROR ``order``: the code comes with the error (``validation.reject`` reads it); the
    other refusals are ERROR ``invalid``."""
    conv = Conversation(Role.GROUP)
    with pytest.raises(OrderError) as refused:
        conv.receive(make(Kind.EXCHANGE))
    assert refused.value.code == "order"
    assert (refused.value.expected, refused.value.got) == ("PULL", "EXCHANGE")
    assert [k for k, (err, *_) in REFUSALS.items() if err is OrderError] == [
        (Side.CLIENT, Turn.ASSIGNED, Kind.EXCHANGE)]
    conv.receive(make(Kind.PULL))
    for _ in range(3):  # then as many exchanges and PULLs as it likes
        conv.receive(make(Kind.EXCHANGE))
        conv.receive(make(Kind.PULL))
    assert conv.turn == Turn.SYNCED


def test_a_push_follows_its_pull_at_the_clock_after_it() -> None:
    conv = at(Turn.READY)
    with pytest.raises(RemoteProtocolError, match="PUSH must follow a PULL") as refused:
        conv.receive(make(Kind.PUSH, clock=1))  # no PULL before it
    assert (refused.value.expected, refused.value.got) == (None, 1)
    conv.receive(make(Kind.PULL, clock=4))
    conv.send(make(Kind.WEIGHTS))
    for clock in (4, 6):  # the PULL's own clock, or one too far
        with pytest.raises(RemoteProtocolError, match="PUSH must follow a PULL") as refused:
            conv.receive(make(Kind.PUSH, clock=clock))
        assert (refused.value.expected, refused.value.got) == (5, clock)
        assert conv.turn == Turn.PULLED
    conv.receive(make(Kind.PUSH, clock=5))
    conv.send(make(Kind.ACK, clock=5))
    with pytest.raises(RemoteProtocolError, match="PUSH must follow a PULL"):
        conv.receive(make(Kind.PUSH, clock=6))  # one PUSH a PULL


def test_a_second_pull_before_the_push_moves_the_clock_the_push_must_carry() -> None:
    conv = at(Turn.PULLED)
    conv.receive(make(Kind.PULL, clock=9))
    conv.send(make(Kind.WEIGHTS))
    with pytest.raises(RemoteProtocolError):
        conv.receive(make(Kind.PUSH, clock=5))
    conv.receive(make(Kind.PUSH, clock=10))


def test_the_conversation_remembers_the_version_the_last_weights_brought() -> None:
    conv = Conversation(Role.WORKER)
    assert conv.sent_version == -1  # none yet: the first PULL gets the whole weights
    feed(conv, Side.SERVER, Kind.ACK)
    feed(conv, Side.CLIENT, Kind.PULL)
    conv.send(make(Kind.WEIGHTS))
    assert conv.sent_version == 7


def test_init_weights_once_and_dense_float32_only() -> None:
    conv = Conversation(Role.CONTROL)
    conv.receive(make(Kind.STATS))
    conv.receive(make(Kind.INIT_WEIGHTS))
    conv.receive(make(Kind.STATS))
    with pytest.raises(RemoteProtocolError, match="INIT_WEIGHTS sent twice in one session"):
        conv.receive(make(Kind.INIT_WEIGHTS))
    half = messages.InitWeights(size=4, **payload(np.zeros(4, np.float16)))
    with pytest.raises(RemoteProtocolError, match="dense float32") as refused:
        Conversation(Role.CONTROL).receive(half)
    assert refused.value.expected == conversation.INIT_ENCODING
    assert not isinstance(refused.value, OrderError)


def test_the_servers_answer_out_of_turn_is_a_local_error() -> None:
    for turn, kind in ((Turn.JOINED, Kind.WEIGHTS), (Turn.READY, Kind.ACK),
                       (Turn.PULLING, Kind.ACK), (Turn.PUSHING, Kind.WEIGHTS),
                       (Turn.CONTROL, Kind.ACK)):
        conv = at(turn)
        with pytest.raises(LocalProtocolError):
            conv.send(make(kind))
        assert conv.turn == turn


def test_after_leave_nothing_passes() -> None:
    for role in Role:
        conv = Conversation(role)
        if role == Role.WORKER:
            feed(conv, Side.SERVER, Kind.ACK)
        conv.receive(make(Kind.LEAVE))
        assert conv.left
        for kind in Kind:
            with pytest.raises(RemoteProtocolError):
                conv.receive(make(kind))


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.name)
def test_any_sequence_gives_the_tables_turns_or_a_remote_error(role: Role) -> None:
    """The grammar fuzz of the conversation: 2,000 random sequences of a peer's messages, each
    answered as a server would (WEIGHTS after a PULL, ACK after a PUSH): every message moves
    the turn the table says, or raises ``RemoteProtocolError`` and ends the sequence."""
    rng = random.Random(role)
    kinds = [Kind.PULL, Kind.PUSH, Kind.STATS, Kind.INIT_WEIGHTS, Kind.EXCHANGE, Kind.LEAVE,
             Kind.ERROR, Kind.ACK, Kind.WEIGHTS]
    for _ in range(500):
        conv = Conversation(role)
        if role == Role.WORKER:
            feed(conv, Side.SERVER, Kind.ACK)
        for _ in range(rng.randrange(1, 12)):
            kind = rng.choice(kinds)
            clock = max(0, conv.pull_clock + rng.choice((1, 1, 1, 0, 2)))
            before = conv.turn
            try:
                conv.receive(make(kind, clock=clock))
            except RemoteProtocolError:
                assert conv.turn == before
                break
            assert conv.turn == TURN_TRANSITIONS[(Side.CLIENT, before, kind)]
            answer = {Turn.PULLING: Kind.WEIGHTS, Turn.PUSHING: Kind.ACK}.get(conv.turn)
            if answer is not None:
                conv.send(make(answer, clock=clock))


def test_the_checks_of_meaning_refuse_out_of_range_counters() -> None:
    push = messages.Push(clock=1, samples=conversation.MAX_SAMPLES + 1, **payload())
    with pytest.raises(RemoteProtocolError, match="samples out of range"):
        conversation.check_push(push)
    conversation.check_push(messages.Push(clock=1, samples=conversation.MAX_SAMPLES, **payload()))
    with pytest.raises(RemoteProtocolError, match="step_time out of range"):
        conversation.check_stats(control.Stats(clock=0, step_time=0.0, loss=1.0))
    with pytest.raises(RemoteProtocolError, match="STATS data"):
        conversation.check_stats(control.Stats(clock=0, step_time=0.1, loss=1.0,
                                                data={"colour": "red"}))
    big = messages.Exchange(session=1, seq=1, pushes=conversation.MAX_EXCHANGE_COUNT + 1,
                            **payload())
    with pytest.raises(RemoteProtocolError, match="pushes out of range"):
        conversation.check_exchange(big)
    lists = messages.Exchange(session=1, seq=1, pull_workers=[1, 2], pull_leads=[0],
                              pull_waits_us=[0, 0], **payload())
    with pytest.raises(RemoteProtocolError, match="differ in length"):
        conversation.check_exchange(lists)
