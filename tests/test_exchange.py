"""The compressed group <-> global exchange (exchange.py): top-k up, the global
server's mirror answering top-k entries to set down, exactly once under lost replies, dense
resyncs; against the real ``GlobalServer`` merge and group session (``sessions``) with
made-up pushes, and once with a real `minips group` process over loopback.

Every exchange goes through the wire encoding: the group's PUSH is built as a group process
builds it and handled by the global server's group session, whose WEIGHTS the group decodes.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import records, recv_as, until
from test_group import push

from minips import sparse
from minips.core.config import RunConfig
from minips.core.exchange import (
    ExchangeResult,
    GroupMirror,
    GroupSync,
    Outgoing,
    exchange_message,
    exchange_ratio,
)
from minips.core.replay import seqs_in
from minips.core.roster import GroupHandle
from minips.errors import AuthError
from minips.net import lifeline, transport
from minips.net.endpoints import parse_address
from minips.record.checkpoint import load, save
from minips.serve import sessions
from minips.serve.group import GroupServer
from minips.server import GlobalServer, InProcGroup, InProcLink, ServerConfig
from minips.wire import control, messages
from minips.wire.conversation import Conversation, Role
from minips.wire.fields import Payload

TOKEN = "exchange-test-secret-0123"
N = 500  # weights
RATIO = 0.04  # 20 entries each way


class FakeChannel:
    """The global server's side of a group process's connection, driven by hand."""

    def __init__(self, msg: Any) -> None:
        self.msg: Any = msg
        self.sent: Any = None  # what the server answered

    async def recv(self) -> Any:
        return self.msg

    async def send(self, msg: Any) -> None:
        self.sent = msg


class Group:
    """One group's side: its weights, its exchange, and what it applied and sent in total."""

    def __init__(self, g: int, weights: np.ndarray) -> None:
        self.g = g
        self.weights = weights.copy()
        self.xchg = GroupSync(self.weights, kept=RATIO)
        self.applied = np.zeros(N, np.float64)  # every push it applied
        self.merged = np.zeros(N, np.float64)  # every s whose exchange completed
        self.pushes = 0

    def local(self) -> np.ndarray:
        return (self.weights - self.xchg.w_sync).astype(np.float64)


