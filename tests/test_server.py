"""Global server over loopback with hand-written protocol clients (no torch here).

Admission, speed calibration and grouping, GDTopK ratios, merging, the epoch budget and the
end of a run, the evaluator's view, initial weights from the first worker, an exchange whose
reply was lost merged exactly once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import minips_server, records, recv_as, until

from minips import sparse
from minips.core import roster
from minips.core.config import PARAM_COUNTS, RunConfig
from minips.core.roster import GroupHandle, match_labels
from minips.errors import AuthError, RemoteProtocolError
from minips.net import transport
from minips.net.endpoints import parse_address, reachable
from minips.record.rundir import read_jsonl
from minips.serve.group import GroupServer
from minips.server import GlobalServer, InProcGroup, InProcLink, ServerConfig
from minips.wire import control, kinds, messages
from minips.wire.fields import Payload

TOKEN = "server-test-secret-0123"


def make_server(tmp_path: Path, init: np.ndarray | None = None, host: str = "127.0.0.1",
                external_groups: int = 0, **run: Any) -> GlobalServer:
    cfg = ServerConfig(run=RunConfig(lr_warmup=0.0, **run), host=host, port=0, token=TOKEN,
                       run_dir=str(tmp_path), calib_timeout_s=10.0, linger_s=1.0,
                       external_groups=external_groups)
    return GlobalServer(cfg, init)


async def join(port: int, wid: int, step_time: float) -> Any:
    ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=wid, token=TOKEN)
    await ch.send(control.Stats(clock=0, step_time=step_time, loss=2.3))
    return ch


async def next_assign(ch: Any) -> control.Assign:
    """The next ASSIGN on a worker's or group's channel (HEARTBEAT, WEIGHTS and EXCHANGE_REPLY
    skipped)."""
    while not isinstance(msg := await asyncio.wait_for(ch.recv(), 5), control.Assign):
        assert isinstance(msg, (control.Heartbeat, messages.Weights, messages.ExchangeReply)), msg
    return msg


def push(clock: int, grad: np.ndarray, samples: int = 1) -> messages.Push:
    encoding, codec, buffers = sparse.encode_vector(grad)
    return messages.Push(clock=clock, samples=samples, payload=Payload(encoding, codec,
                         tuple(buffers)))


async def test_refuses_wrong_secret_and_unknown_worker_id(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=2)
    port = await srv.start()
    try:
        with pytest.raises(AuthError):
            await transport.connect("127.0.0.1", port, role="worker", token="wrong", timeout=3)
        with pytest.raises(AuthError, match="out of range"):
            await transport.connect("127.0.0.1", port, role="worker", worker_id=5, token=TOKEN,
                                    timeout=3)
        with pytest.raises(AuthError, match="in-process"):
            await transport.connect("127.0.0.1", port, role="group", token=TOKEN, timeout=3)
    finally:
        await srv.close()


def in_proc(srv: GlobalServer, g: int) -> GroupServer:
    """Group ``g``'s server, which runs in ``srv``'s process."""
    peer = srv.peers[g]
    assert isinstance(peer, InProcGroup)
    return peer.server


def push_mean(srv: GlobalServer, ratios: dict[int, float], workers: dict[int, int]) -> float:
    """GDTopK's mean kept fraction over the pushes (compress/ratios.py): group g makes workers[g] /
    t_g pushes a second at the iteration time t_g its policy holds."""
    times = srv.core.roster.policy.times  # type: ignore[union-attr]
    pushes = {g: workers[g] / times[g] for g in ratios}
    return sum(pushes[g] * r for g, r in ratios.items()) / sum(pushes.values())


async def test_gssp_groups_by_speed_with_gdtopk_ratios(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(8, np.float32), workers=4, mode="gssp",
                      compressor="gdtopk", ratio=0.004)
    port = await srv.start()
    chans = [await join(port, w, t) for w, t in enumerate([0.01, 0.011, 0.05, 0.052])]
    try:
        assigns = [await asyncio.wait_for(ch.recv(), 5) for ch in chans]
        assert [a.group for a in assigns] == [0, 0, 1, 1]
        assert assigns[0].address == assigns[1].address != assigns[2].address
        assert assigns[0].staleness == 3
        ratios = {0: assigns[0].ratio, 1: assigns[2].ratio}
        assert push_mean(srv, ratios, {0: 2, 1: 2}) == pytest.approx(0.004)  # mean held
        assert assigns[2].ratio > 4 * assigns[0].ratio  # slower group sends more
        assert [in_proc(srv, g).core.ratio for g in (0, 1)] == [assigns[0].ratio,
                                                           assigns[2].ratio]
        host, gport = parse_address(assigns[2].address)
        ch = await transport.connect(host, gport, role="worker", worker_id=2, token=TOKEN)
        assert isinstance(await ch.recv(), messages.Ack)
        await ch.close()
        # measured iteration times (exchanges) turn the ratios around: group 0 is now slower
        srv.core.roster.policy.every_s = 0.0  # type: ignore[union-attr]
        srv.core.roster.observe_iter_time(0, 0.5, 0.0)
        actions = srv.core.merge(1, np.zeros(8, np.float32), {"samples": 1, "iter_time": 0.1},
                                 time.monotonic())
        srv.perform(actions)  # the merge's actions: SendSettings
        later = [await next_assign(c) for c in chans]
        assert [a.group for a in later] == [0, 0, 1, 1]
        assert later[0].ratio == pytest.approx(5 * later[2].ratio)
        ratios = {0: later[0].ratio, 1: later[2].ratio}
        assert push_mean(srv, ratios, {0: 2, 1: 2}) == pytest.approx(0.004)
        assert in_proc(srv, 0).core.ratio == later[0].ratio  # one owner: what the group reads
    finally:
        for ch in chans:
            await ch.close()
        await srv.close()
    log = read_jsonl(tmp_path / "global.jsonl")
    assert "groups" in [r["event"] for r in log]
    changes = [r for r in log if r["event"] == "ratios"]
    assert changes[-1]["ratios"] == {"0": later[0].ratio, "1": later[2].ratio}
    assert changes[-1]["iter_time"] == {"0": 0.5, "1": 0.1}


async def test_on_every_interface_a_worker_reaches_its_group_where_it_reached_the_server(
        tmp_path: Path) -> None:
    """A server on 0.0.0.0 (several machines): its group servers listen there too, and ASSIGN
    names no host (":port"), so a worker that dialled 127.0.0.2 dials 127.0.0.2 again, as it
    would a DNS name or a NAT address; never a loopback address of the server's machine."""
    srv = make_server(tmp_path, np.zeros(4, np.float32), host="0.0.0.0", workers=1, mode="ssp")
    port = await srv.start()
    ctl = await transport.connect("127.0.0.2", port, role="worker", worker_id=0, token=TOKEN)
    try:
        await ctl.send(control.Stats(clock=0, step_time=0.01, loss=2.3))
        assign = await recv_as(ctl, control.Assign, 5)
        assert assign.address.startswith(":")
        host, gport = parse_address(reachable(assign.address, "127.0.0.2"))
        assert host == "127.0.0.2"
        groups = [r for r in read_jsonl(tmp_path / "global.jsonl") if r.get("event") == "groups"]
        assert groups[0]["addresses"] == {"0": f":{gport}"}  # the port, for firewalls
        ch = await transport.connect(host, gport, role="worker", worker_id=0, group=assign.group,
                                     token=TOKEN)
        assert isinstance(await asyncio.wait_for(ch.recv(), 5), messages.Ack)
        await ch.close()
    finally:
        await ctl.close()
        await srv.close()


