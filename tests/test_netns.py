"""Several machines, simulated: processes in a network namespace of their own (with their own
127.0.0.1), joined to the test's namespace by a veth pair, work with a `minips server --host
0.0.0.0` here, as the README's several-machines commands run on real machines.

Creating a namespace needs root (CAP_NET_ADMIN) and iproute2; without them these tests are
skipped, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import make_certificate, minips_server, records, run_t0, steps, wait_for

TOKEN = "netns-secret-0123456789"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plain_client.py"
SERVER = ("--host", "0.0.0.0", "--mode", "ssp", "--lr", "0.02", "--compressor", "none",
          "--base-step", "0.02", "--calib-timeout", "30", "--weight-decay", "0")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class Namespace:
    """A network namespace ``name`` at ``inside`` (10.213.x.2); this namespace is ``outside``."""

    def __init__(self, name: str, subnet: int) -> None:
        self.name = name
        self.outside, self.inside = f"10.213.{subnet}.1", f"10.213.{subnet}.2"

    def run(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]


@pytest.fixture
def netns() -> Iterator[Namespace]:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip to create a network namespace")
    ns = Namespace(f"mps{os.getpid() % 100000}", os.getpid() % 250)
    try:
        ip("netns", "add", ns.name)
    except (subprocess.CalledProcessError, PermissionError) as e:
        pytest.skip(f"cannot create a network namespace here: {getattr(e, 'stderr', e)}")
    try:
        ip("link", "add", f"{ns.name}o", "type", "veth", "peer", "name", f"{ns.name}i")
        ip("link", "set", f"{ns.name}i", "netns", ns.name)
        ip("addr", "add", f"{ns.outside}/24", "dev", f"{ns.name}o")
        ip("link", "set", f"{ns.name}o", "up")
        for args in (("addr", "add", f"{ns.inside}/24", "dev", f"{ns.name}i"),
                     ("link", "set", f"{ns.name}i", "up"), ("link", "set", "lo", "up")):
            ip("netns", "exec", ns.name, "ip", *args)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", f"{ns.name}o"], capture_output=True, timeout=10)


def test_workers_on_two_machines_train_through_a_server_on_every_interface(
        netns: Namespace, tmp_path: Path) -> None:
    """One worker in the namespace dials the server's veth address, one here dials 127.0.0.1
    (no --init: both are told need_init); both are sent to group servers they can reach, train
    to the end of the budget and exit 0. (Before group servers followed the server's address,
    the one in the namespace was sent to 127.0.0.1: its own machine.)"""
    with minips_server(tmp_path, TOKEN, *SERVER, "--workers", "2",
                       "--epochs", "0.2") as (proc, _, port), \
            two_workers(netns, port, tmp_path) as workers:
        all_exit_0(workers, proc)
    for w in (0, 1):
        assert steps(tmp_path / f"worker-{w}.jsonl")
    merges = records(tmp_path / "global.jsonl", event="merge")
    assert merges and merges[-1]["samples"] >= 0.2 * 60_000
    weights = np.load(tmp_path / "final_weights.npy")
    assert weights.shape == (61_706,) and np.isfinite(weights).all()


@contextlib.contextmanager
def two_workers(netns: Namespace, port: str,
                run_dir: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Worker 0 in the namespace, dialling the server's veth address, and worker 1 here,
    dialling 127.0.0.1; those still running at the end are killed."""
    env = {**os.environ, "MINIPS_TOKEN": TOKEN}

    def worker(i: int, address: str) -> list[str]:
        return [sys.executable, "-m", "minips", "worker", "--connect", f"{address}:{port}",
                "--id", str(i), "--run-dir", str(run_dir)]

    workers = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
               for cmd in (netns.run(*worker(0, netns.outside)), worker(1, "127.0.0.1"))]
    try:
        yield workers
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.communicate(timeout=30)


def all_exit_0(clients: list[subprocess.Popen[str]], server: subprocess.Popen[str]) -> None:
    """The clients (workers, group processes), then the server, end the run with status 0."""
    for c in clients:
        out, _ = c.communicate(timeout=150)
        assert c.returncode == 0, out[-2000:]
    assert server.wait(timeout=60) == 0


