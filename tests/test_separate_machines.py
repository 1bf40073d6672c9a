"""Separate machines, end to end: the global server, two `minips group` processes and two
workers, each in a network namespace of its own with its own address, started from the
`group:` and `join:` lines the server prints (verbatim; only GROUP_CERT / GROUP_KEY, which the
line names, are filled in), with a token and with TLS. The run groups the workers by their
measured speed, the server's /metrics (scraped from another machine) counts them and their
groups' merges while they train, the server is killed (-9) and resumed with `--resume` in its run
directory, every role ends with status 0 and the server's summary.json describes the run.

The namespaces are wired like machines on one switch: a veth pair each, from the machine to a
bridge in a namespace of its own (whose filters are empty, whatever the host's firewall does
to bridged traffic). Creating namespaces needs root (CAP_NET_ADMIN) and iproute2; without them
the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import make_certificate, records, steps, wait_for

from minips.ml import data, models
from minips.net import lifeline
from minips.record.checkpoint import load

TOKEN = "machines-secret-0123456789abcdef"
DASHBOARD_TOKEN = "machines-dashboard-0123456789abc"  # the dashboard's own, not the cluster's
PREFIX = "mpm"  # namespaces mpm<pid><letter>: a run's own, and stale ones are found by pid
SUBNET = "10.214.0"  # private to the switch namespace: runs side by side do not collide
ROLES = {"server": "s", "group-0": "g", "group-1": "h", "worker-a": "a", "worker-b": "b"}
# /metrics series asserted on, by name (one constant each, to follow a rename): the live
# workers by group, the group deltas merged by group, the pushes by group (the servers count
# them from the groups' exchanges, wherever the workers run) and each worker's PULLs
# answered, labelled {worker, group}
WORKERS_METRIC = "minips_workers_alive"
MERGES_METRIC = "minips_merges_total"
PUSHES_METRIC = "minips_pushes_total"
PULLS_METRIC = "minips_worker_pulls_total"
DASHBOARD_PORT = 8080
SLOW = 4.0  # worker B's --slowdown: its steps take at least 4 x the base step, A's 1 x
# two groups of one worker each: the faster worker in group 0, the slower in group 1
SERVER = ("--host", "0.0.0.0", "--workers", "2", "--mode", "gssp", "--groups", "2",
          "--external-groups", "2", "--compressor", "none", "--lr", "0.02",
          "--batch-size", "64", "--epochs", "0.5", "--base-step", "0.03",
          "--checkpoint-every", "1", "--calib-timeout", "60",
          "--dashboard", f"0.0.0.0:{DASHBOARD_PORT}")
EVAL_SAMPLES = 2000  # test samples for the final accuracy: enough to tell 50% from chance


# -- machines: network namespaces on one switch ----------------------------------------------------

def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass
class Machine:
    """A network namespace ``name`` at ``address``, its files in ``home`` (its cwd)."""

    name: str
    address: str
    home: Path

    def run(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]


def remove_stale_namespaces() -> None:
    """Namespaces of earlier runs whose process is gone (killed before its cleanup)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)[a-z]", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def wire(switch: str, machine: Machine, port: str) -> None:
    """A veth pair from ``machine`` (eth0, its address, its default route: a machine on a
    LAN has one, and the server's join: line names the address it leaves from) to the bridge
    in ``switch``."""
    ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
       machine.name)
    ip("-n", switch, "link", "set", port, "master", "br0", "up")
    for args in (("addr", "add", f"{machine.address}/24", "dev", "eth0"),
                 ("link", "set", "eth0", "up"), ("link", "set", "lo", "up"),
                 ("route", "add", "default", "dev", "eth0")):
        ip("-n", machine.name, *args)


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[dict[str, Machine]]:
    """One Machine per role of ROLES, all on one switch; every namespace removed at the end."""
    base = f"{PREFIX}{os.getpid()}"
    made: list[str] = []
    try:
        remove_stale_namespaces()
        ip("netns", "add", f"{base}x")
    except FileNotFoundError:
        pytest.skip("needs iproute2's ip to create network namespaces")
    except (subprocess.CalledProcessError, PermissionError) as e:
        pytest.skip(f"cannot create a network namespace here: {getattr(e, 'stderr', e)}")
    made.append(f"{base}x")
    try:
        try:
            found = {role: Machine(f"{base}{letter}", f"{SUBNET}.{i + 2}", tmp_path / role)
                     for i, (role, letter) in enumerate(ROLES.items())}
            ip("-n", f"{base}x", "link", "add", "br0", "type", "bridge")
            ip("-n", f"{base}x", "link", "set", "br0", "up")
            for letter, machine in zip(ROLES.values(), found.values(), strict=True):
                ip("netns", "add", machine.name)
                made.append(machine.name)
                machine.home.mkdir()
                wire(f"{base}x", machine, f"p{letter}")
        except subprocess.CalledProcessError as e:  # no bridge or veth support in this kernel
            pytest.skip(f"cannot wire network namespaces here: {e.stderr}")
        yield found
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


