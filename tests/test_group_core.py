"""The rules without IO (group_core.py, global_core.py): no asyncio, socket, ssl, time or torch;
driven in one thread with a fake clock they are synchronous SGD in BSP, and they reach the same
weights and answers as the asyncio servers for the same order of events (one group server, and
a whole cluster: tests/noio_cluster.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import noio_cluster
import numpy as np
import pytest

from minips import sparse
from minips.core import optim
from minips.core.actions import Log
from minips.core.config import RunConfig
from minips.core.downlink import Diverged, Downlink
from minips.core.exchange import exchange_message
from minips.core.group_core import (
    AllLeft,
    GroupCore,
    Reply,
    StartExchange,
    Wake,
)
from minips.serve.group import GroupServer
from minips.wire import control, messages
from minips.wire.fields import Payload

N = 500


class NoLink:
    """The shell's link, never called here (no exchange is due); a GroupLink that says so."""

    async def exchange(self, group: int, delta: Any, stats: dict[str, Any]) -> Any:
        raise AssertionError("the core does not exchange")


def push(clock: int, grad: np.ndarray | sparse.SparseVector, samples: int = 8) -> messages.Push:
    enc, codec, bufs = sparse.encode_vector(grad)
    return messages.Push(clock=clock, samples=samples, payload=Payload(enc, codec,
                         tuple(bufs)))


def drive(core: GroupCore | GroupServer, rounds: int, seed: int) -> list[messages.Weights]:
    """Two workers in lock step: each pulls (the version it holds) and pushes (through the
    asyncio shell's ``on_push`` for a GroupServer, the core's ``push`` otherwise); returns
    every answer in order."""
    rng = np.random.default_rng(seed)
    held = {0: -1, 1: -1}
    answers = []
    rules = core.core if isinstance(core, GroupServer) else core
    for r in range(rounds):
        for w in (0, 1):
            assert rules.may_answer(w)
            rules.publish()
            msg = rules.weights_message(w, [], held[w])
            held[w] = msg.version
            answers.append(msg)
        for w in (0, 1):
            idx = np.sort(rng.choice(N, 10, replace=False)).astype(np.uint32)
            grad = sparse.SparseVector(idx, rng.standard_normal(10).astype(np.float32), N)
            if isinstance(core, GroupServer):
                core.on_push(w, push(r + 1, grad))
            else:
                core.push(w, push(r + 1, grad), 0.0)
    return answers


def run(mode: str, compressor: str = "none") -> RunConfig:
    return RunConfig(workers=2, mode=mode, compressor=compressor, ratio=0.02, lr=0.1,
                     momentum=0.9, weight_decay=5e-4, lr_warmup=0, sync_every=10_000)


BLOCK = textwrap.dedent("""
    import sys
    import numpy as np  # allowed, and it loads time (datetime) for itself
    BLOCKED = {"asyncio", "socket", "_socket", "ssl", "selectors", "time", "torch"}
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]

    class Block:
        \"\"\"Refuses those modules to minips' own imports; the stdlib may load them.\"\"\"
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                f = sys._getframe(1)
                while f is not None and "importlib" in f.f_globals.get("__name__", ""):
                    f = f.f_back
                importer = "" if f is None else f.f_globals.get("__name__", "")
                if importer.startswith("minips"):
                    raise ImportError(f"{importer} imported {name}")
                if name.split(".")[0] in {"asyncio", "torch"}:  # not even through the stdlib
                    raise ImportError(f"{importer} imported {name}")
            return None

    sys.meta_path.insert(0, Block())
""")


