"""The wait for workers to come back (``--rejoin-wait``) counts from the latest end of a group:
a group process that adopts the group meanwhile, exchanges and leaves starts it over (issue 43,
departure 3: it was counted from the first group process's LEAVE, so ``workers_gone`` came
1.0 s after the second one's with ``--rejoin-wait 2``). A real global server on loopback, its
group processes played by hand (tests/raw_group.py), a worker's control channel watching for
ERROR ``workers_gone``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import recv_as
from raw_group import Cluster

from minips.net.channel import Channel
from minips.wire import control, messages

REJOIN_WAIT_S = 2.0


async def final_and_leave(cluster: Cluster, ch: Channel, session: int, final: bool) -> None:
    """A group process's PULL, one EXCHANGE (``final`` or not) and LEAVE."""
    await cluster.pull(ch)
    reply = await cluster.exchange(ch, session=session, seq=1, final=final, samples=1, pushes=1)
    assert isinstance(reply, messages.ExchangeReply)
    await ch.send(control.Leave(reason="bye"))


async def gone_at(ctl: Channel) -> float:
    """When ERROR ``workers_gone`` arrives on a worker's control channel (its ASSIGNs, again
    when its group is adopted, are skipped)."""
    while isinstance(error := await asyncio.wait_for(ctl.recv(), 30), control.Assign):
        pass
    assert isinstance(error, control.Error) and error.code == "workers_gone", error
    return time.monotonic()


@pytest.mark.timeout(60)
async def test_the_wait_for_workers_starts_over_when_a_group_is_adopted_and_left(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, groups=1, epochs=1.0)
    cluster.srv.cfg.rejoin_wait_s = REJOIN_WAIT_S
    await cluster.start()
    try:
        gone = asyncio.create_task(gone_at(cluster.ctls[0]))
        await final_and_leave(cluster, cluster.groups[0], session=1, final=True)  # wait starts
        await asyncio.sleep(0.6 * REJOIN_WAIT_S)  # part of the wait passes (the scenario's time)
        second = await cluster.connect_group(7301)  # adopts the group, takes the run up again
        assign = await recv_as(second, control.Assign, 10)
        assert assign.group == 0
        await final_and_leave(cluster, second, session=2, final=False)
        left = time.monotonic()
        waited = await asyncio.wait_for(gone, 30) - left
        assert REJOIN_WAIT_S - 0.1 <= waited <= REJOIN_WAIT_S + 2.0, waited
        assert cluster.srv.failure and "--rejoin-wait" in cluster.srv.failure
    finally:
        await cluster.close()


@pytest.mark.timeout(60)
async def test_an_adoption_alone_starts_the_wait_over(tmp_path: Path) -> None:
    """A group process that adopts the group and has not exchanged yet (its workers are on
    their way back) gets the whole wait from its adoption."""
    cluster = Cluster(tmp_path, groups=1, epochs=1.0)
    cluster.srv.cfg.rejoin_wait_s = REJOIN_WAIT_S
    await cluster.start()
    try:
        gone = asyncio.create_task(gone_at(cluster.ctls[0]))
        await final_and_leave(cluster, cluster.groups[0], session=1, final=True)
        await asyncio.sleep(0.6 * REJOIN_WAIT_S)  # part of the wait passes (the scenario's time)
        second = await cluster.connect_group(7301)
        await recv_as(second, control.Assign, 10)
        adopted = time.monotonic()
        waited = await asyncio.wait_for(gone, 30) - adopted
        assert REJOIN_WAIT_S - 0.1 <= waited <= REJOIN_WAIT_S + 2.0, waited
    finally:
        await cluster.close()