# -- the roles' processes ------------------------------------------------------------------------

class Roles:
    """The processes of one test, each on its machine, its output in logs/<name>.log; every one
    of them is killed at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        logs.mkdir()
        self.env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN,
                                       "MINIPS_DASHBOARD_TOKEN": DASHBOARD_TOKEN,
                                       "PYTHONUNBUFFERED": "1"})
        self.all: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, machine: Machine, argv: list[str]) -> subprocess.Popen[bytes]:
        """``argv`` ('minips ...' as a user types it) run with this Python on ``machine``."""
        assert argv[0] == "minips", argv
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(machine.run(sys.executable, "-m", *argv), env=self.env,
                                    cwd=machine.home, stdout=log, stderr=subprocess.STDOUT)
        self.all.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture
def roles(tmp_path: Path) -> Iterator[Roles]:
    rs = Roles(tmp_path / "logs")
    try:
        yield rs
    finally:
        rs.kill_all()


def printed(roles: Roles, name: str, prefix: str, server: subprocess.Popen[bytes]) -> list[str]:
    """The lines of ``name``'s log that start with ``prefix``, once there are some."""
    return wait_for(f"'{prefix}' lines from {name}", lambda: [
        ln for ln in roles.log(name).splitlines() if ln.startswith(prefix)], 60, (server,))