class Cluster:
    """Groups against a chain of real global servers (each resumed from the last one's
    checkpoint), exchanging through the global server's group session."""

    def __init__(self, tmp: Path, groups: int, rng: np.random.Generator, **run: Any) -> None:
        self.tmp, self.rng, self.run = tmp, rng, run
        self.srv = self._server()
        self.srv.perform(self.srv.core.on_initial(rng.normal(size=N).astype(np.float32)))
        assert self.srv.core.weights is not None
        self.initial = self.srv.core.weights.astype(np.float64)
        for g in range(groups):
            self.srv.core.group_opened(GroupHandle(g, "", [g]), 0.0)
        self.groups = [Group(g, self.srv.core.weights) for g in range(groups)]
        self.convs = [self._registered() for _ in range(groups)]  # each group's connection
        self.servers = [self.srv]
        self.files: list[Path] = []
        self.sends: dict[tuple[int, int], list[Any]] = {}  # (group, seq) -> what each try sent

    def _server(self) -> GlobalServer:
        run = RunConfig(lr_warmup=0.0, workers=2, compressor="topk", ratio=RATIO, **self.run)
        cfg = ServerConfig(run=run, port=0, token=TOKEN, run_dir=str(self.tmp),
                           external_groups=1, checkpoint_every_s=0.0)
        return GlobalServer(cfg, None)

    @staticmethod
    def _registered() -> Conversation:
        """A group process's connection as it is once the group registered: its first PULL came
        (answered with the initial weights the group starts from), so EXCHANGE may follow."""
        conv = Conversation(Role.GROUP)
        conv.receive(messages.Pull(clock=0))
        return conv

    def push(self, g: int) -> None:
        grp = self.groups[g]
        step = (self.rng.normal(size=N) * 0.01).astype(np.float32)
        grp.weights += step
        grp.applied += step
        grp.pushes += 1
        grp.xchg.count(8, 0.1, 1.0)

    async def exchange(self, g: int, lose: str = "", dense: bool = False) -> None:
        """The pending exchange (if any), then a new one, as GroupServer._exchange does;
        ``lose``: "before" (the PUSH never arrives) or "after" (merged, the reply is lost)."""
        grp = self.groups[g]
        if grp.xchg.pending is not None and not await self._send(grp, grp.xchg.pending, lose):
            return
        await self._send(grp, grp.xchg.begin(grp.weights, {"version": 0}, dense=dense), lose)

    async def _send(self, grp: Group, out: Outgoing, lose: str) -> bool:
        self.sends.setdefault((grp.g, out.stats["seq"]), []).append(out.delta)
        if lose == "before":
            return False
        ch = FakeChannel(exchange_message(out.delta, out.stats))
        await sessions._on_group_message(self.srv, ch, self.srv.core.groups[grp.g],  # type: ignore[arg-type]
                                         self.convs[grp.g])
        if lose == "after":
            return False
        reply = ch.sent
        w = sparse.decode_vector(reply.payload, N)
        grp.xchg.complete(grp.weights, out, ExchangeResult(
            w, reply.version, reply.done, reply.info["samples"],
            seqs_in(reply.info, "saved_exchanges", grp.xchg.session)))
        sparse.add_into(grp.merged, _f64(out.delta))
        known = _mirror(self.srv, grp.g).known
        np.testing.assert_array_equal(grp.xchg.w_sync, self.srv.core.weights if known is None
                                      else known)  # the group's copy is exact
        return True

    async def reconnect(self, g: int) -> None:
        """The group process registers again: PULL -> WEIGHTS, ``reload``."""
        grp = self.groups[g]
        ch = FakeChannel(messages.Pull(clock=0))
        self.convs[g] = Conversation(Role.GROUP)  # a new connection
        await sessions._on_group_message(self.srv, ch, self.srv.core.groups[g],  # type: ignore[arg-type]
                                         self.convs[g])
        w = np.asarray(sparse.decode_vector(ch.sent.payload, N))
        held = seqs_in(ch.sent.info, "last_exchange", grp.xchg.session)
        assert held is not None
        grp.weights, _ = grp.xchg.rebase(grp.weights, w, held[0])

    def snapshot(self) -> None:
        path = self.tmp / f"snapshot-{len(self.files)}.npz"
        save(path, self.srv.core.checkpoint_state())
        self.files.append(path)

    async def resume(self) -> None:
        """kill -9 and --resume from the last snapshot; every group reconnects."""
        self.srv = self._server()
        self.srv.restore(load(self.files[-1]))
        await self.srv.start()
        self.servers.append(self.srv)
        for g in range(len(self.groups)):
            await self.reconnect(g)

    def assert_nothing_lost(self) -> None:
        """Per group: what its completed exchanges sent plus what it still holds back is
        everything it applied."""
        for grp in self.groups:
            np.testing.assert_allclose(grp.merged + grp.local(), grp.applied, atol=1e-4)

    async def flush_all(self) -> None:
        for g in range(len(self.groups)):
            await self.exchange(g, dense=True)
            await self.exchange(g, dense=True)  # the first may have been a pending one
            assert self.groups[g].xchg.pending is None
            assert np.abs(self.groups[g].local()).max() < 1e-5  # all sent, but for rounding

    async def close(self) -> None:
        for srv in self.servers:
            await srv.close()


def _mirror(srv: GlobalServer, g: int) -> GroupMirror:
    """Group ``g``'s mirror on ``srv``: a ``GroupMirror`` here (these runs are not exact)."""
    mirror = srv.core.merger.mirrors[g]
    assert isinstance(mirror, GroupMirror)
    return mirror


def _f64(d: Any) -> Any:
    if isinstance(d, np.ndarray):
        return d.astype(np.float64)
    return sparse.SparseVector(d.indices, d.values, d.size)


@pytest.fixture
async def cluster(tmp_path: Path) -> Any:
    c = Cluster(tmp_path, 2, np.random.default_rng(0))
    yield c
    await c.close()


