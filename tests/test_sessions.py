"""One session per worker id, over loopback with hand-written protocol clients.

docs/protocol.md, section 9: a second connection with a worker id already in session takes the
session over and the old connection is told why (ERROR ``replaced``), on the global server's
control channel and on a group server alike; a worker that gets it stops. A HELLO with
``worker_id`` -1 gets an id never given out, else the id of a worker that is gone, so a worker
restarted without its old id is not refused once every id was used.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import recv_as, until
from test_server import TOKEN, in_proc, join, make_server

from minips.core import roster
from minips.core.config import RunConfig
from minips.errors import AuthError
from minips.net import channel, transport
from minips.net.endpoints import parse_address
from minips.serve import sessions
from minips.wire import control, messages


async def connect(port: int, wid: int, group: int = -1,
                  host: str = "127.0.0.1") -> channel.Channel:
    return await transport.connect(host, port, role="worker", worker_id=wid, group=group,
                                   token=TOKEN, timeout=5)


async def told_replaced(ch: channel.Channel) -> None:
    """The old connection gets ERROR replaced, then the server closes it."""
    error = await recv_as(ch, control.Error, 5)
    assert error.code == "replaced" and "worker id 0" in error.reason
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(ch.recv(), 5)


async def test_second_control_connection_with_an_id_replaces_the_first_and_says_so(
        tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    first = await connect(port, 0)
    try:
        await until(lambda: srv.core.workers[0].connected)
        second = await connect(port, 0)
        await told_replaced(first)
        await second.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
        assert (await recv_as(second, control.Assign, 5)).group == 0  # the newcomer goes on
        assert srv.rejected["replaced"] == 1
        await second.close()
    finally:
        await first.close()
        await srv.close()


async def test_second_group_connection_with_an_id_replaces_the_first_and_says_so(
        tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    ctl = await join(port, 0, 0.01)
    chans: list[channel.Channel] = []
    try:
        assign = await recv_as(ctl, control.Assign, 5)
        host, gport = parse_address(assign.address)
        chans.append(await connect(gport, 0, assign.group, host))
        await recv_as(chans[0], messages.Ack, 5)
        chans.append(await connect(gport, 0, assign.group, host))
        await told_replaced(chans[0])
        start = await recv_as(chans[1], messages.Ack, 5)
        await chans[1].send(messages.Pull(clock=start.clock))
        assert (await recv_as(chans[1], messages.Weights, 5)).done is False
        assert in_proc(srv, 0).rejected["replaced"] == 1
    finally:
        for ch in (*chans, ctl):
            await ch.close()
        await srv.close()


async def test_minus_one_reuses_the_id_of_a_worker_that_is_gone(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    try:
        first = await connect(port, -1)
        assert first.worker_id == 0
        await until(lambda: srv.core.workers[0].connected)
        with pytest.raises(AuthError, match="no free worker id: all 1 are connected"):
            await connect(port, -1)
        await first.close()  # the worker crashed: its control connection is gone
        await until(lambda: not srv.core.workers[0].connected)
        again = await connect(port, -1)  # restarted without its old id
        assert again.worker_id == 0
        await again.close()
    finally:
        await srv.close()


async def test_concurrent_minus_one_hellos_get_different_ids(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=3, mode="asp")
    port = await srv.start()
    try:
        first = await connect(port, -1)
        await until(lambda: srv.core.workers[0].connected)
        await first.close()
        await until(lambda: not srv.core.workers[0].connected)
        # id 0 is free again, 1 and 2 never used: three at once get three ids, none twice
        chans = await asyncio.gather(*(connect(port, -1) for _ in range(3)))
        assert sorted(ch.worker_id for ch in chans) == [0, 1, 2]
        for ch in chans:
            await ch.close()
    finally:
        await srv.close()


def test_a_worker_told_replaced_stops_instead_of_reconnecting() -> None:
    from minips.worker import Stopped

    stop = Stopped(control.Error(code="replaced", reason="another connection"))
    assert stop.final and "replaced" in stop.error
    assert not Stopped(control.Error(code="lease", reason="expired")).final


def test_an_id_is_held_for_its_handshake_and_freed_if_it_never_finishes() -> None:
    r = roster.Roster(RunConfig(workers=2), regroup=False)
    assert r.admit(-1, now=0.0) == 0
    assert r.admit(-1, now=1.0) == 1  # 0 is held for the handshake it was given to
    with pytest.raises(AuthError, match="no free worker id"):
        r.admit(-1, now=2.0)
    r.workers[0].connected = True  # worker 0's session started
    r.seated(0)
    with pytest.raises(AuthError, match="no free worker id"):
        r.admit(-1, now=1.0 + roster.CLAIM_S - 0.1)
    assert r.admit(-1, now=1.0 + roster.CLAIM_S) == 1  # 1's handshake never finished


class ResumedShell:
    """What ``sessions.awaited`` uses of a resumed global server: two checkpointed groups that
    no process serves yet, a lease of 0.5 s (1.5 s before a group is said lost, as long again
    before its workers move), the actions it performs."""

    def __init__(self) -> None:
        self.core = SimpleNamespace(
            groups={0: roster.GroupHandle(0, "", [0]), 1: roster.GroupHandle(1, "", [1])},
            done=False, run=SimpleNamespace(lease_s=0.5),
            group_lost=lambda g: [("group_lost", g)], rehome=lambda g: [("rehome", g)])
        self.performed: list[object] = []

    def perform(self, actions: list[object]) -> None:
        self.performed += actions


SERVED_S = 2.5 * sessions.ADOPTION_POLL_S  # an adoption the watcher's polls cannot miss


async def test_a_resumed_server_says_lost_only_a_group_never_adopted_since() -> None:
    """A group adopted after the resume and lost again while live is said lost by that loss
    (``_lost``), not a second time by the resume's watcher (the 30-minute soak, seed 0: two
    `group_lost` lines 0.1 s apart, 12 s after a resume); one never adopted is said lost once
    and its workers move a wait later; a group adopted within that wait and lost again does not
    move then (its loss waits anew: the soak's seed 0 rehomed a group 0.9 s after such a loss)."""
    srv = ResumedShell()
    adopted = asyncio.ensure_future(sessions.awaited(srv, 0))  # type: ignore[arg-type]
    srv.core.groups[0].served = True  # its group process came back
    await asyncio.sleep(SERVED_S)
    srv.core.groups[0].served = False  # and was lost while serving: `_lost` said it
    await asyncio.wait_for(adopted, 5)
    assert srv.performed == []
    await asyncio.wait_for(sessions.awaited(srv, 1), 5)  # type: ignore[arg-type]
    assert srv.performed == [("group_lost", 1), ("rehome", 1)]

    srv = ResumedShell()
    lone = asyncio.ensure_future(sessions.awaited(srv, 1))  # type: ignore[arg-type]
    await until(lambda: bool(srv.performed), 5)
    assert srv.performed == [("group_lost", 1)]
    srv.core.groups[1].served = True  # adopted while its workers wait to move
    await asyncio.sleep(SERVED_S)
    srv.core.groups[1].served = False
    await asyncio.wait_for(lone, 5)
    assert srv.performed == [("group_lost", 1)]
