"""Group server: BSP averaging, the SSP bound, leases, the lossless exchange, the wire session."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import recv_as

from minips import sparse
from minips.core.config import RunConfig
from minips.core.exchange import ExchangeResult
from minips.net import transport
from minips.serve.group import GroupServer
from minips.wire import control, messages
from minips.wire.fields import Payload

TOKEN = "group-test"


class Global:
    """The global side of the exchange, reduced to the default merge rule of ``groups`` groups:
    the mean of their deltas, so each exchange adds delta / groups (GlobalServer.merge; the
    test with the real server is test_global_merge_of_k_groups_is_the_mean_of_their_deltas)."""

    def __init__(self, weights: np.ndarray, groups: int = 1) -> None:
        self.groups = groups
        self.weights = weights.astype(np.float32).copy()
        self.version = 0
        self.gate: asyncio.Event | None = None  # when set: exchanges wait for it (slow link)
        self.stats: list[dict[str, Any]] = []
        self.samples = 0  # what the reply says all groups have trained on

    async def exchange(self, group: int, delta: Any,
                       stats: dict[str, Any]) -> ExchangeResult:
        if self.gate is not None:
            await self.gate.wait()
        self.weights += delta * np.float32(1.0 / self.groups)
        self.version += 1
        self.stats.append(stats)
        return ExchangeResult(self.weights.copy(), self.version, False, self.samples)


def plain(mode: str, **kw: Any) -> RunConfig:
    """lr 1, no momentum, no decay: an update is exactly w -= g."""
    return RunConfig(mode=mode, lr=1.0, momentum=0.0, weight_decay=0.0, lr_warmup=0.0, **kw)


def push(clock: int, grad: Any) -> messages.Push:
    encoding, codec, buffers = sparse.encode_vector(grad)
    return messages.Push(clock=clock, samples=1, payload=Payload(encoding, codec,
                         tuple(buffers)))


def vec(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


async def test_bsp_averages_one_round_and_applies_it_once() -> None:
    gs = GroupServer(0, plain("bsp", sync_every=100), np.zeros(3, np.float32),
                     Global(np.zeros(3)), members=[0, 1])
    gs.on_push(0, push(1, vec(2, 0, 4)))
    assert gs.core.version == 0 and not gs.core.weights.any()  # waits for worker 1
    ack = gs.on_push(1, push(1, sparse.SparseVector(np.array([1], np.uint32), vec(6), 3)))
    np.testing.assert_array_equal(gs.core.weights, vec(-1, -3, -2))
    assert gs.core.version == 1 and ack.version == 1


async def test_ssp_pull_waits_for_the_slowest_and_says_whom() -> None:
    gs = GroupServer(0, plain("ssp", staleness=1, sync_every=100), np.zeros(2, np.float32),
                     Global(np.zeros(2)), members=[0, 1])
    gs.on_push(0, push(1, vec(1, 0)))
    first = await asyncio.wait_for(gs.answer_pull(0), 1)  # clock 1, slowest 0: 1 <= s
    assert first.info["waited_for"] == []
    gs.on_push(0, push(2, vec(1, 0)))
    pull = asyncio.ensure_future(gs.answer_pull(0))  # clock 2 - 0 > 1: must wait for 1
    await asyncio.sleep(0.05)
    assert not pull.done()
    gs.on_push(1, push(1, vec(0, 1)))
    w = await asyncio.wait_for(pull, 1)
    assert w.info["waited_for"] == [1] and w.info["lead"] == 1
    # each push of a 2-worker group moves the weights by lr / 2
    np.testing.assert_array_equal(np.frombuffer(w.payload.buffers[0], np.float32), vec(-1, -0.5))


async def test_lease_expiry_releases_the_waiting_worker() -> None:
    now = [0.0]
    gs = GroupServer(0, plain("ssp", staleness=0, lease_s=5.0, sync_every=100),
                     np.zeros(2, np.float32), Global(np.zeros(2)), members=[0, 1],
                     clock=lambda: now[0])
    gs.ready.set()
    expire = asyncio.ensure_future(gs._expire_loop())
    try:
        gs.on_push(0, push(1, vec(1, 1)))
        pull = asyncio.ensure_future(gs.answer_pull(0))  # worker 1 never shows up
        await asyncio.sleep(0.05)
        assert not pull.done()
        now[0] = 60.0  # worker 1's lease (and 0's, but 0's pull keeps it) runs out
        gs.core.table.heartbeat(0, now[0])
        w = await asyncio.wait_for(pull, 3)
        assert 1 not in gs.core.table and w.done is False
    finally:
        expire.cancel()


@pytest.mark.parametrize("groups", [1, 2])
async def test_exchange_in_flight_loses_no_update(groups: int) -> None:
    glob = Global(np.zeros(4), groups)
    glob.gate = asyncio.Event()
    servers = [GroupServer(g, plain("asp", sync_every=1), np.zeros(4, np.float32), glob,
                           members=[0]) for g in range(groups)]
    rng = np.random.default_rng(0)
    total = np.zeros(4, np.float32)
    for clock in range(1, 6):  # the first push starts an exchange that hangs on the gate
        for gs in servers:
            g = rng.normal(size=4).astype(np.float32)
            total += g
            gs.on_push(0, push(clock, g))
    assert glob.version == 0
    glob.gate.set()
    for gs in servers:
        await gs.flush(final=True)
    np.testing.assert_allclose(glob.weights, -total / groups, rtol=1e-5, atol=1e-5)
    if groups == 1:
        np.testing.assert_allclose(servers[0].core.weights, glob.weights, rtol=1e-5, atol=1e-5)
    assert glob.stats[-1]["final"] is True
    assert sum(s["pushes"] for s in glob.stats) == 5 * groups


async def test_finish_answers_waiting_pulls_with_done() -> None:
    gs = GroupServer(0, plain("bsp", sync_every=100), np.zeros(2, np.float32),
                     Global(np.zeros(2)), members=[0, 1])
    gs.on_push(0, push(1, vec(1, 1)))
    pull = asyncio.ensure_future(gs.answer_pull(0))
    await asyncio.sleep(0.02)
    gs.finish()
    assert (await asyncio.wait_for(pull, 1)).done is True


async def test_wire_session_ack_pull_push_and_bad_clock() -> None:
    glob = Global(vec(1, 2, 3))
    gs = GroupServer(3, plain("ssp", staleness=2, sync_every=2), vec(1, 2, 3), glob,
                     members=[7])  # one member: each push is a whole step
    port = await gs.serve("127.0.0.1", 0, TOKEN)
    ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=7, token=TOKEN)
    try:
        assert isinstance(await ch.recv(), messages.Ack)  # starting clock 0
        await ch.send(messages.Pull(clock=0))
        w = await ch.recv()
        assert isinstance(w, messages.Weights) and w.info["group"] == 3
        for clock in (1, 2):
            if clock > 1:
                await ch.send(messages.Pull(clock=clock - 1))
                assert isinstance(await ch.recv(), messages.Weights)
            await ch.send(push(clock, vec(1, 1, 1)))
            assert (await recv_as(ch, messages.Ack)).clock == clock
        await asyncio.wait_for(gs.flush(), 2)
        np.testing.assert_allclose(glob.weights, vec(-1, 0, 1))
        assert glob.stats[0]["pushes"] == 2
        await ch.send(messages.Pull(clock=4))  # claims clock 4 while the server says 2
        assert isinstance(await ch.recv(), messages.Weights)
        await ch.send(push(5, vec(1, 1, 1)))  # skips clocks 3 and 4
        err = await ch.recv()
        assert isinstance(err, control.Error) and err.code == "clock"
    finally:
        await ch.close()
        await gs.close()
    assert gs.traffic()["bytes_in"] > 0


async def test_cosine_lr_follows_this_group_then_every_group_s_samples() -> None:
    # budget 1 epoch of 4 samples; one push = 1 sample; lr 1, gradient 1: each step is -factor
    run = plain("ssp", sync_every=100, lr_schedule="cosine", epochs=1.0, train_size=4)
    glob = Global(np.zeros(1))
    gs = GroupServer(0, run, np.zeros(1, np.float32), glob, members=[0])
    for clock in (1, 2, 3, 4):  # seen before each step: 0, 1, 2, 3 -> factors 1, .854, .5, .146
        gs.on_push(0, push(clock, vec(1)))
    np.testing.assert_allclose(gs.core.weights, vec(-2.5), rtol=1e-6)
    # a new group learns from its first exchange that the cluster has trained on 2 samples
    fresh = GroupServer(0, run, np.zeros(1, np.float32), glob, members=[0])
    glob.samples = 2
    await asyncio.wait_for(fresh.flush(), 5)
    fresh.on_push(0, push(1, vec(1)))  # seen = 2 of 4: factor 0.5
    np.testing.assert_allclose(fresh.core.weights, vec(-0.5), rtol=1e-6)


def test_exchange_counts_cluster_samples_from_the_last_reply_on() -> None:
    from minips.core.exchange import GroupSync

    xchg = GroupSync(np.zeros(1, np.float32))
    xchg.count(64, 0.1, 2.0)
    assert xchg.cluster_samples() == 64  # no reply yet: only this group's own
    out = xchg.begin(np.zeros(1, np.float32), {})
    xchg.count(32, 0.1, 2.0)  # a push applied while the exchange is in flight
    xchg.complete(np.zeros(1, np.float32), out, ExchangeResult(np.zeros(1, np.float32), 1, False,
                                                               samples=1000))
    assert xchg.cluster_samples() == 1032  # the reply does not count the 32 in flight yet
    xchg.count(16, 0.1, 2.0)
    assert xchg.cluster_samples() == 1048


@pytest.mark.parametrize("merge, scale", [("mean", 1 / 3), ("sum", 1.0)])
async def test_global_merge_of_k_groups_is_the_mean_of_their_deltas(
        tmp_path: Path, merge: str, scale: float) -> None:
    """Three group servers exchange through the real GlobalServer.merge (the in-process link):
    the global weights move by the mean of their deltas (delta / 3 each), or by their sum."""
    from test_server import make_server

    from minips.core.roster import GroupHandle
    from minips.server import InProcLink

    srv = make_server(tmp_path, np.zeros(4, np.float32), workers=3, mode="asp", lr=1.0,
                      momentum=0.0, weight_decay=0.0, sync_every=1, merge=merge)
    for g in range(3):
        srv.core.group_opened(GroupHandle(g, "", [g]), 0.0)
    assert srv.core.weights is not None
    servers = [GroupServer(g, srv.core.run, srv.core.weights, InProcLink(srv), members=[g])
               for g in range(3)]
    grads = [vec(3, 0, 0, 6), vec(0, 3, 0, 6), vec(0, 0, 3, -3)]
    try:
        for g, gs in enumerate(servers):
            gs.on_push(g, push(1, grads[g]))  # each group's weights: -grad, its delta: -grad
        for gs in servers:
            await gs.flush(final=True)
        expected = -np.float32(scale) * np.sum(grads, axis=0)
        np.testing.assert_allclose(srv.core.weights, expected, rtol=1e-6)
        assert srv.core.version >= 3 and sum(h.merges for h in srv.core.groups.values()) >= 3
    finally:
        for gs in servers:
            await gs.close()
        await srv.close()