async def test_sparse_both_ways_loses_nothing_and_merges_each_exchange_once(
        cluster: Cluster) -> None:
    rng = random.Random(1)
    for _ in range(300):
        g = rng.randrange(2)
        if rng.random() < 0.6:
            cluster.push(g)
        else:
            r = rng.random()
            await cluster.exchange(g, lose="before" if r < 0.1 else "after" if r < 0.2 else "")
        cluster.assert_nothing_lost()
    await cluster.flush_all()
    cluster.assert_nothing_lost()
    # the global weights hold every group's work once, each divided by k = 2 (merge = mean)
    srv = cluster.srv
    assert srv.core.weights is not None
    applied = sum(grp.applied for grp in cluster.groups)
    np.testing.assert_allclose(srv.core.weights, cluster.initial + applied / 2, atol=1e-4)
    merges = records(cluster.tmp / "global.jsonl", event="merge")
    assert srv.core.samples == sum(m["group_samples"] for m in merges)
    assert srv.core.samples == 8 * sum(grp.pushes for grp in cluster.groups)  # each counted once
    assert records(cluster.tmp / "global.jsonl", event="merge_repeat")  # lost replies happened
    retried = [tries for tries in cluster.sends.values() if len(tries) > 1]
    assert retried and all(t is tries[0] for tries in retried for t in tries)  # the same s


async def test_a_lost_reply_is_sent_again_unchanged_and_merged_once(cluster: Cluster) -> None:
    for _ in range(3):
        cluster.push(0)
    await cluster.exchange(0)  # seq 1: the group's copy is known from here on
    cluster.push(0)
    await cluster.exchange(0, lose="after")  # seq 2 merged, its reply lost
    pending = cluster.groups[0].xchg.pending
    assert pending is not None
    sent = pending.delta
    assert isinstance(sent, sparse.SparseVector) and sent.nnz == round(RATIO * N)
    lost = _mirror(cluster.srv, 0).unacked.copy()  # what the lost reply set
    version = cluster.srv.core.version
    cluster.push(1)
    await cluster.exchange(1)  # the global weights move meanwhile
    cluster.push(0)
    await cluster.exchange(0)  # seq 2 again (a repeat), then seq 3
    assert cluster.srv.core.version == version + 2  # group 1's and seq 3: seq 2 not twice
    assert cluster.groups[0].xchg.seq == 3
    repeat = records(cluster.tmp / "global.jsonl", event="merge_repeat")
    assert [r["seq"] for r in repeat] == [2]
    assert lost.size and lost.size < N  # sparse, and answered again inside the repeat's reply
    cluster.assert_nothing_lost()


def test_the_repeat_answer_covers_the_lost_reply_whether_or_not_it_arrived() -> None:
    """The server cannot tell whether a reply arrived; values to set make both cases exact."""
    size = 64
    rep = GroupMirror(size, 0.1)
    g0 = np.zeros(size, np.float32)
    rep.reset(g0)
    g1 = g0.copy()
    g1[:10] = np.arange(1, 11)
    lost = rep.answer(g1, repeat=False)
    assert isinstance(lost, sparse.SparseVector)
    g2 = g1.copy()
    g2[20:30] = 50.0
    again = rep.answer(g2, repeat=True)
    assert isinstance(again, sparse.SparseVector)
    assert set(lost.indices) <= set(again.indices)
    assert rep.known is not None
    missed, got = g0.copy(), g0.copy()  # the group's copy: the lost reply missed, or arrived
    got[lost.indices] = lost.values
    for c in (missed, got):
        c[again.indices] = again.values
        np.testing.assert_array_equal(c, rep.known)


def test_a_repeat_after_a_dense_answer_is_dense_again() -> None:
    """A lost dense answer leaves the group's copy anywhere: the repeat resyncs it whole."""
    rep = GroupMirror(100, 0.1)
    g = np.arange(100, dtype=np.float32)
    assert isinstance(rep.answer(g, repeat=False), np.ndarray)  # first answer: dense, lost
    again = rep.answer(g + 1, repeat=True)
    np.testing.assert_array_equal(again, g + 1)  # dense again
    assert isinstance(rep.answer(g + 2, repeat=False), sparse.SparseVector)  # a new seq: it arrived
    assert isinstance(rep.answer(g + 3, repeat=True), sparse.SparseVector)