def test_a_partitioned_worker_is_expired_the_others_go_on_and_it_rejoins_when_healed(
        netns: Namespace, tmp_path: Path) -> None:
    """The veth link goes down (no FIN, no RST: a real partition) under a 2 s lease: the group
    server expires the worker in the namespace and the one here trains on; the partitioned
    worker, hearing nothing from its group server, drops the connection. Once the link is back
    (after the other worker's 20 more steps) it reconnects and trains to the end of the
    budget."""
    lease = 2.0
    with minips_server(tmp_path, TOKEN, *SERVER, "--workers", "2", "--wall-s", "20",
                       "--lease", str(lease), "--heartbeat", "0.5") as (proc, _, port), \
            two_workers(netns, port, tmp_path) as workers:
        wait_for("worker 0 trains", lambda: len(steps(tmp_path / "worker-0.jsonl")) >= 20,
                 60, (proc, *workers))
        ip("link", "set", f"{netns.name}o", "down")
        down_at = time.time()
        try:
            expired = wait_for("the group expires worker 0", lambda: records(
                tmp_path / "group-0.jsonl", event="expired"), 20, (proc,))[0]
            lost = wait_for("worker 0 leaves its silent group server", lambda: records(
                tmp_path / "worker-0.jsonl", event="group_lost"), 20, (proc,))[0]
            during = len(steps(tmp_path / "worker-1.jsonl"))
            wait_for("worker 1 trains on alone", lambda: len(
                steps(tmp_path / "worker-1.jsonl")) >= during + 20, 20, (proc,))
            partitioned = len(steps(tmp_path / "worker-0.jsonl"))
        finally:
            ip("link", "set", f"{netns.name}o", "up")
        up_at = time.time()
        all_exit_0(workers, proc)
    t0 = run_t0(tmp_path)
    assert expired["workers"] == [0] and expired["t"] + t0 - down_at < lease + 2.5
    assert "sent nothing" in lost["reason"] and lost["t"] + t0 - down_at < lease + 2.5
    assert [r for r in steps(tmp_path / "worker-0.jsonl")[partitioned:] if r["t"] + t0 > up_at]


def test_the_plain_client_steps_from_another_machine(netns: Namespace, tmp_path: Path) -> None:
    """examples/plain_client.py --worker in the namespace: the global server, then the group
    server ASSIGN names, both reached across the veth pair."""
    np.save(tmp_path / "init.npy", np.zeros(61_706, np.float32))
    with minips_server(tmp_path, TOKEN, *SERVER, "--workers", "1",
                       "--init", str(tmp_path / "init.npy")) as (_, _, port):
        done = subprocess.run(netns.run(sys.executable, str(EXAMPLE), netns.outside, port,
                                        "--worker", "--k", "30"),
                              env={**os.environ, "MINIPS_TOKEN": TOKEN}, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout)
    assert step["moved"] == 30 and step["moved_only_where_pushed"]


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_group_server_on_another_machine_serves_workers_here(netns: Namespace, tmp_path: Path,
                                                              tls: bool) -> None:
    """`minips group --listen 0.0.0.0:0` in the namespace registers with the server here; the
    workers here are sent to it at its veth address (what the server sees it connect from),
    train to the end of the budget and exit 0. With TLS every link is verified against one
    self-signed certificate for the three addresses."""
    np.save(tmp_path / "init.npy", np.zeros(61_706, np.float32))
    env = {**os.environ, "MINIPS_TOKEN": TOKEN}
    serve_tls: tuple[str, ...] = ()
    client_tls: tuple[str, ...] = ()
    if tls:
        cert, key = map(str, make_certificate(tmp_path, "IP:127.0.0.1", f"IP:{netns.outside}",
                                              f"IP:{netns.inside}"))
        serve_tls, client_tls = ("--tls-cert", cert, "--tls-key", key), ("--tls-ca", cert)
    with minips_server(tmp_path, TOKEN, *SERVER, "--workers", "2", "--epochs", "0.2",
                       "--external-groups", "1", "--groups", "1",
                       "--init", str(tmp_path / "init.npy"), *serve_tls) as (proc, _, port):
        group = subprocess.Popen(netns.run(sys.executable, "-m", "minips", "group", "--connect",
                                           f"{netns.outside}:{port}", "--listen", "0.0.0.0:0",
                                           "--run-dir", str(tmp_path), *serve_tls, *client_tls),
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        workers = [subprocess.Popen([sys.executable, "-m", "minips", "worker", "--connect",
                                     f"127.0.0.1:{port}", "--id", str(i), "--run-dir",
                                     str(tmp_path), *client_tls],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for i in range(2)]
        try:
            all_exit_0([*workers, group], proc)
        finally:
            for p in (*workers, group):
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=30)
    groups = records(tmp_path / "global.jsonl", event="groups")
    assert groups[0]["addresses"]["0"].startswith(f"{netns.inside}:")
    for w in (0, 1):
        assert steps(tmp_path / f"worker-{w}.jsonl")


@pytest.mark.timeout(60)
def test_a_server_on_a_machine_without_a_default_route_prints_its_interface_address(
        netns: Namespace, tmp_path: Path) -> None:
    """A machine on a LAN with no default route (the namespace: an address on its veth, no
    route out) and whose host name resolves to nothing else: the server's join: line names the
    interface's address, which the other machines reach, not 127.0.0.1."""
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(netns.run(
            sys.executable, "-m", "minips", "server", "--host", "0.0.0.0", "--workers", "1",
            "--epochs", "0.1", "--run-dir", str(tmp_path / "run")),
            env={**os.environ, "MINIPS_TOKEN": TOKEN}, stdout=out, stderr=subprocess.STDOUT)
    try:
        joins = wait_for("the join: line", lambda: [
            ln for ln in log.read_text(errors="replace").splitlines()
            if ln.startswith("join: ")], 30, (proc,))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert f"--connect {netns.inside}:7070" in joins[0], joins
