"""What the soak (scripts/soak.py) found, each replayed alone (real processes, or sans-IO).
Each is fixed, and its test keeps it so. What each was:

A checkpoint the global server cannot write (a full disk: the soak fills the checkpoint
directory's tmpfs) ended the run: server.py's ``_save_loop`` let the ``OSError`` of
``checkpoint.save_in_child`` out of its task, ``_task_done`` failed the run (`failed`, code
`internal`, in global.jsonl; ERROR to every worker) and ``minips server`` exited 2, although the
previous checkpoint was intact and training could go on. The replay takes the checkpoint's
directory away after the first checkpoint (the same ``OSError`` path as ENOSPC, without root).

A `minips group` process whose connection to the global server is lost while it waits for the
grouping (SIGSTOPped or cut off past the lease: the global server drops it) exited 2 at once
("global server gone") instead of registering again for ``--reconnect`` seconds:
group_process.py's ``serve_group`` retried only inside the serve loop, and ``_register``'s
``transport.connect`` only up to the handshake, not the wait for ASSIGN and the first
GLOBAL_WEIGHTS. With every group process gone so, the run never grouped and ended failed (exit
3, "no external group server connected"). Replayed: SIGSTOP past the lease before any worker came.

An in-process group's pushes between its last exchange and a checkpoint were merged after a
resume but never counted: ``GroupSync.state_dict`` (core/exchange.py) kept the session and seq,
not ``since`` (the pushes and samples since the last exchange), while the group's weights it
restored held those pushes. The next exchange sent their delta with samples 0, so the global
sample count ended below what the workers saw ACKed (soak seed 1: 7,424 missing where the two
global-server kills' windows account for 7,104). Replayed sans-IO.

A worker killed right after a kill -9 and `--resume` of the global server, before it had
rejoined the resumed server over its control channel, was named by no line (the 30-minute soak,
seed 2, twice): the resumed server never held it, and its group process, which did, dropped the
broken connection without a word (``GroupServer.handle``). The group process now logs `left` and
reports it with its next EXCHANGE; the global server prints it when no control channel of that
worker's spoke for it. Replayed: the worker killed while the global server is down.

A worker still timing its calibration steps when the budget is spent (the soak's nemesis
killed it shortly before the end and restarted it) exited 2 instead of 0: it went on
calibrating after LEAVE(done) and sent its STATS on the closed channel. Replayed with a slow
worker beside a fast one that spends a small budget.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import logged_minips, records, wait_for

from minips.core.exchange import GroupSync
from minips.run.launch import write_init

TOKEN = "soak-findings-secret"


def start(run_dir: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    return logged_minips(run_dir, name, TOKEN, *args)


def start_group(run_dir: Path, host: str, port: str) -> subprocess.Popen[bytes]:
    """A `minips group` process for the global server at host:port, reconnecting for 60 s."""
    return start(run_dir, "group", "group", "--connect", f"{host}:{port}", "--listen",
                 "127.0.0.1:0", "--run-dir", str(run_dir), "--reconnect", "60")


@pytest.mark.timeout(120)
def test_a_checkpoint_that_cannot_be_written_does_not_end_the_run(tmp_path: Path) -> None:
    """Fixed: the failed write is a record line and one console sentence; training goes on."""
    write_init(tmp_path, "lenet5", 0)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ready = tmp_path / "server.addr"
    server = start(tmp_path, "server", "server", "--port", "0", "--run-dir", str(tmp_path),
                   "--ready-file", str(ready), "--quiet", "--init", str(tmp_path / "init.npy"),
                   "--mode", "ssp", "--compressor", "none", "--workers", "1", "--wall-s", "8",
                   "--base-step", "0.02", "--checkpoint", str(ckpt / "checkpoint.npz"),
                   "--checkpoint-every", "0.5", "--calib-timeout", "60")
    procs = [server]
    try:
        wait_for("server ready", ready.exists, 60, (server,))
        host, port = ready.read_text().split()
        procs.append(start(tmp_path, "worker", "worker", "--connect", f"{host}:{port}", "--id",
                           "0", "--run-dir", str(tmp_path)))
        wait_for("a first checkpoint", (ckpt / "checkpoint.npz").exists, 90, (server,))
        shutil.rmtree(ckpt)  # every later write fails as on a full disk
        rc = server.wait(timeout=60)
        failed = records(tmp_path / "global.jsonl", event="failed")
        assert not failed, json.dumps(failed[0])[:300]
        assert rc == 0
        assert records(tmp_path / "global.jsonl", event="checkpoint_failed")
        assert "checkpoint not written" in (tmp_path / "server.log").read_text()
        assert procs[1].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def connected(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds an established TCP connection to local ``port``
    (/proc/net/tcp: remote address ip:port in hex, state 01)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "01" and int(cols[2].split(":")[1], 16) == port and cols[9] in inodes:
            return True
    return False


@pytest.mark.timeout(120)
def test_a_group_process_dropped_before_the_grouping_registers_again(tmp_path: Path) -> None:
    """Fixed: it registers again (group_process._register_again) and the run trains."""
    write_init(tmp_path, "lenet5", 0)
    ready = tmp_path / "server.addr"
    server = start(tmp_path, "server", "server", "--port", "0", "--run-dir", str(tmp_path),
                   "--ready-file", str(ready), "--quiet", "--init", str(tmp_path / "init.npy"),
                   "--mode", "ssp", "--compressor", "none", "--workers", "1", "--epochs", "0.02",
                   "--base-step", "0.02", "--external-groups", "1", "--lease", "2",
                   "--heartbeat", "0.5", "--calib-timeout", "60")
    procs = [server]
    try:
        wait_for("server ready", ready.exists, 60, (server,))
        host, port = ready.read_text().split()
        group = start_group(tmp_path, host, port)
        procs.append(group)
        log = tmp_path / "group.log"
        wait_for("the group connected to the global server",
                 lambda: connected(group.pid, int(port)), 60, (group,))
        group.send_signal(signal.SIGSTOP)
        # past the lease (2 s): the global server drops the silent group; polled, not slept
        with pytest.raises(subprocess.TimeoutExpired):
            server.wait(timeout=5)
        group.send_signal(signal.SIGCONT)
        procs.append(start(tmp_path, "worker", "worker", "--connect", f"{host}:{port}", "--id",
                           "0", "--run-dir", str(tmp_path)))
        assert group.wait(timeout=90) == 0, log.read_text()[-500:]
        assert server.wait(timeout=30) == 0
        assert procs[2].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


def test_pushes_counted_before_a_checkpoint_are_counted_after_the_resume() -> None:
    """Fixed: GroupSync's state keeps the counters since the last exchange."""
    w = np.zeros(16, np.float32)
    saved = GroupSync(w, session=5)
    for _ in range(3):  # three worker pushes of 64 samples since the last exchange
        saved.count(64, 0.1, 1.0)
    state = saved.state_dict()
    resumed = GroupSync(w, session=5)
    resumed.load_state_dict(state, w)
    moved = w + 1.0  # the restored group weights hold the three pushes
    out = resumed.begin(moved, {})
    assert out.stats["samples"] == 192 and out.stats["pushes"] == 3, out.stats