def run_without_io(compressor: str, out: Path) -> dict[str, Any]:
    """tests/noio_cluster.py in a fresh interpreter that refuses asyncio, socket, ssl,
    selectors, time and torch to minips: its weights, event order and figures."""
    script = BLOCK + textwrap.dedent(f"""
        import json
        import noio_cluster
        c = noio_cluster.run({compressor!r})
        assert not {{"asyncio", "torch"}} & set(sys.modules)  # not even through the stdlib
        np.savez({str(out)!r}, glob=c.glob.weights, **{{f"g{{g}}": k.weights
                                                       for g, k in c.cores.items()}})
        print(json.dumps({{"events": c.events, "merges": c.glob.version, "waits": c.waits,
                          "samples": c.glob.samples, "logs": len(c.logs)}}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False, env=env)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


async def run_with_asyncio(compressor: str, events: list[Any],
                           tmp_path: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    """The same events in the same order through the asyncio servers: the real GlobalServer
    and 4 GroupServers (in-process link), each PULL through ``answer_pull``, each PUSH through
    ``on_push`` with its exchange awaited before the next event (as the cores ran it)."""
    from minips.core.roster import GroupHandle
    from minips.server import GlobalServer, InProcGroup, InProcLink, ServerConfig

    cfg = ServerConfig(run=RunConfig(**noio_cluster.run_config(compressor)), port=0,
                       run_dir=str(tmp_path), checkpoint_every_s=0)
    srv = GlobalServer(cfg, noio_cluster.init_weights())
    t = [0.0]
    servers: dict[int, GroupServer] = {}
    handles = []
    for g in sorted(set(noio_cluster.GROUP_OF.values())):
        members = [w for w, h in noio_cluster.GROUP_OF.items() if h == g]
        servers[g] = GroupServer(g, srv.core.run, srv.core.weights, InProcLink(srv),
                                 members=members, clock=lambda: t[0])
        handles.append(GroupHandle(g, "", members, served=True))
        srv.peers[g] = InProcGroup(servers[g])
        srv.core.merger.share(g, servers[g].core.xchg)  # as GlobalServer.open_group does
    for w in noio_cluster.GROUP_OF:
        srv.core.admit(w, 0.0)
    srv.perform(srv.core.groups_formed(handles, dict(noio_cluster.GROUP_OF), 0.0))
    workers, pushes = noio_cluster.Workers(compressor), {}
    try:
        for kind, who, t[0] in events:
            if kind == "flush":
                await servers[who].flush(final=True)
                continue
            gs = servers[noio_cluster.GROUP_OF[who]]
            if kind == "pull":
                assert gs.core.may_answer(who)  # it was answered then: it is now
                pushes[who] = workers.step(who, await gs.answer_pull(who, workers.held[who]))
            else:
                workers.acked(who, gs.on_push(who, pushes.pop(who)))
                await gs.settle()
        assert srv.core.weights is not None
        return srv.core.weights.copy(), [gs.core.weights.copy() for gs in servers.values()]
    finally:
        for gs in servers.values():
            await gs.close()
        await srv.close()


@pytest.mark.parametrize("compressor", ["none", "topk"])
async def test_a_whole_cluster_of_cores_without_io_trains_as_the_asyncio_servers_do(
        compressor: str, tmp_path: Path) -> None:
    """A GlobalCore, 4 GroupCores and 8 workers (softmax regression, numpy) in one thread with
    a fake clock, in an interpreter without asyncio, sockets, clocks or torch: it learns, SSP
    holds PULLs, groups exchange; the asyncio servers driven through the same event order end
    with the same weights, bit for bit (the same float operations in the same order: the
    cores are the servers' rules, the shells only carry the messages)."""
    got = run_without_io(compressor, tmp_path / "noio.npz")
    # 8 workers x 12 pushes of 16 samples; an exchange every 3 pushes of a group
    assert (got["samples"], got["merges"]) == (8 * 12 * 16, 4 * 8 + 4)
    assert got["waits"] > 0 and got["logs"] == got["merges"]  # one record per exchange
    noio = np.load(tmp_path / "noio.npz")
    before = noio_cluster.accuracy(noio_cluster.init_weights())
    assert noio_cluster.accuracy(noio["glob"]) > before + 0.4
    glob, groups = await run_with_asyncio(compressor, got["events"], tmp_path / "asyncio")
    assert np.array_equal(glob, noio["glob"])
    for g, weights in enumerate(groups):
        assert np.array_equal(weights, noio[f"g{g}"])


def test_two_workers_in_bsp_are_synchronous_sgd_on_the_core() -> None:
    core = GroupCore(0, run("bsp"), np.zeros(N, np.float32), members=[0, 1])
    drive(core, 30, seed=1)
    ref_w, opt = np.zeros(N, np.float32), optim.SGD(N, lr=0.1, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(1)
    for _ in range(30):
        grads = []
        for _ in (0, 1):
            idx = np.sort(rng.choice(N, 10, replace=False)).astype(np.uint32)
            grads.append(sparse.SparseVector(idx, rng.standard_normal(10).astype(np.float32), N))
        opt.step(ref_w, (grads[0].to_dense() + grads[1].to_dense()) / np.float32(2))  # the mean
    assert core.version == 30
    np.testing.assert_allclose(core.weights, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode,compressor", [("bsp", "none"), ("ssp", "none"),
                                             ("gssp", "topk")])
async def test_the_asyncio_server_answers_as_the_core_does(mode: str, compressor: str) -> None:
    """Same events in the same order: the same weights, versions and answers, bit for bit
    (with topk, the compressed downlink's sparse answers too)."""
    core = GroupCore(0, run(mode, compressor), np.zeros(N, np.float32), members=[0, 1])
    server = GroupServer(0, run(mode, compressor), np.zeros(N, np.float32), NoLink(),
                         members=[0, 1], clock=lambda: 0.0)
    try:
        a, b = drive(core, 12, seed=2), drive(server, 12, seed=2)
        assert np.array_equal(core.weights, server.core.weights)
        assert core.version == server.core.version
        for x, y in zip(a, b, strict=True):
            assert (x.version, x.since, x.payload.encoding) == (y.version, y.since,
                                                                  y.payload.encoding)
            assert all(bytes(p) == bytes(q)
                       for p, q in zip(x.payload.buffers, y.payload.buffers, strict=True))
        assert compressor == "none" or any(x.since >= 0 for x in a)  # updates, not only dense
    finally:
        await server.close()


def test_the_core_answers_each_event_with_the_actions_due() -> None:
    """join: the first ACK; a push: its ACK, ``Wake`` only when the lowest clock moved,
    ``StartExchange`` every ``sync_every`` pushes; a lease running out: a log line and ``Wake``;
    the last worker leaving: ``AllLeft``."""
    core = GroupCore(0, RunConfig(workers=2, mode="ssp", lr_warmup=0, sync_every=3, lease_s=10),
                     np.zeros(N, np.float32), members=[0, 1])
    grad = np.ones(N, np.float32)
    assert core.join(0, 0.0) == [Reply(0, messages.Ack(clock=0, version=0))]
    assert core.join(1, 0.0) == [Reply(1, messages.Ack(clock=0, version=0))]
    assert core.push(0, push(1, grad), 1.0) == [Reply(0, messages.Ack(clock=1, version=1))]
    assert core.push(1, push(1, grad), 1.0) == [Reply(1, messages.Ack(clock=1, version=2)),
                                                Wake()]  # the lowest clock: 0 -> 1
    assert core.push(0, push(2, grad), 2.0) == [Reply(0, messages.Ack(clock=2, version=3)),
                                                StartExchange()]
    assert core.tick(9.0, {0: 8.0, 1: 1.0}) == []  # both within their lease
    assert core.tick(12.0, {0: 11.0}) == [Log("expired", {"workers": [1]}), Wake()]
    assert core.leave(0) == [Wake(), AllLeft()]


def test_the_answered_pulls_go_to_the_global_server_with_the_next_exchange() -> None:
    """Each answered PULL of a member is counted once, with its lead (staleness) and how long
    the SSP bound held it, in the EXCHANGE that follows; the one after starts empty."""
    core = GroupCore(0, run("ssp"), np.zeros(N, np.float32), members=[0, 1])
    grad = np.ones(N, np.float32)
    core.weights_message(0, [], held_s=0.0)
    core.push(0, push(1, grad), 0.0)
    core.weights_message(0, [], clock=1, held_s=0.0)  # one clock ahead of worker 1
    core.weights_message(1, [0], held_s=0.25)
    core.weights_message(None, [])  # not a member's PULL: not counted
    out = core.begin_exchange(False, {"bytes_in": 0, "bytes_out": 0})
    assert (out.stats["pull_workers"], out.stats["pull_leads"], out.stats["pull_waits_us"]) \
        == ([0, 0, 1], [0, 1, 0], [0, 0, 250_000])
    msg = exchange_message(out.delta, out.stats)
    assert msg.info["pull_leads"] == [0, 1, 0]
    assert not core.xchg.pulls  # the next exchange reports the PULLs answered after this one


@pytest.mark.parametrize("every", [0, 1])
def test_a_group_publishes_once_a_round_of_its_members_and_never_past_the_drift_bound(
        every: int) -> None:
    """The compressed downlink publishes once per round of the live members (publish_every
    0; 1: once per push), sooner when the weights drift past the bound: after every turn the
    weights the workers can be answered with are within ``down_drift`` of the group's."""
    run = RunConfig(workers=4, mode="ssp", staleness=3, compressor="topk", ratio=0.02,
                    sync_every=10_000, down_drift=0.05, publish_every=every,
                    optimizer_at="worker")
    rng = np.random.default_rng(0)
    core = GroupCore(0, run, rng.standard_normal(N).astype(np.float32), members=[0, 1, 2, 3])
    assert isinstance(core.downlink, Downlink)
    clocks = {w: 0 for w in range(4)}
    publishes = []
    for step in range(40):
        w = step % 4
        clocks[w] += 1
        update = np.zeros(N, dtype=np.float32)
        idx = rng.choice(N, 10, replace=False)
        update[idx] = rng.standard_normal(10).astype(np.float32) * (5.0 if step == 21 else 0.05)
        core.push(w, push(clocks[w], update), now=float(step))
        before = core.downlink.pub
        core.publish()
        publishes.append(core.downlink.pub - before)
        assert core.downlink.drift(core.weights) <= run.down_drift * (1 + 1e-6)
    if every == 1:
        assert publishes == [1] * 40
    else:  # one every 4 pushes, counted from the last publish; the large push of step 21 at once
        due, since = [], 0
        for i in range(40):
            since += 1
            due.append(int(since >= 4 or i == 21))
            since = 0 if due[-1] else since
        assert publishes == due and sum(due) == 10


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("compressor", ["none", "topk"])
def test_a_group_whose_weights_overflowed_answers_diverged_never_inf(compressor: str) -> None:
    """Finite pushes of 3.4e38 overflow float32: the next PULL gets ``Diverged`` (ERROR
    ``diverged`` from the shell), never a WEIGHTS that holds inf (issue 43, departure 4)."""
    big = RunConfig(workers=2, mode="asp", compressor=compressor, ratio=0.5, lr_warmup=0,
                    sync_every=10_000, optimizer_at="worker")
    core = GroupCore(0, big, np.zeros(N, np.float32), members=[0, 1])
    grad = np.full(N, -3.4e38, np.float32)  # applied as w -= lr * g: +3.4e38 each
    core.publish()
    assert np.isfinite(np.frombuffer(core.weights_message(0, [], -1).payload.buffers[-1],
                                     np.float32 if compressor == "none" else np.uint8)).all()
    core.push(0, push(1, grad), 0.0)
    core.publish()
    core.weights_message(0, [], -1)  # 3.4e38 (0.5 a push: 1.7e38): finite still
    for clock in (2, 3, 4):
        core.push(0, push(clock, grad), 0.0)
    assert not np.isfinite(core.weights).all()
    core.publish()
    with pytest.raises(Diverged) as caught:
        core.weights_message(0, [], -1)
    assert caught.value.code == "diverged"


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
def test_an_answer_given_before_the_weights_overflowed_is_not_given_again() -> None:
    """Two PULLs that hold the same version get one answer of the published copy (made and
    encoded once); when the weights overflow between them, with no publish since, the second
    gets ``Diverged``, not the answer the first got."""
    big = RunConfig(workers=2, mode="asp", compressor="topk", ratio=0.5, lr_warmup=0,
                    sync_every=10_000, optimizer_at="worker")
    core = GroupCore(0, big, np.zeros(N, np.float32), members=[0, 1])
    core.push(0, push(1, np.full(N, -1.0, np.float32)), 0.0)
    core.publish()
    first, again = core.weights_message(0, [], 0), core.weights_message(1, [], 0)
    assert (first.since, first.version) == (again.since, again.version) == (-1, 1)  # all moved
    assert [bytes(b) for b in first.payload.buffers] == [bytes(b) for b in again.payload.buffers]
    for clock in (2, 3, 4, 5):
        core.push(0, push(clock, np.full(N, -3.4e38, np.float32)), 0.0)
    assert not np.isfinite(core.weights).all()
    with pytest.raises(Diverged):
        core.weights_message(1, [], 0)


class Zeros:
    """A global server whose weights stay 0 (the final flush after the worker left)."""

    async def exchange(self, group: int, delta: Any, stats: dict[str, Any]) -> Any:
        from minips.core.exchange import ExchangeResult

        return ExchangeResult(np.zeros(N, np.float32), 1, True)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
async def test_a_worker_gets_error_diverged_on_loopback_not_weights_holding_inf() -> None:
    from conftest import recv_as

    from minips.net import transport

    big = RunConfig(workers=1, mode="asp", lr_warmup=0, sync_every=10_000,
                    optimizer_at="worker")
    gs = GroupServer(0, big, np.zeros(N, np.float32), Zeros(), members=[7])
    port = await gs.serve("127.0.0.1", 0, "t")
    ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=7, token="t")
    try:
        await recv_as(ch, messages.Ack)
        for clock in (1, 2):  # +3.4e38 a push: finite pushes, the second overflows
            await ch.send(messages.Pull(clock=clock - 1))
            got = await asyncio.wait_for(ch.recv(), 5)
            assert isinstance(got, messages.Weights)
            assert np.isfinite(np.frombuffer(got.payload.buffers[0], np.float32)).all()
            await ch.send(push(clock, np.full(N, -3.4e38, np.float32)))
            await recv_as(ch, messages.Ack)
        await ch.send(messages.Pull(clock=2))
        err = await asyncio.wait_for(ch.recv(), 5)
        assert isinstance(err, control.Error) and err.code == "diverged"
    finally:
        await ch.close()
        await gs.close()


def test_k_groups_at_one_pace_keep_the_momentum_of_one_group_per_cluster_push() -> None:
    """The cause of dense GSSP's lost points behind a link (docs/results.md): each group's
    momentum decayed per push of the group, so k groups at one pace carried it k times longer,
    counted in the cluster's pushes, than one group does. With ``group_momentum`` "cluster"
    a group measures its share f of the cluster's samples from the replies and uses momentum
    m^(1/f) at lr x (1 - m^(1/f)) / (1 - m): the same long-run step, decaying per push of the
    cluster. 4 groups of near-equal speed: f near 1/4 for each. The default, "group", keeps
    the run's momentum."""
    cluster = noio_cluster.run("none", group_momentum="cluster")
    for core in cluster.cores.values():
        share = core.xchg.share
        assert 0.15 < share < 0.5, share
        momentum, factor = core._cluster_momentum()  # as the next push applies them
        assert momentum == pytest.approx(0.9 ** (1 / share), rel=1e-9)
        assert factor / (1 - momentum) == pytest.approx(1 / (1 - 0.9), rel=1e-9)
    one = RunConfig(**{**noio_cluster.run_config("none"), "groups": 1,
                       "group_momentum": "cluster"})
    core = GroupCore(0, one, noio_cluster.init_weights(), members=[0])
    for replied in (100, 200, 300):  # one group: every sample the server counts is its own
        core.xchg.share_of(100, replied)
    assert (core.xchg.share, core._cluster_momentum()) == (1.0, (0.9, 1.0))
    default = RunConfig(**noio_cluster.run_config("none"))
    assert default.group_momentum == "group"
    core = GroupCore(0, default, noio_cluster.init_weights(), members=[0])
    core.xchg.share = 0.25
    core._apply(np.zeros(core.weights.size, np.float32), 1)  # one push, at the run's lr
    assert (core.opt.momentum, core.opt.lr) == (0.9, default.lr * core._lr_factor(1))