async def test_a_group_process_on_every_interface_is_announced_at_its_connection_host(
        tmp_path: Path) -> None:
    """A group process that listens on 0.0.0.0 says so in HELLO; workers are told the host the
    global server sees it connect from (here 127.0.0.1), never the wildcard."""
    srv = make_server(tmp_path, np.zeros(4, np.float32), external_groups=1, workers=1,
                      mode="ssp")
    port = await srv.start()
    grp = await transport.connect("127.0.0.1", port, role="group", address="0.0.0.0:7123",
                                  token=TOKEN)
    ctl = await join(port, 0, 0.01)
    try:
        to_group = await asyncio.wait_for(grp.recv(), 5)
        to_worker = await asyncio.wait_for(ctl.recv(), 5)
        assert isinstance(to_worker, control.Assign) and to_worker.address == "127.0.0.1:7123"
        assert isinstance(to_group, control.Assign) and to_group.group == to_worker.group
    finally:
        await ctl.close()
        await grp.close()
        await srv.close()


async def test_group_processes_get_their_gdtopk_ratio_and_every_change_of_it(
        tmp_path: Path) -> None:
    """`minips group` processes: the first ASSIGN carries the group's own ratio (not the run's),
    and an exchange whose iteration time changes the ratios sends each group a new ASSIGN."""
    srv = make_server(tmp_path, np.zeros(4, np.float32), external_groups=2, workers=2,
                      mode="gssp", groups=2, compressor="gdtopk", ratio=0.01)
    port = await srv.start()
    grps = [await transport.connect("127.0.0.1", port, role="group", token=TOKEN,
                                    address=f"127.0.0.1:{7200 + i}") for i in range(2)]
    ctls = [await join(port, 0, 0.01), await join(port, 1, 0.04)]
    try:
        first = {a.group: (a.ratio, ch) for ch in grps if (a := await next_assign(ch))}
        assert first[1][0] == pytest.approx(4 * first[0][0])  # slower-more: the slow one sends more
        ratios = {g: r for g, (r, _) in first.items()}
        assert push_mean(srv, ratios, {0: 1, 1: 1}) == pytest.approx(0.01)  # the run's ratio
        srv.core.roster.policy.every_s = 0.0  # type: ignore[union-attr]
        await first[0][1].send(messages.Pull(clock=0))  # a group process PULLs, then exchanges
        await recv_as(first[0][1], messages.GlobalWeights, 5)
        await first[0][1].send(messages.Exchange(samples=1, iter_time=0.5, session=1, seq=1,
                                                 payload=Payload("dense-f32", {},
                                                 (np.zeros(4, np.float32),))))
        later = {g: (await next_assign(ch)).ratio for g, (_, ch) in first.items()}
        assert later[0] > later[1]  # group 0 now iterates slower than group 1's 0.04 s
        assert push_mean(srv, later, {0: 1, 1: 1}) == pytest.approx(0.01)
        assert {g: h.ratio for g, h in srv.core.groups.items()} == later
    finally:
        for ch in ctls + grps:
            await ch.close()
        await srv.close()