def test_dense_answers_unknown_copy_nearly_dense_or_ratio_one() -> None:
    g = np.arange(100, dtype=np.float32)
    rep = GroupMirror(100, 0.1)
    assert isinstance(rep.answer(g, repeat=False), np.ndarray)  # unknown copy: dense
    assert rep.known is not None and isinstance(rep.answer(g + 1, repeat=False),
                                                sparse.SparseVector)
    rep.reset(None)  # e.g. a new group: resync
    assert isinstance(rep.answer(g, repeat=False), np.ndarray)
    wide = GroupMirror(100, 0.6)  # an answer of 60% of the entries is larger sparse than dense
    wide.reset(g)
    assert isinstance(wide.answer(g + 1, repeat=False), np.ndarray)
    dense = GroupMirror(100, 1.0)
    dense.reset(g)
    assert dense.known is None  # ratio 1: no mirror kept, always the weights whole
    np.testing.assert_array_equal(dense.answer(g + 2, repeat=False), g + 2)


def test_exchange_ratio_follows_the_compressor_unless_set() -> None:
    assert exchange_ratio(RunConfig(compressor="none", ratio=0.01)) == 1.0
    assert exchange_ratio(RunConfig(compressor="fp16", ratio=0.01)) == 1.0
    assert exchange_ratio(RunConfig(compressor="gdtopk", ratio=0.01)) == 0.01
    assert exchange_ratio(RunConfig(compressor="none", xchg_ratio=0.2)) == 0.2
    assert exchange_ratio(RunConfig(compressor="topk", xchg_ratio=1.0)) == 1.0


def test_a_flush_sends_everything_and_a_dense_exchange_is_the_old_rule() -> None:
    w0 = np.zeros(N, np.float32)
    x = GroupSync(w0, kept=RATIO)
    w = np.linspace(-1, 1, N).astype(np.float32)
    out = x.begin(w, {}, dense=True)
    np.testing.assert_array_equal(out.delta, w)  # all of it
    g = np.full(N, 0.5, np.float32)
    old = w + (g - w)  # the dense rule, w += G - sent, bit for bit
    x.complete(w, out, ExchangeResult(g, 1, False))
    np.testing.assert_array_equal(w, old)
    np.testing.assert_array_equal(x.w_sync, g)


async def test_a_resumed_global_server_resyncs_and_gets_the_lost_exchanges_once(
        tmp_path: Path) -> None:
    c = Cluster(tmp_path, 1, np.random.default_rng(3))
    try:
        for _ in range(4):
            c.push(0)
            await c.exchange(0)
        c.snapshot()
        for _ in range(3):
            c.push(0)
            await c.exchange(0)  # merged, not in the checkpoint: sent again once
        c.push(0)
        await c.resume()
        assert _mirror(c.srv, 0).known is not None  # the PULL reset it: sparse at once
        c.push(0)
        await c.exchange(0)
        await c.flush_all()
        assert c.srv.core.weights is not None
        # one group: the global weights are the initial ones plus all it applied, once
        np.testing.assert_allclose(c.srv.core.weights, c.initial + c.groups[0].applied, atol=1e-4)
        assert c.srv.core.samples == 8 * c.groups[0].pushes
    finally:
        await c.close()


class LossyLink:
    """The in-process link, except that the replies to the calls numbered in ``lose`` are lost
    after the global server merged (the network dropped them)."""

    def __init__(self, srv: GlobalServer, lose: set[int]) -> None:
        self.link, self.lose, self.calls = InProcLink(srv), lose, 0

    async def exchange(self, group: int, delta: Any, stats: dict[str, Any]) -> ExchangeResult:
        res = await self.link.exchange(group, delta, stats)
        self.calls += 1
        if self.calls in self.lose:
            raise ConnectionResetError("reply lost")
        return res


