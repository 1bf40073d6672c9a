"""GSSP groups by the iteration a group waits on, not by compute alone (DESIGN.md, "Grouping").

The group core measures each worker's iteration as the interval between its PUSHes less the
time the SSP bound held its PULL (``ssp.Iterations``, hand-computed times below), sends it to the
global server with its exchange (EXCHANGE ``iter_workers`` / ``iter_us`` / ``compute_us``), and
the roster groups, regroups, places late joiners and sets GDTopK's and LB-BSP's figures from it:
a worker whose compute is fast but whose link is slow is grouped apart and never moved into the
fast group."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from conftest import records, recv_as
from test_server import TOKEN, make_server

from minips import grouping, sparse
from minips.compress.base import WireSpec
from minips.core.actions import Log, PlaceLate, Regroup
from minips.core.balance import Balancer
from minips.core.config import RunConfig
from minips.core.exchange import exchange_message
from minips.core.global_core import GlobalCore
from minips.core.group_core import GroupCore, worker_times
from minips.core.roster import GroupHandle
from minips.core.ssp import Iterations, IterationTimes
from minips.errors import RemoteProtocolError
from minips.net import transport
from minips.net.channel import Channel
from minips.wire import control, conversation, frames, messages
from minips.worker import probe_payload

N = 16


def push(clock: int, step_time: float, samples: int = 8) -> messages.Push:
    return messages.Push(clock=clock, samples=samples, step_time=step_time, loss=1.0,
                         payload=sparse.encode_vector(np.ones(N, np.float32)))


# -- the measurement ------------------------------------------------------------------------

def test_an_iteration_is_the_push_interval_less_the_ssp_hold() -> None:
    it = Iterations()
    assert it.push(0, 10.0, 0.05) is None  # the first PUSH opens the interval
    it.held(0, 0.3)  # its next PULL waited 0.3 s on the group's slowest
    assert it.push(0, 11.0, 0.2) == pytest.approx(0.7)  # 1.0 s apart, 0.3 of it held
    assert it.push(0, 11.5, 0.2) == pytest.approx(0.5)  # no hold: the whole interval
    it.push(1, 10.0, 0.1)
    it.push(1, 12.0, 0.1)  # worker 1: one interval of 2 s
    taken = it.take()
    assert taken[0].iteration_s == pytest.approx((0.7 + 0.5) / 2)
    assert taken[0].compute_s == pytest.approx(0.2)
    assert taken[1] == IterationTimes(cast(float, pytest.approx(2.0)),
                                     cast(float, pytest.approx(0.1)))
    assert it.take() == {}  # reset by take
    it.start(0)  # it rejoined (after 100 s away): time away is no iteration
    assert it.push(0, 111.5, 0.2) is None
    assert it.push(0, 112.0, 0.2) == pytest.approx(0.5)


def test_a_hold_longer_than_the_interval_leaves_the_compute_time_not_less() -> None:
    it = Iterations()
    it.push(0, 0.0)
    it.held(0, 2.0)  # a clock error in the shell would say more than the interval
    assert it.push(0, 1.0, 0.25) == pytest.approx(0.25)


def test_the_group_core_times_each_worker_and_sends_it_with_its_exchange() -> None:
    # SSP, two workers: w0 computes 0.1 s but waits on w1 (0.3 s of hold a step); w1 pushes
    # every 0.6 s because its link is slow, its compute is 0.1 s too
    run = RunConfig(workers=2, mode="ssp", staleness=0, sync_every=100, batch_size=8).validate()
    core = GroupCore(0, run, np.zeros(N, np.float32), members=[0, 1])
    for w in (0, 1):
        core.join(w, 0.0)
    core.push(0, push(1, 0.1), 0.2)
    core.push(1, push(1, 0.1), 0.6)
    core.weights_message(0, [1], held_s=0.4)  # w0's PULL held from 0.2 until w1 pushed at 0.6
    core.weights_message(1, [])
    core.push(0, push(2, 0.1), 0.8)  # 0.6 s after its last, 0.4 of it held: 0.2
    core.push(1, push(2, 0.1), 1.2)  # 0.6 s, never held: 0.6
    out = core.begin_exchange(False, {"bytes_in": 0, "bytes_out": 0})
    assert out.stats["iter_workers"] == [0, 1]
    assert out.stats["iter_us"] == [200_000, 600_000]
    assert out.stats["compute_us"] == [100_000, 100_000]
    assert out.stats["iter_time"] == pytest.approx(0.4)  # GDTopK's group figure: their mean
    # on the wire to the global server, and back
    data = b"".join(bytes(b) for b in frames.encode(exchange_message(out.delta, out.stats)))
    (back,) = frames.FrameDecoder().feed(data)
    assert isinstance(back, messages.Exchange)
    assert (back.iter_workers, back.iter_us, back.compute_us) == (
        [0, 1], [200_000, 600_000], [100_000, 100_000])
    # and in the group's record
    assert worker_times(out.stats) == {"iteration_s": {"0": 0.2, "1": 0.6},
                                       "compute_s": {"0": 0.1, "1": 0.1}}


def test_an_exchange_whose_iteration_lists_differ_in_length_is_refused() -> None:
    msg = messages.Exchange(session=1, seq=1, iter_workers=[0, 1], iter_us=[5], compute_us=[1, 2],
                            payload=sparse.encode_vector(np.zeros(N, np.float32)))
    with pytest.raises(RemoteProtocolError, match="iter_workers"):
        conversation.check_exchange(msg)


def test_lbbsp_batches_follow_the_iteration_not_the_compute_time() -> None:
    b = Balancer(batch_size=64, every=1)
    b.observe(0, 0.1, 64)  # equal compute ...
    b.observe(1, 0.3, 64)  # ... but worker 1's iteration (its link) is 3x: what the core feeds
    assert b.round_done([0, 1]) == {0: 96, 1: 32}
    run = RunConfig(workers=2, mode="lbbsp", batch_size=32, balance_every=2).validate()
    core = GroupCore(0, run, np.zeros(N, np.float32), members=[0, 1])
    for w in (0, 1):
        core.join(w, 0.0)
    logs = []
    for r in range(2):  # both compute 0.1 s for 32 samples; w1's pushes come 0.3 s apart
        for w, now in ((0, 0.1 + 0.3 * r), (1, 0.3 + 0.3 * r)):
            logs += [a for a in core.push(w, push(r + 1, 0.1, 32), now) if isinstance(a, Log)]
        for w in (0, 1):  # w0's PULL waits on w1 each round: 0.2 s held
            core.weights_message(w, [1] if w == 0 else [], held_s=0.2 if w == 0 else 0.0)
    # round 1 knows only the compute times (equal: no change); the balance after round 3
    # (1 + balance_every) sees w0 at 0.1 s (0.3 s apart, 0.2 of it held), w1 at 0.3 s
    for w, now in ((0, 0.7), (1, 0.9)):
        logs += [a for a in core.push(w, push(3, 0.1, 32), now) if isinstance(a, Log)]
    balance = [a.fields["batches"] for a in logs if a.event == "balance"]
    assert balance and balance[-1]["0"] > 2 * balance[-1]["1"], balance


# -- grouping on iteration times ----------------------------------------------------------

def global_core(workers: int, **run: object) -> GlobalCore:
    cfg = RunConfig(workers=workers, mode="gssp", lr_warmup=0.0, **run)  # type: ignore[arg-type]
    c = GlobalCore(cfg, np.zeros(N, np.float32), regroup=True, wall=lambda: 1e9)
    for w in range(workers):
        c.roster.admit(w)
        c.worker_joined(w)
    return c


def form(c: GlobalCore) -> dict[int, int]:
    assignment = c.first_assignment(0.0)
    handles = [GroupHandle(g, f"h:{g}", [w for w, h in assignment.items() if h == g])
               for g in sorted(set(assignment.values()))]
    c.groups_formed(handles, assignment, 0.0)
    return assignment


def exchange_stats(times: dict[int, float], compute: float = 0.02) -> dict[str, object]:
    return {"samples": 8, "iter_workers": list(times), "session": -1, "seq": -1,
            "iter_us": [round(t * 1e6) for t in times.values()],
            "compute_us": [round(compute * 1e6)] * len(times)}


def test_a_worker_slow_by_its_link_is_grouped_apart_though_its_compute_is_fast() -> None:
    c = global_core(4)
    for w in range(4):  # every worker computes a step in 20 ms ...
        c.on_stats(w, control.Stats(clock=0, step_time=0.02, loss=1.0), 0.0)
    assert grouping.assign_groups(c.roster.step_times()) == {0: 0, 1: 0, 2: 0, 3: 0}
    # ... but worker 3's weights and push take 0.5 s over its link (calibration's probe)
    c.workers[3].link_s = 0.5
    assert c.roster.iteration_times()[3] == pytest.approx(0.52)
    first = form(c)
    assert first[0] == first[1] == first[2] != first[3]
    # its group reports its iterations; compute stays fast in its STATS: never moved back
    for t in range(1, 60):
        c.merge(first[3], np.zeros(N, np.float32), exchange_stats({3: 0.5}), float(t))
        c.merge(first[0], np.zeros(N, np.float32), exchange_stats({0: 0.03, 1: 0.03, 2: 0.03}),
                float(t))
        for w in range(4):
            got = c.on_stats(w, control.Stats(clock=t, step_time=0.02, loss=1.0), float(t))
            assert not any(isinstance(a, Regroup) for a in got), (t, got)
    assert c.workers[3].iteration_s == pytest.approx(0.5)
    assert c.workers[3].step_time == pytest.approx(0.02)  # compute kept beside it


def test_a_lasting_slow_link_regroups_by_the_measured_iteration() -> None:
    # equal compute and no link measured at calibration: one group, then worker 3's link
    # slows 10x; its group's exchanges say so and the change-point test moves it out at once
    c = global_core(4)
    for w in range(4):
        c.on_stats(w, control.Stats(clock=0, step_time=0.02, loss=1.0), 0.0)
    first = form(c)
    assert set(first.values()) == {0}
    moved = None
    for t in range(2, 40, 2):
        c.merge(0, np.zeros(N, np.float32), exchange_stats({0: 0.03, 1: 0.03, 2: 0.03, 3: 0.4}),
                float(t))
        got = c.on_stats(0, control.Stats(clock=t, step_time=0.02, loss=1.0), float(t))
        moved = next((a.assignment for a in got if isinstance(a, Regroup)), None)
        if moved:
            break
    assert moved is not None and t <= 6, t  # the change-point test's 2nd look
    assert moved[3] != moved[0] == moved[1] == moved[2]


def test_a_fast_worker_held_by_a_slow_one_is_not_counted_slow() -> None:
    # the group core subtracts the hold: its exchange says 30 ms for the fast workers, so the
    # roster still sees them at their own pace (not the slow one's 0.4 s)
    c = global_core(3)
    for w in range(3):
        c.on_stats(w, control.Stats(clock=0, step_time=0.02, loss=1.0), 0.0)
    form(c)
    c.merge(0, np.zeros(N, np.float32), exchange_stats({0: 0.03, 1: 0.03, 2: 0.4}), 1.0)
    times = c.roster.iteration_times()
    assert times[0] == pytest.approx(0.03) and times[2] == pytest.approx(0.4)


def test_a_late_joiner_is_placed_by_its_iteration() -> None:
    c = global_core(3)
    for w in (0, 1):
        c.on_stats(w, control.Stats(clock=0, step_time=0.02, loss=1.0), 0.0)
    c.calib_timeout(60.0)
    c.workers[1].link_s = 0.5  # worker 1's link: a group of its own
    first = form(c)
    assert first[0] != first[1]
    c.workers[2].link_s = 0.45  # a late joiner, its compute as fast, its link as slow as w1's
    assert c.on_stats(2, control.Stats(clock=0, step_time=0.02, loss=1.0), 61.0) == [PlaceLate(2)]
    c.place_late(2)
    assert c.workers[2].group == first[1]


def test_gdtopk_first_ratios_see_the_link() -> None:
    c = global_core(4, compressor="gdtopk", ratio=0.01)
    for w in range(4):
        c.on_stats(w, control.Stats(clock=0, step_time=0.02, loss=1.0), 0.0)
    c.workers[3].link_s = 0.38  # 20x the others' iteration
    first = form(c)
    policy = c.roster.policy
    assert policy is not None
    assert policy.times[first[3]] == pytest.approx(0.4)
    assert policy.times[first[0]] == pytest.approx(0.02)
    assert c.ratio_of(first[3]) > c.ratio_of(first[0])  # slower-more: the slow group sends more


def test_a_resumed_server_groups_by_the_iterations_it_saved() -> None:
    c = global_core(2)
    for w in (0, 1):
        c.on_stats(w, control.Stats(clock=0, step_time=0.02, loss=1.0), 0.0)
    c.workers[1].link_s = 0.5
    form(c)
    c.merge(1, np.zeros(N, np.float32), exchange_stats({1: 0.6}), 1.0)
    back = GlobalCore(c.run, None, regroup=True, wall=lambda: 1e9)
    back.load_state_dict(c.checkpoint_state())
    assert back.roster.iteration_times() == {0: pytest.approx(0.02), 1: pytest.approx(0.6)}
    assert back.workers[1].link_s == pytest.approx(0.5)


# -- the first grouping sees the link: the calibration's probe ------------------------------

def test_the_link_probe_is_timed_from_the_weights_going_out_to_its_push() -> None:
    c = global_core(2)
    assert c.probe_pushed(1, 5.0) == []  # no probe's PULL before it: nothing timed
    assert c.probe_pulled(1, 10.0) == []
    (line,) = c.probe_pushed(1, 10.8)
    assert isinstance(line, Log) and line.event == "link_probe"
    assert line.fields == {"worker": 1, "link_s": pytest.approx(0.8)}
    c.probe_pulled(1, 11.0)
    late = c.probe_pushed(1, 12.5)[0]
    assert isinstance(late, Log) and late.fields["link_s"] == pytest.approx(1.5)  # a CPU hiccup
    assert c.workers[1].link_s == pytest.approx(0.8)  # the fastest of the session's probes
    c.on_stats(1, control.Stats(clock=0, step_time=0.02, loss=1.0), 13.0)
    assert c.roster.iteration_times() == {1: pytest.approx(0.82)}  # compute + link
    c.worker_joined(1)  # a new session (a restarted worker): its probes count anew
    c.probe_pulled(1, 20.0)
    c.probe_pushed(1, 21.0)
    assert c.workers[1].link_s == pytest.approx(1.0)
    c.workers[1].iteration_s = 0.5  # once its group timed it, that is what counts
    assert c.roster.iteration_times() == {1: pytest.approx(0.5)}


def test_the_control_channel_allows_one_probe_then_no_initial_weights() -> None:
    conv = conversation.Conversation(conversation.Role.CONTROL)
    grad = sparse.encode_vector(np.ones(N, np.float32))
    with pytest.raises(RemoteProtocolError):  # a PUSH needs the probe's PULL before it
        conv.receive(messages.Push(clock=1, payload=grad))
    conv.receive(messages.Pull(clock=0))
    assert conv.turn == conversation.Turn.PROBING
    conv.receive(control.Stats(clock=0, step_time=0.1, loss=1.0))  # it gave up waiting
    with pytest.raises(RemoteProtocolError):  # the clock after the PULL's
        conv.receive(messages.Push(clock=2, payload=grad))
    conv.receive(messages.Push(clock=1, payload=grad))
    assert conv.turn == conversation.Turn.INITIALIZED
    with pytest.raises(RemoteProtocolError, match="twice"):
        conv.receive(messages.InitWeights(size=N, payload=grad))


async def test_a_server_answers_the_probe_on_the_control_channel_and_times_it(
        tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(N, np.float32), workers=2, mode="gssp")
    port = await srv.start()
    chans: list[Channel] = []
    try:
        ctl = await transport.connect("127.0.0.1", port, worker_id=0, token=TOKEN)
        chans.append(ctl)
        assert ctl.welcome_info["link_probe"] is True
        await ctl.send(messages.Pull(clock=0))
        assert (await recv_as(ctl, messages.GlobalWeights, 10)).size == N
        grad = sparse.encode_vector(np.ones(N, np.float32))
        await ctl.send(messages.Push(clock=1, payload=grad))
        await ctl.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
        entry = srv.core.workers[0]
        await wait_until(lambda: entry.link_s is not None and entry.step_time, 10)
        assert 0.0 <= (entry.link_s or 0.0) < 5.0
        other = await transport.connect("127.0.0.1", port, worker_id=1, token=TOKEN)
        chans.append(other)  # a PUSH with no probe's PULL before it: refused, the session cut
        await other.send(messages.Push(clock=1, payload=grad))
        err = await recv_as(other, control.Error, 10)
        assert err.code == "invalid" and "PUSH" in err.reason
    finally:
        for ch in chans:
            await ch.close()
        await srv.close()


async def wait_until(cond: Callable[[], object], timeout: float) -> None:
    """Poll ``cond`` on the event loop until it is truthy; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_probes_push_is_the_size_of_a_real_one() -> None:
    g = np.linspace(-1.0, 1.0, 1000, dtype=np.float32)
    dense = probe_payload(g, WireSpec(sparse=False), 0.01)
    assert dense.encoding == "dense-f32"
    assert sum(memoryview(b).nbytes for b in dense.buffers) == 4000  # (1000,) float32
    top = sparse.decode_vector(probe_payload(g, WireSpec(sparse=True), 0.01), 1000)
    assert isinstance(top, sparse.SparseVector) and top.nnz == 10
    assert np.all(np.abs(top.values) >= 0.98)  # the largest entries, as top-k sends