@pytest.mark.timeout(150)
def test_a_worker_calibrating_when_the_run_ends_exits_0(tmp_path: Path) -> None:
    """The soak's w1 and w7 (two short soaks of seed 0): killed, restarted, and still timing its
    calibration steps when the budget was spent. The global server sends it LEAVE(done) and
    closes its control channel; the worker goes on calibrating, then sends its STATS on the
    closed channel and exits 2 ("connection is closed (connection closed by peer)") where a
    worker the run's end reaches exits 0. Replayed: a second worker whose calibration steps
    take 3 s each (--slowdown 60) beside one that spends the budget in a few seconds."""
    write_init(tmp_path, "lenet5", 0)
    ready = tmp_path / "server.addr"
    server = start(tmp_path, "server", "server", "--port", "0", "--run-dir", str(tmp_path),
                   "--ready-file", str(ready), "--quiet", "--init", str(tmp_path / "init.npy"),
                   "--mode", "ssp", "--compressor", "none", "--workers", "2", "--epochs", "0.1",
                   "--base-step", "0.05", "--calib-timeout", "5")  # then groups without it
    procs = [server]
    try:
        wait_for("server ready", ready.exists, 60, (server,))
        host, port = ready.read_text().split()
        for i, slowdown in enumerate(("1", "60")):
            procs.append(start(tmp_path, f"worker{i}", "worker", "--connect", f"{host}:{port}",
                               "--id", str(i), "--slowdown", slowdown, "--run-dir",
                               str(tmp_path)))
        assert server.wait(timeout=90) == 0
        assert procs[1].wait(timeout=30) == 0
        slow = procs[2].wait(timeout=60)
        assert "ms/step measured" not in (tmp_path / "worker1.log").read_text()  # it was
        # still calibrating when the run ended: the case replayed
        assert slow == 0, (tmp_path / "worker1.log").read_text()[-500:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.timeout(150)
def test_a_worker_killed_before_it_rejoined_a_resumed_server_is_said_left(
        tmp_path: Path) -> None:
    """Fixed: the group process's `left` reaches the resumed global server, which says it."""
    write_init(tmp_path, "lenet5", 0)
    ready = tmp_path / "server.addr"
    run = ("server", "--run-dir", str(tmp_path), "--ready-file", str(ready), "--quiet",
           "--mode", "ssp", "--compressor", "none", "--workers", "2", "--epochs", "2",
           "--base-step", "0.02", "--external-groups", "1", "--groups", "1", "--lease", "2",
           "--heartbeat", "0.5", "--calib-timeout", "60", "--checkpoint-every", "1")
    server = start(tmp_path, "server", *run, "--port", "0", "--init",
                   str(tmp_path / "init.npy"))
    procs = [server]
    try:
        wait_for("server ready", ready.exists, 60, (server,))
        host, port = ready.read_text().split()
        group = start_group(tmp_path, host, port)
        workers = [start(tmp_path, f"worker-{i}", "worker", "--connect", f"{host}:{port}",
                         "--id", str(i), "--run-dir", str(tmp_path), "--reconnect", "60")
                   for i in range(2)]
        procs += [group, *workers]
        wait_for("a checkpoint of some training", lambda: (tmp_path / "checkpoint.npz").exists()
                 and records(tmp_path / "global.jsonl", event="merge"), 90, (server, group))
        server.kill()
        server.wait()
        ready.unlink()
        workers[1].kill()  # its group process held its only connection: the server is gone
        workers[1].wait()
        wait_for("the group process's own line", lambda: records(
            tmp_path / "group-0.jsonl", event="left", worker=1), 30, (group,))
        server = start(tmp_path, "server-2", *run, "--port", port, "--resume")
        procs.append(server)
        resumed = wait_for("the resumed server", lambda: records(
            tmp_path / "global.jsonl", event="resumed"), 60, (server,))
        said = wait_for("the resumed server's line", lambda: [r for r in records(
            tmp_path / "global.jsonl", event="left", worker=1)
            if r["t"] > resumed[0]["t"]], 60, (server, group))
        assert said[0]["reason"] == "its connection to group 0 was lost", said
        assert said[0]["t"] - resumed[0]["t"] < 10, (said, resumed)
        # the worker still training rejoined and is not said to have left
        assert not [r for r in records(tmp_path / "global.jsonl", event="left", worker=0)
                    if r["t"] > resumed[0]["t"]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