@pytest.mark.parametrize("shared", [False, True])
async def test_an_in_process_group_exchanges_sparse_through_lost_replies_and_logs_bytes(
        tmp_path: Path, shared: bool) -> None:
    """A GroupServer in the global server's process (InProcLink), its first (dense) reply lost,
    later two in a row: sparse both ways but for the first answer and the final flush, nothing
    lost, bytes logged. ``shared``: the global server opened it in its own process
    (``share``), so its mirror is the group's ``w_sync`` itself, which only the group writes (a
    lost reply is one it did not take, and the repeat's answer sets it), and even the first
    answer is top-k; else the mirror keeps a copy."""
    n, k = 1000, 50
    run = RunConfig(lr_warmup=0.0, workers=1, mode="ssp", compressor="topk", ratio=k / n,
                    optimizer_at="worker")  # a push of one member moves the weights by itself
    srv = GlobalServer(ServerConfig(run=run, port=0, token=TOKEN, run_dir=str(tmp_path)),
                       np.zeros(n, np.float32))
    srv.core.group_opened(GroupHandle(0, "", [0]), 0.0)
    assert srv.core.weights is not None
    gs = GroupServer(0, run, srv.core.weights, LossyLink(srv, {1, 5, 6}), members=[0],
                     writer=srv.rundir.writer("group-0"))
    if shared:  # as GlobalServer.open_group does for a group it opens in its process
        srv.peers[0] = InProcGroup(gs)
        srv.core.merger.share(0, gs.core.xchg)
    rng = np.random.default_rng(7)
    applied = np.zeros(n, np.float64)
    try:
        for clock in range(1, 31):  # pushes of 20% of the entries, dense every 5th
            step = (rng.normal(size=n) * 0.01).astype(np.float32)
            if clock % 5:
                step[rng.random(n) < 0.8] = 0.0
                at = np.flatnonzero(step).astype(np.uint32)
                gs.on_push(0, push(clock, sparse.SparseVector(at, -step[at], n)))
            else:
                gs.on_push(0, push(clock, -step))
            applied += step
            await gs.flush()
            if gs.core.xchg.pending is None:  # else its copy lacks what the lost reply set
                np.testing.assert_array_equal(gs.core.xchg.w_sync, _mirror(srv, 0).known)
                assert (_mirror(srv, 0).known is gs.core.xchg.w_sync) == shared
        await gs.flush(final=True)
    finally:
        await gs.close()
        await srv.close()
    np.testing.assert_allclose(srv.core.weights, applied, atol=1e-4)  # one group: all of it, once
    xchg = records(tmp_path / "group-0.jsonl", event="exchange")
    assert len(records(tmp_path / "global.jsonl", event="merge_repeat")) == 3
    assert [r["sent"] for r in xchg[:-1]] == [k] * (len(xchg) - 1) and xchg[-1]["sent"] == n
    # shared, the mirror knows the group's copy from the start: no first answer whole
    assert xchg[0]["got"] == (k if shared else n)
    assert all(0 < r["got"] <= 3 * k for r in xchg[1:-1])
    up, down = xchg[-1]["bytes_to_global"], xchg[-1]["bytes_from_global"]
    assert 0 < up < 4 * n * (len(xchg) / 3) and 4 * n < down < 4 * n * (len(xchg) / 3)


