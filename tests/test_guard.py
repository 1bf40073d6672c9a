"""Tests for minips.net.guard (sans-IO, time passed in) and the handshake limits of a server-side
``Connection``: caps on handshakes at once, back-off after failures, counted log lines, and
frames before WELCOME bounded to 16 KiB."""

from __future__ import annotations

import numpy as np
import pytest

from minips.errors import LimitExceeded
from minips.net import guard
from minips.wire import checks, control, frames, handshake, messages
from minips.wire.fields import Payload

LIMITS = guard.GuardLimits(max_pending=5, max_pending_per_source=2, max_waiting_per_source=2,
                      max_waiting=3, free_failures=2, backoff_first_s=1.0, backoff_max_s=4.0,
                      forget_after_s=100.0)


def test_handshakes_at_once_are_capped_per_source_and_in_total() -> None:
    g = guard.Guard(LIMITS)
    for src in ("a", "a", "b", "b", "c"):
        assert g.admit(src, 0.0) == ""
        g.opened(src)
    assert g.admit("a", 0.0) == "wait"  # over its address's cap: it may wait its turn
    assert g.admit("d", 0.0) == "total"
    assert g.closed("a") is None
    assert g.admit("a", 0.0) == "" and g.admit("d", 0.0) == ""
    g.opened("d")
    assert g.admit("e", 0.0) == "total"
    assert g.closed("b") is None
    assert g.admit("e", 0.0) == "" and g.total_pending == 4 and g.pending["b"] == 1


def test_over_its_address_cap_a_connection_waits_in_line_and_takes_the_next_slot() -> None:
    """A burst from one address is admitted slot after slot in arrival order, none turned
    away; its line is bounded per address and in all, and one that gives up leaves it."""
    g = guard.Guard(LIMITS)
    for _ in range(2):
        g.opened("a")
    for ticket in ("a1", "a2"):
        assert g.admit("a", 0.0) == "wait"
        g.queue("a", ticket)
    assert g.admit("a", 0.0) == "per_source"  # its line is full too
    g.opened("b")
    g.opened("b")
    assert g.admit("b", 0.0) == "wait"
    g.queue("b", "b1")
    g.opened("c")  # under its own cap, yet the lines of all together are full
    g.opened("c")
    assert g.admit("c", 0.0) == "per_source" and g.total_waiting == 3
    assert g.closed("a") == "a1" and g.closed("a") == "a2"  # the slot passes on, oldest first
    assert g.pending["a"] == 2 and g.total_pending == 6 and "a" not in g.waiting
    assert g.admit("a", 0.0) == "wait"
    g.gave_up("b", "b1")
    g.gave_up("b", "b1")  # twice: nothing more
    assert g.closed("b") is None and g.pending["b"] == 1 and g.total_waiting == 0
    assert [g.closed("a"), g.closed("a")] == [None, None] and "a" not in g.pending


def test_failures_back_off_doubling_up_to_the_maximum_and_success_forgives() -> None:
    g = guard.Guard(LIMITS)
    assert [g.failed("x", 0.0) for _ in range(6)] == [0.0, 0.0, 1.0, 2.0, 4.0, 4.0]
    assert g.admit("x", 3.9) == "backoff" and g.backoff_left("x", 1.0) == pytest.approx(3.0)
    assert g.admit("x", 4.0) == "" and g.admit("y", 0.0) == ""  # others are not affected
    g.succeeded("x")
    assert g.failures("x") == 0 and g.failed("x", 5.0) == 0.0


def test_old_failures_are_forgotten_and_the_records_are_bounded() -> None:
    g = guard.Guard(LIMITS)
    for _ in range(3):
        g.failed("x", 0.0)
    assert g.failed("x", 200.0) == 0.0 and g.failures("x") == 1  # 100 s without failure
    for i in range(guard.MAX_SOURCES + 10):
        g.failed(f"10.0.{i // 256}.{i % 256}", 300.0)
    assert len(g._records) == guard.MAX_SOURCES and g.failures("x") == 0  # oldest went first


def test_log_summary_gives_the_first_line_then_counts_once_a_period() -> None:
    s = guard.LogSummary(period_s=5.0)
    assert s.event("refused", "1.2.3.4: wrong token", 0.0) == "refused: 1.2.3.4: wrong token"
    assert [s.event("refused", f"n{i}", 1.0 + i * 0.1) for i in range(10)] == [None] * 10
    assert s.due(4.0) == []
    assert s.due(5.0) == ["refused: 10 times in the last 5 s, latest: n9"]
    assert s.due(20.0) == [] and s.flush(20.0) == []
    assert s.event("refused", "again", 21.0) == "refused: 1 times in the last 16 s, latest: again"
    s.event("turned away", "z", 21.5)
    s.event("turned away", "z", 21.6)
    assert s.flush(22.0) == ["turned away: 1 times in the last 0 s, latest: z"]


def test_a_server_connection_takes_only_handshake_frames_until_welcome() -> None:
    server = handshake.Connection(handshake.Side.SERVER)
    big = checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION, messages.Kind.PUSH, 1, 0, 10,
                             500 << 20)
    with pytest.raises(LimitExceeded, match="buffer count"):
        server.receive(big)
    hello = control.Hello(role="worker", nonce=b"n" * 32,
                           address="h" * 4096)  # the longest address
    server = handshake.Connection(handshake.Side.SERVER)
    assert server.receive(b"".join(frames.encode(hello))) == [hello]
    server.send(control.Challenge(nonce=b"c" * 32))
    server.receive(b"".join(frames.encode(control.Auth(mac=b"m" * 32))))
    server.send(control.Welcome(worker_id=0, mac=b"", info={}))
    push = messages.Push(clock=1, payload=Payload("dense-f32", {}, (np.ones(1 << 20, np.float32),)))
    got = server.receive(b"".join(bytes(memoryview(b).cast("B")) for b in frames.encode(push)))
    assert len(got) == 1 and isinstance(got[0], messages.Push)
    assert got[0].payload.buffers[0].nbytes == 4 << 20  # full size after WELCOME


def test_a_client_connection_is_not_limited_before_welcome() -> None:
    client = handshake.Connection(handshake.Side.CLIENT)
    client.send(control.Hello(role="worker", nonce=b"n" * 32))
    client.receive(b"".join(frames.encode(control.Challenge(nonce=b"c" * 32))))
    client.send(control.Auth(mac=b""))
    welcome = control.Welcome(worker_id=0, mac=b"", info={"config": "x" * 60_000})
    assert client.receive(b"".join(frames.encode(welcome))) == [welcome]