# -- a real run: one worker behind a slow link, its compute as fast as the others' -----------

def _assignments(run_dir: Path) -> list[dict[str, int]]:
    """The grouping as it was after the first grouping and after each regroup."""
    first = records(run_dir / "global.jsonl", event="groups")
    assert first, "no grouping was logged"
    now = {w: int(g) for w, g in first[0]["assignment"].items()}
    out = [dict(now)]
    for r in records(run_dir / "global.jsonl", event="regroup"):
        now.update({w: int(g) for w, g in r["moved"].items()})
        out.append(dict(now))
    return out


@pytest.mark.timeout(90)
def test_a_real_run_groups_the_slow_link_worker_apart_and_never_moves_it_back(
        tmp_path: Path) -> None:
    # three workers at one emulated pace (100 ms a step), the number of groups left to the
    # grouping; worker 2's link is 4 mbit: a dense LeNet-5 pull or push (~250 KB) takes it
    # ~0.5 s, the others' a millisecond (20 s on an idle 2-core machine, start-up included)
    cmd = [sys.executable, "-m", "minips", "local", "--no-progress", "--no-eval", "--no-plot",
           "--out", str(tmp_path), "--name", "link", "--device", "cpu", "--mode", "gssp",
           "--workers", "3", "--base-step", "0.1", "--wall-s", "4",
           "--link", "1000,1000,4mbit", "--link-shaping", "pacer"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "link"
    probes = {r["worker"]: r["link_s"] for r in records(run_dir / "global.jsonl",
                                                        event="link_probe")}
    assert probes[2] > 0.3 and probes[2] > 10 * max(probes[0], probes[1]), probes
    grouped = records(run_dir / "global.jsonl", event="groups")[0]
    compute, iteration = grouped["compute_s"], grouped["iteration_s"]
    assert compute["2"] < 2 * min(compute["0"], compute["1"])  # its compute is as fast
    assert iteration["2"] > 5 * max(iteration["0"], iteration["1"])  # its iteration is not
    for a in _assignments(run_dir):  # apart on the first grouping, and never moved back
        assert a["2"] != a["0"] and a["2"] != a["1"], a
    g = grouped["assignment"]["2"]
    timed = [r for r in records(run_dir / f"group-{g}.jsonl", event="exchange")
             if "2" in r.get("iteration_s", {})]
    assert timed, "its group server timed none of its iterations"
    assert all(r["iteration_s"]["2"] > 3 * r["compute_s"]["2"] for r in timed), timed
