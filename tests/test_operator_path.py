"""What an operator meets on the documented multi-machine path (issue 42): a connect error that
says what went wrong and gives up in the time given; a port in use named by its flag, with
nothing created; the external-group default that never hangs; the grouping deadline counted
from the first join; a resume that keeps its counters; a run that exits promptly when done.
Real processes on loopback where the issue says so, each with a hard timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import minips_server, records, recv_as, run_t0, until, wait_ready_file

from minips.core.config import RunConfig
from minips.net import channel, lifeline, transport
from minips.run.cli import main
from minips.server import GlobalServer, ServerConfig
from minips.wire import control, messages
from minips.wire.fields import Payload


@contextlib.contextmanager
def listener_that_never_accepts() -> Iterator[int]:
    """A loopback port whose connections the kernel completes but nobody ever answers: a
    client's handshake waits for a reply that never comes (a hung server, a middlebox)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])


def closed_port() -> int:
    """A loopback port nothing listens on: every connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- connecting: the failure named, the timeout honoured -----------------------------------------

@pytest.mark.timeout(30)
async def test_a_refused_port_is_called_refused_with_its_address() -> None:
    port = closed_port()
    t = time.monotonic()
    with pytest.raises(transport.Unreachable) as err:
        await transport.connect("127.0.0.1", port, timeout=1.5, retries=None, token="")
    said = str(err.value)
    assert f"127.0.0.1:{port}" in said and "connection refused" in said, said
    assert "TimeoutError" not in said and err.value.silent
    assert time.monotonic() - t < 1.5 + 0.5


@pytest.mark.timeout(30)
async def test_a_peer_that_never_answers_is_called_timed_out() -> None:
    with listener_that_never_accepts() as port:
        with pytest.raises(transport.Unreachable, match="timed out") as err:
            await transport.connect("127.0.0.1", port, timeout=1.0, retries=None, token="")
    assert f"127.0.0.1:{port}" in str(err.value) and "TimeoutError()" not in str(err.value)


@pytest.mark.timeout(60)
def test_worker_timeout_is_honoured_and_the_cause_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`minips worker --timeout 2` to a port that never answers gives up within about 2 s
    (not 2 s plus a TLS probe of the silent port), naming the address and 'timed out'."""
    import torch  # noqa: F401  imported before the clock starts: a cold import under load took 3 s
    with listener_that_never_accepts() as port:
        t = time.monotonic()
        code = main(["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "2",
                     "--data", "synthetic"])
        took = time.monotonic() - t
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"127.0.0.1:{port} within 2.0 s" in err[0] and "timed out" in err[0], err
    # the TLS probe of the silent port took 3 s more
    assert took < 2.0 + 2.5, f"gave up after {took:.1f} s with --timeout 2"


def _can_make_namespaces() -> str:
    """'' when this process may create a network namespace (root and iproute2), else why not."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"no usable iproute2: {exc}"
    return ""


@pytest.mark.timeout(60)
def test_an_address_whose_packets_vanish_times_out_in_the_time_given() -> None:
    """In a network namespace of the test's own: 10.77.0.2 sits behind a veth whose other end
    has no address, so a SYN to it is dropped (timed out); 10.77.0.3 does not answer ARP
    (unreachable). No packet leaves the namespace."""
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    ns = f"mpo{os.getpid()}"
    ip = ["ip", "-n", ns]
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
        for args in (["link", "set", "lo", "up"],
                     ["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                     ["addr", "add", "10.77.0.1/24", "dev", "v0"], ["link", "set", "v0", "up"],
                     ["link", "set", "v1", "up"],
                     ["neigh", "add", "10.77.0.2", "lladdr", "02:00:00:00:00:02", "dev", "v0"]):
            subprocess.run([*ip, *args], check=True, capture_output=True, timeout=10)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"cannot wire a namespace here: {exc.stderr}")
    try:
        for address, cause in (("10.77.0.2:7070", "timed out"), ("10.77.0.3:7070", "unreachable")):
            t = time.monotonic()
            done = subprocess.run(["ip", "netns", "exec", ns, "python", "-m", "minips", "worker",
                                   "--connect", address, "--timeout", "4", "--data", "synthetic"],
                                  capture_output=True, text=True, timeout=40,
                                  env={**os.environ, "PATH": _venv_path()})
            took = time.monotonic() - t
            assert done.returncode == 2 and cause in done.stderr and address in done.stderr, \
                done.stderr
            assert took < 4 + 4, f"{address}: gave up after {took:.1f} s with --timeout 4"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _venv_path() -> str:
    """PATH with this interpreter's directory first, so `python` is the one running the test."""
    return f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"