async def test_epoch_budget_ends_the_run_and_nothing_is_lost(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(2, np.float32), workers=1, mode="asp", sync_every=1,
                      lr=1.0, momentum=0.0, weight_decay=0.0, epochs=1.0, train_size=3)
    port = await srv.start()
    ctl = await join(port, 0, 0.01)
    assign = await asyncio.wait_for(ctl.recv(), 5)
    host, gport = parse_address(assign.address)
    ch = await transport.connect(host, gport, role="worker", worker_id=0, token=TOKEN)
    await ch.recv()  # ACK with the starting clock
    for clock in (1, 2, 3):
        await ch.send(messages.Pull(clock=clock - 1))
        assert (await recv_as(ch, messages.Weights)).done is False
        await ch.send(push(clock, np.ones(2, np.float32)))
        await ch.recv()
    leave = await asyncio.wait_for(ctl.recv(), 5)  # budget: 3 samples = 1 epoch
    assert isinstance(leave, control.Leave) and leave.reason == "done"
    await ch.send(messages.Pull(clock=3))
    assert (await recv_as(ch, messages.Weights)).done is True
    await ch.close(leave="bye")
    await ctl.close(leave="bye")
    await asyncio.wait_for(srv.wait_finished(), 5)
    await srv.close()
    assert srv.core.weights is not None
    np.testing.assert_allclose(srv.core.weights, np.full(2, -3.0))
    assert srv.core.samples == 3 and srv.core.done_reason == "epochs"
    assert np.load(tmp_path / "final_weights.npy").tolist() == [-3.0, -3.0]