async def _two_groups(tmp: Path, shared: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Two in-process groups, each pushing sparse updates and exchanging after every push,
    then flushing: the global weights, every push applied (float64), and the entries the
    first answer to group 0 set; ``shared``: the global server opened them in its own
    process (``share``), so each mirror is its group's ``w_sync``."""
    n, k = 1000, 50
    run = RunConfig(lr_warmup=0.0, workers=2, mode="gssp", groups=2, compressor="topk",
                    ratio=k / n, optimizer_at="worker", merge="sum")
    srv = GlobalServer(ServerConfig(run=run, port=0, token=TOKEN, run_dir=str(tmp)),
                       np.zeros(n, np.float32))
    servers = []
    for g in (0, 1):
        srv.core.group_opened(GroupHandle(g, "", [g]), 0.0)
        assert srv.core.weights is not None
        servers.append(GroupServer(g, run, srv.core.weights, InProcLink(srv), members=[g],
                                   writer=srv.rundir.writer(f"group-{g}")))
        if shared:  # as GlobalServer.open_group does
            srv.peers[g] = InProcGroup(servers[-1])
            srv.core.merger.share(g, servers[-1].core.xchg)
    rng = np.random.default_rng(11)
    applied = np.zeros(n, np.float64)
    try:
        for clock in range(1, 13):
            for g, gs in enumerate(servers):  # each moves 30% of the entries, its own ones
                step = (rng.normal(size=n) * 0.01).astype(np.float32)
                step[rng.random(n) < 0.7] = 0.0
                at = np.flatnonzero(step).astype(np.uint32)
                gs.on_push(g, push(clock, sparse.SparseVector(at, -step[at], n)))
                applied += step
                await gs.flush()
                known = _mirror(srv, g).known
                assert known is not None
                np.testing.assert_array_equal(gs.core.xchg.w_sync, known)
                assert (known is gs.core.xchg.w_sync) == shared
        for gs in servers:
            await gs.flush(final=True)
        assert srv.core.weights is not None
        first = records(tmp / "group-0.jsonl", event="exchange")[0]["got"]
        return srv.core.weights.copy(), applied, first
    finally:
        for gs in servers:
            await gs.close()
        await srv.close()


@pytest.mark.parametrize("shared", [False, True])
async def test_in_process_mirrors_share_their_groups_copy_and_lose_nothing(
        tmp_path: Path, shared: bool) -> None:
    """Two groups in the global server's process: shared, each mirror is its group's own
    ``w_sync`` (no copy; only the group writes it, as it takes each answer) and the first
    answer is top-k, not the weights whole; either way every push of both groups reaches the
    global weights once, the other group's merges included. A mirror that set the shared
    array itself would take from the group the before-values its rebase needs: the group
    would send the other's merges back, negated, and the global weights would lose them."""
    glob, applied, first = await _two_groups(tmp_path, shared)
    assert np.count_nonzero(glob) > 500
    np.testing.assert_allclose(glob, applied, atol=1e-5)
    assert first == (50 if shared else 1000)


async def _join_group(host: str, port: int, group: int, timeout: float = 30.0) -> Any:
    """Connect as worker 0 to the group process, which refuses until it has its group id (it
    takes it after the global server answers its PULL, just after the worker's ASSIGN)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await transport.connect(host, port, role="worker", worker_id=0, group=group,
                                           token=TOKEN)
        except AuthError:
            assert asyncio.get_running_loop().time() < deadline, "group process never ready"
            await asyncio.sleep(0.01)


def _start_group(tmp: Path, port: int) -> subprocess.Popen[bytes]:
    env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN})
    log = open(tmp / "group.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "minips", "group", "--connect",
                             f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--run-dir",
                             str(tmp)], env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


async def through_a_group_process(tmp: Path, run: RunConfig, n: int,
                                  update: Callable[[messages.Weights], Any]
                                  ) -> tuple[GlobalServer, int]:
    """A global server (n zero weights) and a real `minips group` process over loopback, and
    one hand-driven worker 0: it PULLs and pushes ``update(weights)`` (a dense array or a
    ``SparseVector``) until a WEIGHTS says done, then leaves; the run ends and the group
    process exits 0. Returns the closed server and the pushes made."""
    srv = GlobalServer(ServerConfig(run=run, host="127.0.0.1", port=0, token=TOKEN,
                                    run_dir=str(tmp), calib_timeout_s=30.0, linger_s=1.0,
                                    external_groups=1), np.zeros(n, np.float32))
    port = await srv.start()
    proc = _start_group(tmp, port)
    try:
        await until(lambda: bool(srv.pending_groups), 30)
        ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=0,
                                      token=TOKEN)
        await ctl.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
        assign = await recv_as(ctl, control.Assign, 30)
        host, gport = parse_address(assign.address)
        ch = await _join_group(host or "127.0.0.1", gport, assign.group)
        await ch.recv()  # ACK with the starting clock
        clock = 0
        while True:
            await ch.send(messages.Pull(clock=clock))
            weights = await recv_as(ch, messages.Weights)
            if weights.done:
                break
            clock += 1
            enc, codec, bufs = sparse.encode_vector(update(weights))
            await ch.send(messages.Push(clock=clock, samples=1, payload=Payload(enc, codec,
                                        tuple(bufs))))
            await recv_as(ch, messages.Ack)
        await ch.close(leave="bye")
        await asyncio.wait_for(srv.wait_finished(), 30)
        await ctl.close(leave="bye")
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await srv.close()
    return srv, clock


@pytest.mark.timeout(90)
async def test_a_group_process_exchanges_sparse_both_ways_and_loses_nothing(
        tmp_path: Path) -> None:
    """A real `minips group` over loopback, one hand-driven worker on a quadratic: the exchange
    bytes both ways are a fraction of the dense exchange's, the global weights converge, and
    they hold every update the group applied (its last exchange sends all it has left)."""
    n, pushes, lr = 2000, 150, 0.2
    target = np.random.default_rng(5).normal(size=n).astype(np.float32)
    run = RunConfig(lr_warmup=0.0, workers=1, mode="asp", sync_every=1, lr=lr, momentum=0.0,
                    weight_decay=0.0, compressor="topk", ratio=0.05, epochs=1.0,
                    train_size=pushes)
    grads = np.zeros(n, np.float64)

    def gradient(weights: messages.Weights) -> np.ndarray:
        grad = np.asarray(sparse.decode_vector(weights.payload, n)) - target  # of |w - t|^2 / 2
        grads[:] += grad
        return grad

    srv, clock = await through_a_group_process(tmp_path, run, n, gradient)
    assert srv.core.weights is not None and srv.core.samples == clock
    # nothing lost: one group, no momentum: the global weights are -lr times every gradient
    np.testing.assert_allclose(srv.core.weights, -lr * grads, atol=1e-3)
    assert np.linalg.norm(srv.core.weights - target) < 0.05 * np.linalg.norm(target)  # converged
    xchg = records(tmp_path / "group-0.jsonl", event="exchange")
    dense = n * 4 * len(xchg)  # one way, dense
    up, down = xchg[-1]["bytes_to_global"], xchg[-1]["bytes_from_global"]
    assert 0 < up < dense / 4 and 0 < down < dense / 4, (up, down, dense)
    assert sum(r["sent"] < n for r in xchg) >= 0.9 * len(xchg)  # dense: the flushes at the end
    assert all(r["got"] < n for r in xchg)  # the registering PULL reset the server's copy


def test_a_groups_share_follows_the_samples_the_replies_count() -> None:
    """``GroupSync.share``: of the samples the global server counted between two replies, the
    group's own; the first reply only sets the start, a repeat (no new count) changes nothing,
    and the running mean settles on the share (here 1/4) within a few exchanges."""
    sync = GroupSync(np.zeros(4, np.float32))
    sync.share_of(100, 1_000)
    assert sync.share == 1.0  # one reply: nothing to compare with yet
    sync.share_of(100, 1_000)
    assert sync.share == 1.0  # a repeat's reply counts nothing new
    sync.share_of(100, 1_500)
    assert sync.share == 0.2  # the first measure, whole
    for k in range(1, 31):
        sync.share_of(100, 1_500 + 400 * k)
    assert sync.share == pytest.approx(0.25, abs=1e-3)
    sync.share_of(10**6, 1_500 + 400 * 31 + 10)  # more than the server counted: at most 1
    assert 0.25 < sync.share <= 1.0


@pytest.mark.parametrize("xchg_mode", ["topk", "exact"])
async def test_a_group_the_global_server_opens_in_its_process_is_mirrored_by_its_own_copy(
        tmp_path: Path, xchg_mode: str) -> None:
    """``GlobalServer.open_group`` (no `minips group` processes) tells the merger that the group
    is its own: a top-k mirror is the group's ``w_sync`` itself from the start; the exact
    exchange keeps no copy of a group, so it has nothing to share."""
    run = RunConfig(lr_warmup=0.0, workers=1, mode="gssp", compressor="topk", ratio=RATIO,
                    optimizer_at="worker", xchg_mode=xchg_mode)
    srv = GlobalServer(ServerConfig(run=run, port=0, token=TOKEN, run_dir=str(tmp_path),
                                    checkpoint_every_s=0.0), None)
    await srv.start()
    try:
        srv.perform(srv.core.on_initial(np.zeros(N, np.float32)))
        srv.perform(srv.core.admit(0, 0.0))
        await srv.open_group(0, [0])
        peer = srv.peers[0]
        assert isinstance(peer, InProcGroup)
        mirror = srv.core.merger.mirrors[0]
        if xchg_mode == "topk":
            assert isinstance(mirror, GroupMirror) and mirror.shared is peer.server.core.xchg
            assert mirror.known is peer.server.core.xchg.w_sync
        else:
            assert not isinstance(mirror, GroupMirror)
    finally:
        await srv.close()