# -- --external-groups: as many groups as group processes; a task that fails ends the run ---------

TOKEN = "operator-path-secret-0123456789"
N = 61_706  # LeNet-5's parameters, the server's default model


def _group_process(tmp: Path, port: str) -> subprocess.Popen[str]:
    """A `minips group` registering with the server on ``port``, listening on a free port."""
    return subprocess.Popen(
        [sys.executable, "-m", "minips", "group", "--connect", f"127.0.0.1:{port}", "--listen",
         "127.0.0.1:0", "--run-dir", str(tmp / "group")],
        env=lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def _calibrated(port: str, w: int, step_time: float) -> tuple[Any, control.Assign]:
    """Worker ``w``'s control channel with its calibration STATS sent; (channel, ASSIGN)."""
    ctl = await transport.connect("127.0.0.1", int(port), role="worker", worker_id=w,
                                  token=TOKEN, options=channel.Options(heartbeat=1.0))
    await ctl.send(control.Stats(clock=0, step_time=step_time, loss=2.3, samples=32))
    return ctl, await recv_as(ctl, control.Assign, 20)


@pytest.mark.timeout(120)
async def test_external_groups_with_auto_groups_form_one_group_per_group_process(
        tmp_path: Path) -> None:
    """README's `minips server --external-groups 1` (GSSP, --groups 0) with a fast and a slow
    worker: one group, served by the one group process, not a second group nobody serves."""
    np.save(tmp_path / "init.npy", np.zeros(N, np.float32))
    with minips_server(tmp_path, TOKEN, "--mode", "gssp", "--workers", "2", "--epochs", "1",
                       "--external-groups", "1", "--calib-timeout", "3",
                       "--init", str(tmp_path / "init.npy")) as (server, _, port):
        group = _group_process(tmp_path, port)
        try:
            fast, slow = await asyncio.gather(_calibrated(port, 0, 0.02),
                                              _calibrated(port, 1, 0.2))
            assert fast[1].group == slow[1].group == 0
            assert fast[1].address == slow[1].address != ""
            assert server.poll() is None  # still serving its one group
            for ctl, _ in (fast, slow):
                await ctl.close()
        finally:
            group.kill()
            group.communicate(timeout=30)


@pytest.mark.timeout(120)
async def test_a_group_nobody_serves_ends_the_run_with_one_line_and_exit_3(
        tmp_path: Path) -> None:
    """--external-groups 2 with one group process: when the second group gets no server within
    the grouping wait, the server says so and exits 3 (no 'Task exception was never retrieved',
    no hang)."""
    np.save(tmp_path / "init.npy", np.zeros(N, np.float32))
    with minips_server(tmp_path, TOKEN, "--mode", "gssp", "--workers", "2", "--groups", "2",
                       "--epochs", "1", "--external-groups", "2", "--calib-timeout", "2",
                       "--init", str(tmp_path / "init.npy")) as (server, _, port):
        group = _group_process(tmp_path, port)
        try:
            chans = [await transport.connect("127.0.0.1", int(port), role="worker",
                                             worker_id=w, token=TOKEN) for w in (0, 1)]
            for ch, step in zip(chans, (0.02, 0.2), strict=True):
                await ch.send(control.Stats(clock=0, step_time=step, loss=2.3, samples=32))
            t = time.monotonic()
            code = await asyncio.to_thread(server.wait, 30)
            took = time.monotonic() - t
            err = server.communicate(timeout=10)[1]
            for ch in chans:
                ch.close_nowait()
        finally:
            group.kill()
            group.communicate(timeout=30)
    assert code == 3, err
    assert "no external group server connected for group 1" in err, err
    assert "never retrieved" not in err and "Traceback" not in err, err
    assert took < 15, f"the server exited {took:.1f} s after the workers reported"


# -- the grouping deadline counts from the first join; a late worker is placed, and said so -------

@pytest.mark.timeout(60)
async def test_the_grouping_deadline_counts_from_the_first_join_and_a_late_worker_is_placed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A server started 1.5 s before its workers, with a 1 s grouping deadline: the two workers
    that report together are grouped together (the deadline had not started), the console says
    the deadline passed with 2 of 3, and the third, reporting after the grouping, is placed in a
    group (ASSIGN, a ``placed`` record and a console line)."""
    cfg = ServerConfig(run=RunConfig(workers=3, mode="gssp", epochs=1.0), port=0,
                       run_dir=str(tmp_path), calib_timeout_s=1.0, console=True)
    srv = GlobalServer(cfg, np.zeros(8, np.float32))
    port = str(await srv.start())
    chans = []
    try:
        await asyncio.sleep(1.5)  # the scenario: the server was up long before any worker
        first = asyncio.ensure_future(_calibrated_plain(port, 0, 0.02))
        await until(lambda: 0 in srv.core.workers and bool(srv.core.workers[0].step_time))
        second = await _calibrated_plain(port, 1, 0.02)  # after worker 0's STATS was handled
        chans += [(await first)[0], second[0]]
        grouped = records(tmp_path / "global.jsonl", event="groups")
        assert sorted(grouped[0]["assignment"]) == ["0", "1"], grouped
        late, assign = await _calibrated_plain(port, 2, 0.02)
        chans.append(late)
        placed = records(tmp_path / "global.jsonl", event="placed")
        assert [(r["worker"], r["group"]) for r in placed] == [(2, assign.group)]
        out = capsys.readouterr().out
        assert "grouping deadline passed" in out and "with 2 of 3 workers reported" in out, out
        assert f"worker 2 reported after the grouping: placed in group {assign.group}" in out
    finally:
        for ch in chans:
            ch.close_nowait()
        await srv.close()


async def _calibrated_plain(port: str, w: int, step_time: float) -> tuple[Any, control.Assign]:
    """As ``_calibrated``, against a server without a secret."""
    ctl = await transport.connect("127.0.0.1", int(port), role="worker", worker_id=w, token="")
    await ctl.send(control.Stats(clock=0, step_time=step_time, loss=2.3, samples=32))
    return ctl, await recv_as(ctl, control.Assign, 20)


# -- a port in use: one line naming the flag, exit 2, nothing created ------------------------------

@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port another program listens on for the length of the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("flag", ["--port", "--dashboard"])
@pytest.mark.timeout(60)
def test_a_port_in_use_names_its_flag_and_creates_nothing(
        flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINIPS_TOKEN", raising=False)
    monkeypatch.setenv("MINIPS_DASHBOARD_TOKEN", "operator-dashboard-0123456789")
    run_dir = tmp_path / "server"
    with held_port() as taken:
        given = str(taken) if flag == "--port" else f"127.0.0.1:{taken}"
        port = [] if flag == "--port" else ["--port", "0"]
        code = main(["server", "--host", "127.0.0.1", flag, given, *port, "--epochs", "1",
                     "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{flag}: 127.0.0.1:{taken} is already in use" in err[0], err
    assert f"pick another with {flag}" in err[0] and "Errno" not in err[0], err
    assert not run_dir.exists()  # the rerun with another port is not refused


@pytest.mark.timeout(30)
async def test_a_port_taken_after_the_check_is_still_one_line_naming_the_flag(
        tmp_path: Path) -> None:
    from minips.errors import ConfigError

    with held_port() as taken:
        srv = GlobalServer(ServerConfig(run=RunConfig(workers=1), port=taken,
                                        run_dir=str(tmp_path)), np.zeros(4, np.float32))
        with pytest.raises(ConfigError, match=rf"--port: 127.0.0.1:{taken} is already in use"):
            await srv.start()
        await srv.close()


# -- a run that is done exits promptly: every role within a second or two of `done` ---------------

# after the server's `done` record every process has exited by then: about a second on a quiet
# 2-core machine; 2.6-6.3 s with a load average of 20 (other tests beside it), against 15 s
# (--linger) and more before the fix
PROMPT_EXIT_S = 8.0
FINAL_PULL_S = 2.0  # the evaluator's final PULL is answered this soon after `done`


@pytest.mark.timeout(240)
def test_every_role_exits_promptly_once_the_run_is_done(tmp_path: Path) -> None:
    """A server with an evaluator child (--eval), a `minips group` process and two workers, a
    4 s wall budget: each process exits within PROMPT_EXIT_S of the server's `done` (the
    evaluator PULLs the final weights just after the end, not a whole period later, and the
    server does not linger for a PULL that will not come)."""
    np.save(tmp_path / "init.npy", np.zeros(N, np.float32))
    env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"})
    ready = tmp_path / "server.addr"
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as out:
            return subprocess.Popen([sys.executable, "-m", "minips", *args], env=env,
                                    stdout=out, stderr=subprocess.STDOUT)

    procs = {"server": start("server", "server", "--port", "0", "--ready-file", str(ready),
                             "--run-dir", str(tmp_path), "--init", str(tmp_path / "init.npy"),
                             "--workers", "2", "--mode", "ssp", "--compressor", "none",
                             "--epochs", "0", "--wall-s", "4", "--base-step", "0.01",
                             "--external-groups", "1", "--eval", "--calib-timeout", "60",
                             # a period longer than the run: only the end brings the final
                             # PULL; a small test set, as its score runs beside the training
                             "--eval-every", "30", "--eval-limit", "200")}
    try:
        host, port = wait_ready_file(ready, procs["server"])
        procs["group"] = start("group", "group", "--connect", f"{host}:{port}", "--listen",
                               "127.0.0.1:0", "--run-dir", str(tmp_path))
        for w in (0, 1):
            procs[f"worker-{w}"] = start(f"worker-{w}", "worker", "--connect", f"{host}:{port}",
                                         "--id", str(w), "--run-dir", str(tmp_path),
                                         "--data", "synthetic")
        ended: dict[str, tuple[float, int]] = {}
        deadline = time.monotonic() + 180
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for name, p in procs.items():
                if name not in ended and p.poll() is not None:
                    ended[name] = (time.time(), p.returncode)
            time.sleep(0.02)  # polling the processes with a deadline
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    done = records(tmp_path / "global.jsonl", event="done")
    assert done, "the run did not end"
    t_done = run_t0(tmp_path) + done[0]["t"]
    late = {name: round(t - t_done, 2) for name, (t, _) in ended.items()}
    assert all(code == 0 for _, code in ended.values()), (ended, late)
    assert all(s < PROMPT_EXIT_S for s in late.values()), f"exited after done (s): {late}"
    final = records(tmp_path / "eval.jsonl", final=True)
    assert final, "the final weights were not scored"
    assert final[0]["t"] - done[0]["t"] < FINAL_PULL_S, (final[0]["t"], done[0]["t"])


def test_the_evaluator_pulls_just_after_the_likely_end_not_a_period_later() -> None:
    from minips.evaluator import END_PULL_S, budget_left_s, next_pull_s

    run = RunConfig(wall_s=60.0, epochs=0.0, eval_every_s=5.0)
    w = messages.GlobalWeights(version=1, done=False, size=0, samples=100, t=0.0, train_s=58.5,
                               payload=Payload("dense-f32", {}, ()))
    assert budget_left_s(run, w) == pytest.approx(1.5)
    assert next_pull_s(run, 1.5, since_pull=0.0) == pytest.approx(1.5)  # not 5
    assert next_pull_s(run, -0.2, since_pull=2.0) == END_PULL_S  # due: every END_PULL_S
    assert next_pull_s(run, 30.0, since_pull=2.0) == pytest.approx(3.0)  # the period
    assert next_pull_s(run, -9.0, since_pull=2.0) == pytest.approx(3.0)  # a wrong estimate
    epochs = RunConfig(epochs=1.0, eval_every_s=5.0)
    half = messages.GlobalWeights(version=1, done=False, size=0, t=0.0, train_s=10.0,
                                  samples=epochs.epoch_samples() // 2,
                                  payload=Payload("dense-f32", {}, ()))
    assert budget_left_s(epochs, half) == pytest.approx(10.0, rel=1e-3)  # at the rate so far


# -- TLS as printed: the join: line names the CA the user made ------------------------------------

def _printed(line: str, flag: str) -> str:
    words = line.split()
    return words[words.index(flag) + 1]


@pytest.mark.timeout(120)
async def test_the_printed_tls_ca_is_the_ca_of_the_recipe_and_works_verbatim(
        tmp_path: Path) -> None:
    """docs/operations.md's recipe (a CA, a certificate it signs, beside it a group's
    certificate and another CA): the join: and group: lines name ca.pem, and a client given
    exactly that file and address completes the handshake with the server."""
    from test_tls_cluster import make_ca, sign

    from minips.net.endpoints import client_ssl
    from minips.run.cli import join_commands

    make_ca(tmp_path)
    make_ca(tmp_path, "other-ca")
    cert, key = sign(tmp_path, "server", "IP:127.0.0.1")
    sign(tmp_path, "group", "IP:127.0.0.1")
    cfg = ServerConfig(run=RunConfig(workers=1), host="127.0.0.1", port=0, token=TOKEN,
                       run_dir=str(tmp_path / "run"), tls_cert=cert, tls_key=key,
                       external_groups=1)
    srv = GlobalServer(cfg, np.zeros(4, np.float32))
    port = await srv.start()
    try:
        lines = join_commands(cfg, port)
        assert {_printed(line, "--tls-ca") for line in lines} == {str(tmp_path / "ca.pem")}
        join = next(line for line in lines if line.startswith("join:"))
        host, _, joined = _printed(join, "--connect").rpartition(":")
        ch = await transport.connect(host, int(joined), token=TOKEN, timeout=10,
                                     ssl=client_ssl(_printed(join, "--tls-ca")))
        await ch.close()
    finally:
        await srv.close()


def test_a_self_signed_certificate_is_its_own_printed_ca(tmp_path: Path) -> None:
    from conftest import make_certificate

    from minips.run.cli import join_commands

    cert, key = make_certificate(tmp_path, "IP:127.0.0.1")
    cfg = ServerConfig(host="127.0.0.1", tls_cert=str(cert), tls_key=str(key))
    assert _printed(join_commands(cfg, 7070)[0], "--tls-ca") == str(cert.resolve())


# -- a resume keeps its counters, says so, and does not count the downtime as training ------------

@pytest.mark.timeout(60)
async def test_a_resume_keeps_the_worker_traffic_says_so_and_leaves_the_downtime_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from minips.record import checkpoint
    from minips.record.metrics import summarize

    run = RunConfig(workers=1, epochs=0.0, wall_s=600.0)
    cfg = ServerConfig(run=run, port=0, run_dir=str(tmp_path), console=True,
                       checkpoint_every_s=0)
    first = GlobalServer(cfg, np.zeros(8, np.float32))
    port = str(await first.start())
    ctl, assign = await _calibrated_plain(port, 0, 0.02)
    grp = await transport.connect("127.0.0.1", int(assign.address.rsplit(":", 1)[1]),
                                  role="worker", worker_id=0, group=assign.group, token="")
    await recv_as(grp, messages.Ack, 10)
    before = first.traffic()
    assert before["bytes_up"] > 0
    checkpoint.save(tmp_path / "checkpoint.npz", first.checkpoint_state())
    for ch in (grp, ctl):
        ch.close_nowait()
    await first.close()  # the server is gone: kill -9 (its last checkpoint is the file)
    await asyncio.sleep(2.0)  # the scenario: 2 s of downtime before the resume
    state = checkpoint.load(tmp_path / "checkpoint.npz")
    cfg2 = ServerConfig(run=RunConfig(workers=1, epochs=0.0, wall_s=600.0, t0=state["t0"]),
                        port=0, run_dir=str(tmp_path), console=True, checkpoint_every_s=0,
                        resume=True)
    second = GlobalServer(cfg2, None)
    second.restore(state)
    await second.start()
    try:
        after = second.traffic()
        assert all(after[k] >= before[k] for k in before), (before, after)
        out = capsys.readouterr().out
        assert "resumed from checkpoint" in out and "MB on the wire so far" in out, out
        second.perform(second.core.finish("wall time"))
    finally:
        await second.close()
    done = records(tmp_path / "global.jsonl", event="done")[0]
    assert done["bytes_up"] >= before["bytes_up"], done  # the record's counters go on
    summary = summarize(tmp_path, write=False)
    gap = done["t"] - records(tmp_path / "global.jsonl", event="groups")[0]["t"]
    assert gap >= 2.0 and summary["train_s"] < 1.5, (gap, summary["train_s"])


@pytest.mark.timeout(30)
async def test_a_group_process_groups_hop_counters_survive_a_checkpoint(tmp_path: Path) -> None:
    """The bytes of a group process's exchanges and its workers' traffic, which the server
    counts (not its core), come back with a resume before the group process does."""
    from minips.core.global_core import GlobalCore
    from minips.core.roster import GroupHandle

    cfg = ServerConfig(run=RunConfig(workers=1, epochs=1.0), port=0, run_dir=str(tmp_path),
                       external_groups=1, checkpoint_every_s=0, resume=True)
    core = GlobalCore(cfg.run, np.zeros(4, np.float32), regroup=False, wall=time.time)
    core.groups[0] = GroupHandle(0, "10.0.0.2:7071", [0], served=True)
    core.started_training = time.time() - 5.0
    hops = {"bytes_to_global": 40, "bytes_from_global": 60}
    traffic = {"bytes_in": 500, "bytes_out": 700}
    state = core.checkpoint_state({0: {"traffic": traffic, "state": None, "hop_bytes": hops}})
    srv = GlobalServer(cfg, None)
    srv.restore(state)
    await srv.start()
    try:
        assert srv.hop(0) == hops and srv.peer(0).traffic() == traffic
        assert not srv.core.groups[0].served  # until a group process adopts it
        assert srv.traffic() == {"bytes_up": 500, "bytes_down": 700}
        assert srv.figures()["bytes_group_global"] == 40
    finally:
        await srv.close()


@pytest.mark.timeout(60)
async def test_a_made_dashboard_token_is_made_again_by_the_resumed_run(tmp_path: Path) -> None:
    """No MINIPS_DASHBOARD_TOKEN: the token a live server makes for a dashboard beyond loopback
    is the same when the run is resumed (same secret, same t0), another for another run, and
    never written to the run directory."""
    pytest.importorskip("aiohttp")
    from minips.dashboard.monitor import Monitor, MonitorConfig

    async def token_of(run_dir: Path, t0: float) -> str:
        cfg = ServerConfig(run=RunConfig(workers=1, t0=t0), host="127.0.0.1", port=0,
                           token=TOKEN, run_dir=str(run_dir))
        srv = GlobalServer(cfg, np.zeros(4, np.float32))
        await srv.start()
        monitor = Monitor(MonitorConfig(run_dir=str(run_dir), dashboard="0.0.0.0:0"), srv)
        try:
            url = await monitor.start()
        finally:
            await monitor.stop()
            await srv.close()
        assert "?token=" in url, url
        return url.split("?token=", 1)[1]

    first = await token_of(tmp_path / "run", 1000.5)
    assert await token_of(tmp_path / "run", 1000.5) == first  # the resume (t0 kept)
    assert await token_of(tmp_path / "other", 2000.5) != first
    for f in (tmp_path / "run").rglob("*"):
        assert not f.is_file() or first.encode() not in f.read_bytes(), f
    assert TOKEN not in first


@pytest.mark.timeout(60)
def test_local_with_a_dashboard_port_in_use_names_the_flag_and_creates_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with held_port() as taken:
        code = main(["local", "--dashboard", f"127.0.0.1:{taken}", "--out", str(tmp_path),
                     "--name", "run", "--workers", "1", "--max-steps", "1", "--no-eval",
                     "--no-plot", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"--dashboard: 127.0.0.1:{taken} is already in use" in err[-1], err
    assert not (tmp_path / "run").exists()


def test_the_dashboard_shows_a_late_worker_in_the_group_it_was_placed_in() -> None:
    from minips.dashboard.state import RunState

    s = RunState({"mode": "gssp", "workers": 3, "t0": 0.0})
    s.add("global", {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 1}})
    s.add("global", {"t": 9.0, "event": "placed", "worker": 2, "group": 1, "moved": {"2": 1}})
    assert {w["id"]: w["group"] for w in s.update(9.0)["workers"]} == {0: 0, 1: 1, 2: 1}


@pytest.mark.timeout(30)
async def test_a_server_task_that_raises_ends_the_run_but_a_peer_gone_does_not(
        tmp_path: Path) -> None:
    srv = GlobalServer(ServerConfig(run=RunConfig(workers=1), port=0, run_dir=str(tmp_path)),
                       np.zeros(4, np.float32))
    await srv.start()
    try:
        async def gone() -> None:
            raise ConnectionResetError("a worker went away")

        async def broken() -> None:
            raise RuntimeError("a bug")

        await asyncio.gather(srv.spawn(gone()), return_exceptions=True)
        assert not srv.finished.is_set() and srv.failure == ""
        await asyncio.gather(srv.spawn(broken()), return_exceptions=True)
        await asyncio.wait_for(srv.finished.wait(), 5)
        assert srv.failure == "the run cannot go on: RuntimeError: a bug"
    finally:
        await srv.close()