async def test_initial_weights_from_first_worker_and_evaluator_view(tmp_path: Path) -> None:
    srv = make_server(tmp_path, None, workers=1, mode="bsp", max_steps=1)
    port = await srv.start()
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=-1, token=TOKEN)
    assert ctl.worker_id == 0 and ctl.welcome_info["need_init"] is True
    assert ctl.welcome_info["mode"] == "bsp"
    init = np.arange(5, dtype=np.float32)
    encoding, codec, buffers = sparse.encode_vector(init)
    await ctl.send(messages.InitWeights(size=5, payload=Payload(encoding, codec,
                                 tuple(buffers))))
    ev = await transport.connect("127.0.0.1", port, role="evaluator", token=TOKEN)
    try:
        await ev.send(messages.Pull(clock=0))
        w = await recv_as(ev, messages.GlobalWeights, 5)
        np.testing.assert_array_equal(np.frombuffer(w.payload.buffers[0], np.float32), init)
        assert w.info["samples"] == 0 and "bytes_up" in w.info and w.done is False
    finally:
        await ev.close()
        await ctl.close()
        await srv.close()


async def test_two_workers_both_told_need_init_both_push_and_both_stay(tmp_path: Path) -> None:
    """Workers that join before any initial weights arrived are all told need_init; the first
    PUSH sets the weights and the later ones are dropped, not refused (their workers go on)."""
    srv = make_server(tmp_path, None, workers=2, mode="bsp", max_steps=1)
    port = await srv.start()
    ctls = [await transport.connect("127.0.0.1", port, role="worker", worker_id=-1, token=TOKEN)
            for _ in range(2)]
    try:
        assert all(c.welcome_info["need_init"] is True for c in ctls)
        inits = [np.arange(5, dtype=np.float32) + 10 * i for i in range(2)]
        for ctl, init in zip(ctls, inits, strict=True):
            encoding, codec, buffers = sparse.encode_vector(init)
            await ctl.send(messages.InitWeights(size=5, payload=Payload(encoding, codec,
                                         tuple(buffers))))
        for i, ctl in enumerate(ctls):  # both control channels still carry STATS -> ASSIGN
            await ctl.send(control.Stats(clock=0, step_time=0.01 * (i + 1), loss=1.0,
                                          samples=1))
        for ctl in ctls:
            assert isinstance(await asyncio.wait_for(ctl.recv(), 10), control.Assign)
        assert srv.core.weights is not None and srv.core.weights.tolist() == inits[0].tolist()
        assert not srv.rejected
    finally:
        for ctl in ctls:
            await ctl.close()
        await srv.close()


async def test_initial_weights_of_another_size_are_refused(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(5, np.float32), workers=1, mode="bsp", max_steps=1)
    port = await srv.start()
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=-1, token=TOKEN)
    try:
        encoding, codec, buffers = sparse.encode_vector(np.ones(6, np.float32))
        await ctl.send(messages.InitWeights(size=6, payload=Payload(encoding, codec,
                                     tuple(buffers))))
        msg = await asyncio.wait_for(ctl.recv(), 10)
        assert isinstance(msg, control.Error) and msg.code == "invalid"
        assert "another model size" in msg.reason
        assert srv.core.weights is not None and srv.core.weights.tolist() == [0.0] * 5
    finally:
        await ctl.close()
        await srv.close()


