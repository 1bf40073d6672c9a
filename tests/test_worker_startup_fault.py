"""A worker whose global server dies during the worker's start-up, and comes back with
``--resume`` on the same port, trains to the end and exits 0 (the soak's fifth finding,
issue 55: a restarted worker exited 2, "connection is closed (connection closed by peer)").

Real processes on loopback: a global server (in-process groups, checkpoints), a slow worker 0
that keeps the run going, and worker 1, whose start-up is faulted. Worker 1's calibration
steps are stretched (``--slowdown 20@0,1@0.01``: 0.4 s a step until its first ASSIGN, then
its own speed), so each stage it goes through lasts long enough to be hit from its console
line or its frame trace; no test sleeps. The stages:

- ``welcome``: a new worker, killed after WELCOME (its device line) while it calibrates; the
  server stays down until the worker has calibrated, so its report (link probe, STATS) finds
  no server;
- ``probe``: a new worker in its link probe: the server is stopped (SIGSTOP) at the device
  line, so the probe's PULL, once traced, waits for an answer that never comes; then killed;
- ``assign``: a worker restarted after it had a group: the server sends ASSIGN at once, and
  is killed with that ASSIGN held, before the worker connects to its group (after its
  calibration), then kept down until the worker has calibrated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for

from minips.net import lifeline
from minips.record.checkpoint import load
from minips.run.launch import write_init

TOKEN = "startup-fault-secret"
# ASP, so that worker 1 trains at its own speed beside the slow worker 0; a budget worker 0
# alone spends in about 40 s (10 x 20 ms steps of 64 samples)
RUN = ("--mode", "asp", "--compressor", "none", "--workers", "2", "--epochs", "0.2",
       "--lr", "0.02", "--base-step", "0.02", "--calib-timeout", "1", "--heartbeat", "0.5",
       "--lease", "2", "--checkpoint-every", "0.5", "--quiet")
CALIBRATING = "20@0,1@0.01"  # worker 1's slowdown: 0.4 s calibration steps, then F 1


class Cluster:
    """The processes of one case, each with a log in the run directory; all killed at the end."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN,
                                       "PYTHONUNBUFFERED": "1"})
        self.all: list[subprocess.Popen[bytes]] = []
        self.port = 0

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "minips", *args], env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT)
        self.all.append(proc)
        return proc

    def server(self, *extra: str) -> subprocess.Popen[bytes]:
        """A global server on ``port`` (0 the first time: any free one, remembered)."""
        ready = self.dir / "server.addr"
        ready.unlink(missing_ok=True)
        proc = self.start("server", "server", "--port", str(self.port), "--run-dir",
                          str(self.dir), "--ready-file", str(ready), *RUN, *extra)
        wait_for("server ready", ready.exists, 60, (proc,))
        self.port = int(ready.read_text().split()[1])
        return proc

    def worker(self, i: int, *flags: str, name: str = "") -> subprocess.Popen[bytes]:
        return self.start(name or f"worker{i}", "worker", "--connect", f"127.0.0.1:{self.port}",
                          "--id", str(i), "--run-dir", str(self.dir), "--reconnect", "60",
                          *flags)

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def kill_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


def checkpoint_holds(path: Path, worker: int | None = None) -> bool:
    """A checkpoint with merged samples (and ``worker`` in one of its groups) is written."""
    if not path.exists():
        return False
    state = load(path)
    members = [w for g in state["groups"].values() for w in g["members"]]
    return state["samples"] > 0 and (worker is None or worker in members)


def traced(path: Path, direction: str, kind: str, port: int) -> bool:
    """The frame trace at ``path`` holds a ``kind`` frame sent or received (``direction``) on
    the connection to local ``port`` (the global server's control channel)."""
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("dir") == direction and rec.get("kind") == kind \
                and str(rec.get("peer", "")).endswith(f":{port}"):
            return True
    return False


def steps_after_back(path: Path) -> int:
    """Step records the worker wrote after it had its global server back."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    back = max(i for i, r in enumerate(recs) if r.get("event") == "control_back")
    return sum(1 for r in recs[back:] if "event" not in r and "clock" in r)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["welcome", "probe", "assign"])
def test_a_worker_survives_its_global_server_dying_during_its_start_up(
        tmp_path: Path, stage: str) -> None:
    write_init(tmp_path, "lenet5", 0)
    c = Cluster(tmp_path)
    ckpt = tmp_path / "checkpoint.npz"
    trace = tmp_path / "worker-1.trace.jsonl"
    try:
        server = c.server("--init", str(tmp_path / "init.npy"))
        w0 = c.worker(0, "--slowdown", "10")
        if stage == "assign":  # worker 1 trains, has its place in a checkpoint, is killed
            first = c.worker(1, "--slowdown", "10", name="worker1-first")
            wait_for("a checkpoint with worker 1 in a group", lambda: checkpoint_holds(ckpt, 1),
                     90, (server, w0, first))
            first.kill()
            first.wait()
        else:
            wait_for("a checkpoint", lambda: checkpoint_holds(ckpt), 90, (server, w0))
        w1 = c.worker(1, "--slowdown", CALIBRATING, "--trace", str(trace))
        port = c.port
        if stage == "assign":
            wait_for("worker 1 holds its ASSIGN", lambda: traced(trace, "recv", "ASSIGN", port),
                     60, (server, w1))
        else:
            wait_for("worker 1 has its WELCOME", lambda: "minips worker 1: device" in
                     c.log("worker1"), 60, (server, w1))
        if stage == "probe":
            server.send_signal(signal.SIGSTOP)
            wait_for("worker 1's link probe", lambda: traced(trace, "send", "PULL", port), 60,
                     (w1,))
        else:
            assert "ms/step measured" not in c.log("worker1")  # still calibrating: the case
        server.kill()
        server.wait()
        if stage != "probe":  # down while the worker calibrates and reports
            wait_for("worker 1 calibrated", lambda: "ms/step measured" in c.log("worker1"),
                     60, (w1,))
        server = c.server("--resume")
        assert server.wait(timeout=120) == 0, c.log("server")[-2000:]
        assert w1.wait(timeout=60) == 0, c.log("worker1")[-2000:]
        assert w0.wait(timeout=60) == 0, c.log("worker0")[-2000:]
        console = c.log("worker1")
        assert f"worker 1: the global server at 127.0.0.1:{port} is gone" in console
        assert "worker 1: the global server is back after" in console
        assert steps_after_back(tmp_path / "worker-1.jsonl") > 0  # it trained after
    finally:
        c.kill_all()