def scrape(machine: Machine, url: str) -> dict[str, float]:
    """``url`` (the server's /metrics) fetched from ``machine``: {'name{labels}': value}."""
    fetch = ("import sys, urllib.request; r = urllib.request.Request(sys.argv[1], headers="
             "{'Authorization': 'Bearer ' + sys.argv[2]}); "
             "sys.stdout.write(urllib.request.urlopen(r, timeout=10).read().decode())")
    got = subprocess.run(machine.run(sys.executable, "-c", fetch, url, DASHBOARD_TOKEN),
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    return {name: float(value) for name, value in
            (ln.rsplit(" ", 1) for ln in got.stdout.splitlines() if ln and ln[0] != "#")}


def total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def merged_samples(run_dir: Path) -> int:
    merges = records(run_dir / "global.jsonl", event="merge")
    return int(merges[-1]["samples"]) if merges else 0


def final_accuracy(run_dir: Path) -> float:
    test = data.load_dataset("fashion-mnist", "test", fallback=False)  # real data, or fail
    acc, _ = models.evaluate("lenet5", np.load(run_dir / "final_weights.npy"),
                             test.subset(np.arange(EVAL_SAMPLES)))
    return float(acc)


# -- the test ------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("tls", [False, True], ids=["token", "tls"])
def test_roles_on_separate_machines_from_the_printed_lines_group_by_speed_and_resume(
        machines: dict[str, Machine], roles: Roles, tmp_path: Path, tls: bool) -> None:
    """The server's `group:` lines run on two machines and its `join:` line on two more (worker
    B with --slowdown 4 added): they train in two groups by speed (A in group 0), /metrics
    counts both workers and both groups' merges, the server killed -9 and restarted with --resume
    gets its groups back, and all five end with status 0 after the budget is spent."""
    srv = machines["server"]
    run_dir = srv.home / "run"
    tls_flags: tuple[str, ...] = ()
    cert = Path()
    if tls:  # one self-signed certificate for the server's and the group machines' addresses
        cert, key = make_certificate(tmp_path, *(f"IP:{machines[r].address}" for r in
                                                 ("server", "group-0", "group-1")))
        tls_flags = ("--tls-cert", str(cert), "--tls-key", str(key))
    server_argv = ["minips", "server", *SERVER, "--run-dir", str(run_dir), *tls_flags]
    server = roles.start("server", srv, server_argv)

    # the printed lines: one address (the machine's own), the CA with TLS
    (group_line,) = printed(roles, "server", "group: ", server)
    (join_line,) = printed(roles, "server", "join: ", server)
    assert f"--connect {srv.address}:7070" in join_line
    assert (f"--tls-ca {cert}" in join_line) == tls and (f"--tls-ca {cert}" in group_line) == tls
    group_argv = shlex.split(group_line.removeprefix("group: "))
    if tls:
        assert "GROUP_CERT" in group_argv and "GROUP_KEY" in group_argv
        group_argv = [{"GROUP_CERT": str(cert), "GROUP_KEY": str(key)}.get(a, a)
                      for a in group_argv]
    groups = [roles.start(f"group-{g}", machines[f"group-{g}"], group_argv) for g in (0, 1)]
    join_argv = shlex.split(join_line.removeprefix("join: "))
    worker_a = roles.start("worker-a", machines["worker-a"], join_argv)
    wait_for("worker A joins first", lambda: "worker 0 joined" in roles.log("server"), 60,
             (server, worker_a))
    worker_b = roles.start("worker-b", machines["worker-b"], [*join_argv, "--slowdown",
                                                              str(SLOW)])
    workers = [worker_a, worker_b]
    everyone = (server, *groups, *workers)

    # grouped by speed: the faster worker (A, id 0) in group 0, each at its own group machine
    line = wait_for("the groups", lambda: re.search(
        r"2 group\(s\) by speed: 0 = worker 0 \((\d+) ms/iteration[^)]*\), "
        r"1 = worker 1 \((\d+) ms/iteration[^)]*\)",
        roles.log("server")), 90, everyone)
    fast, slow = int(line[1]), int(line[2])
    # B is SLOW x A's base step; on a loaded machine (a full suite) the CPU, not the emulation,
    # can set A's step (68 ms compute, 110 ms iteration against B's 120 / 136 once): the order
    # is what the grouping keeps
    assert slow > fast, line[0]
    formed = records(run_dir / "global.jsonl", event="groups")[0]
    assert formed["assignment"] == {"0": 0, "1": 1}
    assert {a.split(":")[0] for a in formed["addresses"].values()} == {
        machines["group-0"].address, machines["group-1"].address}
    speeds = [re.search(r"(\d+) ms/step measured", roles.log(w)) for w in ("worker-a",
                                                                            "worker-b")]
    assert all(speeds) and int(speeds[1][1]) > int(speeds[0][1])  # type: ignore[index]

    # /metrics, from a group machine: both workers alive, both groups merging
    (url,) = re.findall(r"Prometheus: (\S+/metrics)", roles.log("server"))
    assert url == f"http://{srv.address}:{DASHBOARD_PORT}/metrics"

    def counted() -> bool:
        m = scrape(machines["group-0"], url)
        merges = [m.get(f'{MERGES_METRIC}{{group="{g}"}}', 0) for g in (0, 1)]
        pulls = [sum(v for k, v in m.items() if k.startswith(PULLS_METRIC + "{")
                     and f'worker="{w}"' in k) for w in (0, 1)]
        return (total(m, WORKERS_METRIC) == 2 and min(merges) > 0
                and total(m, PUSHES_METRIC) > 0 and min(pulls) > 0)

    wait_for("/metrics counts both workers and their groups' merges", counted, 60, everyone)

    # kill -9 the server after a checkpoint, resume it on its machine, in its run directory
    ckpt = run_dir / "checkpoint.npz"
    wait_for("a checkpoint of some training", lambda: ckpt.exists() and
             load(ckpt)["samples"] >= 5000, 90, everyone)
    server.send_signal(signal.SIGKILL)
    server.wait(timeout=30)
    saved = int(load(ckpt)["samples"])
    server = roles.start("server-resumed", srv, [*server_argv, "--resume"])
    everyone = (server, *groups, *workers)
    wait_for("both group processes back", lambda: sum(
        bool(records(path, event="global_back")) for g in (0, 1)
        for path in (machines[f"group-{g}"].home / "runs" / "group").glob("group-*.jsonl")) == 2,
        90, everyone)
    wait_for("training goes on after the resume", lambda: merged_samples(run_dir) > saved + 2000,
             90, everyone)

    for name, p in (("worker-a", worker_a), ("worker-b", worker_b), ("group-0", groups[0]),
                    ("group-1", groups[1]), ("server-resumed", server)):
        assert p.wait(timeout=150) == 0, roles.log(name)[-3000:]
    assert records(run_dir / "global.jsonl", event="resumed")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["mode"], summary["workers"], summary["groups"]) == ("gssp", 2, 2)
    assert summary["samples"] >= 0.5 * 60_000  # as of the last merge: the budget was spent
    assert summary["final_accuracy"] is None  # no evaluator (--eval): measured here instead
    assert final_accuracy(run_dir) >= 0.5
    # what the servers saw of the remote workers: steps, per worker by group, bytes, their data
    assert summary["steps"] > 0 and summary["bytes_group_global"] > 0
    assert summary["bytes_worker_group"] > 0 and summary["bytes_group_worker"] > 0
    seen = summary["per_worker"]
    assert {w: (v["group"], v["steps"] > 0) for w, v in seen.items()} == {
        "0": (0, True), "1": (1, True)}, seen
    assert summary["data"] == "real", summary["data_sources"]
    assert {r: v.get("reported") for r, v in summary["data_sources"].items()} == {
        "worker-0": True, "worker-1": True}
    assert "group lost" not in roles.log("server-resumed")  # the groups' normal end is no loss
    for w, home in ((0, machines["worker-a"].home), (1, machines["worker-b"].home)):
        assert steps(home / "runs" / "worker" / f"worker-{w}.jsonl")