async def test_drifting_speed_moves_a_worker_to_another_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = make_server(tmp_path, np.zeros(4, np.float32), workers=4, mode="gssp", groups=2)
    port = await srv.start()
    chans = [await join(port, w, t) for w, t in enumerate([0.01, 0.01, 0.08, 0.08])]
    try:
        first = [await asyncio.wait_for(ch.recv(), 5) for ch in chans]
        assert [a.group for a in first] == [0, 0, 1, 1]
        monkeypatch.setattr(roster, "REGROUP_EVERY_S", 0.0)
        for _ in range(12):  # worker 1 became as slow as 2 and 3; worker 0 stays fast
            for ch, t in zip(chans, [0.01, 0.08, 0.08, 0.08], strict=True):
                await ch.send(control.Stats(clock=1, step_time=t, loss=2.0))
        moved = await asyncio.wait_for(chans[1].recv(), 5)
        assert isinstance(moved, control.Assign) and moved.group == 1
        assert moved.address == first[2].address
    finally:
        for ch in chans:
            await ch.close()
        await srv.close()
    assert any(r["event"] == "regroup" for r in read_jsonl(tmp_path / "global.jsonl"))


async def test_stats_clock_may_go_back_when_a_worker_changes_group_server(
        tmp_path: Path) -> None:
    """A worker's clock counts steps on its current group server, so after a restarted group
    server (or a move) its STATS clock starts low again; the control session goes on."""
    srv = make_server(tmp_path, np.zeros(4, np.float32), workers=2, mode="gssp", groups=2)
    port = await srv.start()
    chans = [await join(port, w, t) for w, t in enumerate([0.01, 0.08])]
    try:
        for ch in chans:
            assert isinstance(await asyncio.wait_for(ch.recv(), 5), control.Assign)
        for clock in (9, 1, 2):  # 9 steps on the old group server, then 1, 2 on its successor
            await chans[0].send(control.Stats(clock=clock, step_time=0.01, loss=2.0))
            await until(lambda c=clock: srv.core.workers[0].clock == c, 5)  # type: ignore[misc]
        assert srv.core.workers[0].connected and not srv.controls[0].closed
        assert not chans[0].closed
        assert srv.server is not None and srv.server.stats["protocol_errors"] == 0
    finally:
        for ch in chans:
            await ch.close()
        await srv.close()


def test_regroup_labels_follow_the_old_groups() -> None:
    old = {0: 1, 1: 1, 2: 0, 3: 0}
    new = {0: 0, 1: 0, 2: 1, 3: 2}  # same fast pair, the slow pair split in two
    assert match_labels(new, old) == {0: 1, 1: 1, 2: 0, 3: 2}


def test_a_regroup_never_sends_a_worker_to_a_group_that_ended() -> None:
    """`minips ray --mode gssp` (seen once): group 1's only member left, its server flushed its
    last delta; a regroup then split the live workers in two and named the new group 1 (the
    first free label), so worker 2 was sent to a server that had gone."""
    old = {0: 0, 2: 0, 3: 0}  # worker 1, group 1's only member, left: not in the old map
    new = {0: 0, 2: 1, 3: 0}
    assert match_labels(new, old) == {0: 0, 2: 1, 3: 0}  # the old way: group 1 again
    assert match_labels(new, old, {1}) == {0: 0, 2: 2, 3: 0}


class ReplyLost:
    """The in-process link, except that the first reply is lost after the global server merged
    the delta (the network dropped it while the global server stayed up)."""

    def __init__(self, srv: GlobalServer) -> None:
        self.link, self.lost = InProcLink(srv), 0

    async def exchange(self, group: int, delta: Any, stats: dict[str, Any]) -> Any:
        res = await self.link.exchange(group, delta, stats)
        if self.lost == 0:
            self.lost += 1
            raise ConnectionResetError("reply lost")
        return res


