"""Exactly once for every (session, seq) of a group process: an EXCHANGE whose seq is not above
the last merged one of its session, a repeat or an older one replayed after newer ones, is
answered (EXCHANGE_REPLY) without merging again, also on a later connection and after another
session merged; an EXCHANGE before its connection's first PULL is refused with ERROR ``order``.
Against a real in-process global server over loopback (tests/raw_group.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import recv_as
from raw_group import Cluster, closed

from minips.core.replay import MAX_SESSIONS, Merged
from minips.record.rundir import read_jsonl
from minips.wire import control, messages

pytestmark = pytest.mark.timeout(60)


async def test_an_older_exchange_replayed_after_newer_ones_is_not_merged_again(
        tmp_path: Path) -> None:
    c = await Cluster(tmp_path).start()
    ch = c.groups[0]
    try:
        await c.pull(ch)
        for seq in (1, 2):
            assert isinstance(await c.exchange(ch, seq=seq, samples=64), messages.ExchangeReply)
        assert c.srv.core.samples == 128 and c.srv.core.version == 2
        for seq in (1, 2, 0):  # older, the last again, one never sent but below the last
            reply = await c.exchange(ch, seq=seq, samples=64)
            assert isinstance(reply, messages.ExchangeReply) and reply.samples == 128
        assert c.srv.core.samples == 128 and c.srv.core.version == 2  # was 192 (merged again)
        np.testing.assert_array_equal(c.weights(), np.full(6, 2.0, np.float32))
        assert isinstance(await c.exchange(ch, seq=3, samples=64), messages.ExchangeReply)
        assert c.srv.core.samples == 192  # the next new seq is merged
    finally:
        await c.close()
    repeats = [r for r in read_jsonl(tmp_path / "global.jsonl") if r["event"] == "merge_repeat"]
    assert [(r["seq"], r["merged_seq"]) for r in repeats] == [(1, 2), (2, 2), (0, 2)]


async def test_each_session_keeps_its_own_last_seq_across_connections(tmp_path: Path) -> None:
    """A new group process (another session) starts at seq 1 and is merged; the old session's
    exchanges replayed on a later connection are not merged again."""
    c = await Cluster(tmp_path).start()
    try:
        first = c.groups[0]
        await c.pull(first)
        await c.exchange(first, session=11, seq=5, samples=64)
        await c.exchange(first, session=22, seq=1, samples=64)  # a new process's first
        assert c.srv.core.samples == 128
        await first.close()  # the group is lost; the next group process adopts it
        again = await c.connect_group(7399)
        assert (await recv_as(again, control.Assign)).group == 0
        await c.pull(again)
        for session, seq in ((11, 4), (11, 5), (22, 1)):
            reply = await c.exchange(again, session=session, seq=seq, samples=64)
            assert isinstance(reply, messages.ExchangeReply) and reply.samples == 128
        assert c.srv.core.version == 2
        np.testing.assert_array_equal(c.weights(), np.full(6, 2.0, np.float32))
    finally:
        await c.close()


async def test_an_exchange_before_the_connections_first_pull_is_refused_with_order(
        tmp_path: Path) -> None:
    c = await Cluster(tmp_path).start()
    ch = c.groups[0]
    try:
        reply = await c.exchange(ch, seq=1, samples=64)
        assert isinstance(reply, control.Error) and reply.code == "order", reply
        assert "PULL" in reply.reason
        assert await closed(ch)
        assert c.srv.core.samples == 0 and c.srv.core.version == 0
        np.testing.assert_array_equal(c.weights(), np.zeros(6, np.float32))
        assert c.srv.rejected["order"] == 1
        again = await c.connect_group(7399)  # a well-behaved one: PULL, then EXCHANGE
        assert (await recv_as(again, control.Assign)).group == 0
        await c.pull(again)
        assert isinstance(await c.exchange(again, seq=1, samples=64), messages.ExchangeReply)
        assert c.srv.core.samples == 64
    finally:
        await c.close()


def test_the_sessions_remembered_are_bounded_and_survive_a_checkpoint() -> None:
    merged = Merged()
    for session in range(MAX_SESSIONS):
        merged.note(session, 3)
    assert len(merged.last) == MAX_SESSIONS and merged.full(MAX_SESSIONS)  # a new one: refused
    assert merged.holds(0, 3) and not merged.full(0)  # the oldest is never forgotten
    merged.note(10, 4)  # merged again: now the newest
    back = Merged(merged.pairs())
    assert back.last == merged.last and list(back.last)[-1] == 10