@pytest.mark.timeout(60)
async def test_workers_after_the_calibration_deadline_are_assigned_after_their_first_stats(
        tmp_path: Path) -> None:
    """protocol.md section 9, step 4, as a `minips server` process: nobody reported within
    --calib-timeout of the first join, so the first worker to report is grouped right after its
    first STATS, and a later one after its own; neither waits for the third worker --workers
    expects."""
    init = tmp_path / "w.npy"
    np.save(init, np.zeros(PARAM_COUNTS["lenet5"], np.float32))  # --init must fit the model
    with minips_server(tmp_path, TOKEN, "--workers", "3", "--calib-timeout", "0.2", "--init",
                       str(init), "--mode", "asp") as (_, host, port):
        chans = [await transport.connect(host, int(port), role="worker", worker_id=0,
                                          token=TOKEN)]  # the deadline counts from this join
        await until(lambda: bool(records(tmp_path / "global.jsonl", event="calib_timeout")), 20)
        try:
            for w in (0, 1):
                if w:
                    chans.append(await transport.connect(host, int(port), role="worker",
                                                         worker_id=w, token=TOKEN))
                await chans[-1].send(control.Stats(clock=0, step_time=0.01, loss=2.3))
                assign = await recv_as(chans[-1], control.Assign)
                assert assign.group == 0 and assign.staleness == -1  # asp: one group, no bound
            ghost, gport = parse_address(reachable(assign.address, host))
            chans.append(await transport.connect(ghost, gport, role="worker", worker_id=1,
                                                 token=TOKEN, group=assign.group))
            await recv_as(chans[-1], messages.Ack)  # the group server takes the late worker
        finally:
            for ch in chans:
                await ch.close()
    deadline = records(tmp_path / "global.jsonl", event="calib_timeout")
    assert deadline[0]["reported"] == [] and deadline[0]["expected"] == 3
    assert records(tmp_path / "global.jsonl", event="groups")[0]["assignment"] == {"0": 0}


async def test_exchange_whose_reply_was_lost_is_merged_once(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(4, np.float32), workers=1, mode="ssp")
    srv.core.group_opened(GroupHandle(0, "", [0]), 0.0)
    gs = GroupServer(0, srv.core.run, srv.core.weights, ReplyLost(srv), members=[0])
    try:
        gs.core.weights += 1.0  # (4,) what the group's workers applied before the first exchange
        await gs.flush()  # merged, but the reply is lost: the exchange stays pending
        assert srv.core.version == 1 and gs.core.xchg.pending is not None
        gs.core.weights += 2.0  # pushes applied meanwhile
        await gs.flush()  # the same (session, seq) again, then the new delta
        assert srv.core.version == 2 and gs.core.xchg.pending is None
        np.testing.assert_allclose(srv.core.weights, 3.0)  # 1 + 2, not 1 + 1 + 2
        np.testing.assert_allclose(gs.core.weights, 3.0)
    finally:
        await gs.close()
        await srv.close()
    events = [r["event"] for r in read_jsonl(tmp_path / "global.jsonl")]
    assert events.count("merge_repeat") == 1 and events.count("merge") == 2
    meta = messages.Exchange(session=1, seq=7, payload=Payload("dense-f32", {}, ())).meta()
    with pytest.raises(RemoteProtocolError, match="seq"):
        kinds.from_wire(messages.Kind.EXCHANGE, messages.PROTOCOL_VERSION,
                           {**meta, "seq": "7"}, 0)


async def test_an_explicit_group_count_is_honoured_for_equal_workers(tmp_path: Path) -> None:
    """--groups 2 with two equally fast workers: two groups (one each), not one."""
    srv = make_server(tmp_path, np.zeros(8, np.float32), workers=2, mode="gssp", groups=2)
    port = await srv.start()
    chans = [await join(port, w, 0.04) for w in range(2)]
    try:
        assigns = [await recv_as(ch, control.Assign) for ch in chans]
        assert sorted(a.group for a in assigns) == [0, 1]
        assert assigns[0].address != assigns[1].address
    finally:
        for ch in chans:
            await ch.close()
        await srv.close()
