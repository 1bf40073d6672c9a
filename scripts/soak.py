"""A seeded soak: a real minips cluster under overlapping faults for a while, then the checker.

The cluster is what a lab of edge boards runs: a global server (TLS, a token, checkpoints on a
small tmpfs when root), GSSP with 2 groups, 8 workers of mixed speeds (``--slowdown``), the exact
downlink (``--down-mode exact``), a compressor (topk or gdtopk, by seed) and an evaluator. The
groups are `minips group` processes on even seeds and in-process groups on odd ones:
``--external-groups`` is all-or-nothing (server.py builds every group the same way), so one run
cannot mix them and the seeds alternate. When root and ``ip netns`` works, every worker, each
group process and the server sit in network namespaces of their own on one bridge, each worker's
link a tbf whose rate the nemesis changes; otherwise everything is on loopback without shaping
(said on stdout and in the history).

Each seed runs twice on one ``--epochs`` budget with a cosine learning rate (to 0 at the end,
so two runs' final weights compare without the last steps' noise): first the unfaulted twin,
then the faulted run. ``--minutes`` sets the budget from this machine's rate unfaulted
(RATE_SAMPLES_S: 8 workers on 2 cores); the faulted run takes longer. The **nemesis**, seeded,
injects a fault every ``--every`` seconds (jittered) until 85% of the budget is spent, then
heals everything and lets the run end:

    kill_worker / stop_worker, kill_group / stop_group, kill_global / stop_global,
    kill_eval / stop_eval      kill -9 then a restart (the global server with --resume on its
                               port, a group process as a replacement that adopts the group),
                               or SIGSTOP then SIGCONT
    link_cut / link_rate       a worker's veth down for a while / its tbf rate changed for a
                               spell of 10-60 s (netns)
    partition                  a group machine cut from the server machine (netns, blackhole routes)
    garbage / flood            random bytes on fresh connections / an authenticated client
                               writing HEARTBEAT frames as fast as TCP takes them
    disk_full                  the checkpoint tmpfs filled for a while (root)

Faults overlap, within what docs/operations.md promises to survive: at most half the workers
down at once, one group process, one fault of the global server and one of the evaluator at a
time, the global server killed only once a checkpoint exists.

Every process started runs in its own session (killed by process group at exit), every mount is
unmounted and every namespace deleted at exit, also on Ctrl-C. The run's history (JSON lines:
each fault injected and healed, each process started and ended, with times) is
RUN/soak/history.jsonl; the global server's RSS and open descriptors are sampled into
RUN/soak/resources.jsonl. At the end scripts/soak_check.py reads the run and prints its verdict.

Usage: python scripts/soak.py [--minutes 3] [--seeds 1] [--seed 0] [--every 4]
                              [--out runs/soak] [--baseline RUN_DIR] [--net auto|netns|loopback]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import soak_check  # noqa: E402

__all__ = ["Cluster", "Nemesis", "Plan", "main", "run_seed"]

TOKEN = "soak-secret-0123456789abcdef"
TRAIN_SIZE = 60_000  # fashion-mnist's training set (no --val-size): samples per epoch
RATE_SAMPLES_S = 3300  # the unfaulted cluster's rate on a 2-core machine (measured: 150 k / 45 s)
SLOWDOWNS = (1, 1, 1, 1, 3, 3, 4, 4)  # 8 workers of mixed speeds in two clear tiers: with
# (1, 1, 1, 1, 2, 2, 4, 4) the log iteration times (~0.07, 0.12, 0.22 s) have two gaps of one
# size, and the grouping split 6+2 or 4+4 by the machine's load: twins of one seed then ended
# 2-3 accuracy points apart at the short soak's budget
RATES_MBIT = (2, 5, 10, 50, 100)  # tbf rates the nemesis picks from (netns); the last: the run's
# a rate change lasts this long, then the link is back at the run's rate: a spell, as a busy
# Wi-Fi has (a change for good left 6 of 8 links at 2-10 mbit within 10 minutes and the
# faulted run of a 30-minute budget 6x slower than its twin: no longer a soak of faults)
RATE_SPELL_S = (10.0, 60.0)
SUBNET = "10.55.0"
LEASE_S, HEARTBEAT_S = 4.0, 1.0  # short, so a soak of minutes sees each detection many times
CHECKPOINT_EVERY_S = 2.0
TMPFS_BYTES = 16 << 20  # the checkpoint tmpfs: room for a few LeNet-5 checkpoints
WEIGHTS = {"kill_global": 1, "stop_global": 1}  # relative odds of a kind (others 2): each
# resume costs the whole cluster seconds, so the global server is hit half as often
# a --skip name: no SIGSTOP or partition of a group process before the grouping (one dropped
# then exits 2: tests/test_soak_findings.py)
EARLY_GROUP = "early_group_stop"
PROGRESS_STOP = 0.85  # no new fault past this share of the budget: the run ends healed
END_WAIT_S = 180.0  # after the global server ended: the others must end by then


def now() -> float:
    return time.time()


class History:
    """RUN/soak/history.jsonl: one JSON object a line, each with ``t`` (unix seconds)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def write(self, op: str, **fields: Any) -> None:
        self.f.write(json.dumps({"t": now(), "op": op, **fields}) + "\n")

    def close(self) -> None:
        self.f.close()


# -- the machines: network namespaces on one bridge, or loopback ---------------------------------

@dataclass
class Net:
    """Where each role runs: ``ns[role]`` a namespace (netns mode) and ``addr[role]`` its IP;
    the bridge's port of each worker is ``port[role]`` (for cuts and shaping)."""

    mode: str  # netns | loopback
    prefix: str = ""
    ns: dict[str, str] = field(default_factory=dict)
    addr: dict[str, str] = field(default_factory=dict)
    port: dict[str, str] = field(default_factory=dict)

    def host(self, role: str) -> str:
        return self.addr.get(role, "127.0.0.1")

    def wrap(self, role: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[role], *argv] if role in self.ns else argv


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def tc(*args: str) -> bool:
    return subprocess.run(["tc", *args], capture_output=True, timeout=10).returncode == 0


def machines(groups: int, workers: int) -> list[str]:
    return ["server", *(f"group{g}" for g in range(groups)), *(f"w{i}" for i in range(workers)),
            "hostile"]


def make_net(wanted: str, groups: int, workers: int) -> tuple[Net, str]:
    """The namespaces (and why not, when not): netns when root and ``ip netns`` works."""
    if wanted == "loopback":
        return Net("loopback"), "loopback asked for"
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return Net("loopback"), "not root or no iproute2: loopback, no shaping"
    net = Net("netns", prefix=f"soak{os.getpid()}")
    try:
        ip("netns", "add", f"{net.prefix}x")
        net.ns["_switch"] = f"{net.prefix}x"
        ip("-n", f"{net.prefix}x", "link", "add", "br0", "type", "bridge")
        ip("-n", f"{net.prefix}x", "link", "set", "br0", "up")
        for k, role in enumerate(machines(groups, workers)):
            wire(net, role, k)
    except (subprocess.CalledProcessError, OSError) as exc:
        remove_net(net)
        why = getattr(exc, "stderr", "") or str(exc)
        return Net("loopback"), f"network namespaces failed ({why.strip()}): loopback, no shaping"
    return net, "network namespaces, tbf links"


def wire(net: Net, role: str, k: int) -> None:
    """Namespace ``role`` with eth0 at SUBNET.(k+1) on the bridge through port p<k>."""
    name, port = f"{net.prefix}{k}", f"p{k}"
    ip("netns", "add", name)
    net.ns[role], net.addr[role], net.port[role] = name, f"{SUBNET}.{k + 1}", port
    sw = net.ns["_switch"]
    ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
    ip("-n", sw, "link", "set", port, "master", "br0", "up")
    for args in (("addr", "add", f"{net.addr[role]}/24", "dev", "eth0"),
                 ("link", "set", "eth0", "up"), ("link", "set", "lo", "up")):
        ip("-n", name, *args)


def shape(net: Net, role: str, mbit: float) -> bool:
    """tbf at ``mbit`` both ways on ``role``'s link (its eth0 up, the bridge port down)."""
    ok = True
    for ns, dev in ((net.ns[role], "eth0"), (net.ns["_switch"], net.port[role])):
        ok &= tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                 f"{mbit}mbit", "burst", "64kb", "latency", "500ms")
    return ok


def remove_net(net: Net) -> None:
    for name in net.ns.values():
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


# -- certificates ---------------------------------------------------------------------------------

def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path, net: Net) -> None:
    """ca.pem, and server.pem / group.pem signed by it for every address they may be dialled
    at (docs/operations.md's recipe)."""
    d.mkdir(parents=True, exist_ok=True)
    if (d / "group.pem").exists():
        return
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=minips soak ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    sans = ",".join(f"IP:{a}" for a in ["127.0.0.1", *(f"{SUBNET}.{k}" for k in range(1, 16))])
    for name in ("server", "group"):
        (d / f"{name}.ext").write_text(f"subjectAltName={sans}\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
                f"{name}.key", "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out",
                f"{name}.pem", cwd=d)


# -- the plan of one run --------------------------------------------------------------------------

@dataclass
class Plan:
    """One run of one seed: its flags, where it runs, and whether the nemesis acts."""

    seed: int
    run_dir: Path
    certs: Path
    external: bool  # `minips group` processes (even seeds) or in-process groups
    epochs: float  # the budget, twin and soak alike
    faults: bool
    every_s: float = 4.0
    skip: tuple[str, ...] = ()  # fault kinds the nemesis leaves out
    groups: int = 2
    workers: int = len(SLOWDOWNS)
    base_step_s: float = 0.05

    @property
    def compressor(self) -> str:
        return "gdtopk" if self.seed % 4 in (2, 3) else "topk"

    def server_flags(self) -> list[str]:
        ext = ["--external-groups", str(self.groups)] if self.external else []
        return ["--mode", "gssp", "--groups", str(self.groups), "--workers", str(self.workers),
                "--compressor", self.compressor, "--ratio", "0.05", "--down-mode", "exact",
                "--lr", "0.05", "--base-step", str(self.base_step_s), "--seed", str(self.seed),
                "--lease", str(LEASE_S), "--heartbeat", str(HEARTBEAT_S),
                "--eval-every", "3", "--eval-limit", "1000", "--calib-timeout", "90",
                "--rejoin-wait", "120", "--checkpoint-every", str(CHECKPOINT_EVERY_S),
                "--epochs", f"{self.epochs:.6f}", "--lr-schedule", "cosine", *ext]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the processes ----------------------------------------------------------------------------

@dataclass
class Role:
    """One role's process (restarted as the same role): its argv, its current Popen."""

    name: str  # server, group0, w3, eval
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    stopped: bool = False  # SIGSTOPped by the nemesis now
    killed: bool = False  # killed by the nemesis and not restarted yet
    done: bool = False  # ended by itself (its exit recorded)


class Cluster:
    """The run's processes, each in a session of its own, every one ended by ``close``."""

    def __init__(self, plan: Plan, net: Net, history: History) -> None:
        self.plan, self.net, self.history = plan, net, history
        self.roles: dict[str, Role] = {}
        self.ended: list[subprocess.Popen[bytes]] = []
        self.mounted: Path | None = None
        self.port = free_port()
        from minips.net import lifeline

        # each role dies with this process even when it is killed (PR_SET_PDEATHSIG)
        self.env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": TOKEN,
                                       "PYTHONUNBUFFERED": "1",
                                       "SOAK_TAG": f"soak-{os.getpid()}-{plan.seed}"})
        (plan.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"{self.net.host('server')}:{self.port}"

    @property
    def checkpoint(self) -> Path:
        return self.plan.run_dir / "ckpt" / "checkpoint.npz"

    def mount_checkpoint_fs(self) -> str:
        """A tmpfs of TMPFS_BYTES for the checkpoint when root (a disk that can fill)."""
        d = self.checkpoint.parent
        d.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            return "not root: the checkpoint on the run's disk, no disk_full faults"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs",
                               str(d)], capture_output=True, text=True, timeout=10)
        if done.returncode:
            return f"no tmpfs ({done.stderr.strip()}): no disk_full faults"
        self.mounted = d
        return f"checkpoint on a {TMPFS_BYTES >> 20} MB tmpfs"

    def start(self, name: str) -> Role:
        role = self.roles[name]
        log = open(self.plan.run_dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115
        role.proc = subprocess.Popen(self.net.wrap(self.machine(name), role.argv), env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        role.starts += 1
        role.killed = role.stopped = False
        self.history.write("start", role=name, pid=role.proc.pid, n=role.starts)
        return role

    def machine(self, name: str) -> str:
        return "server" if name == "eval" else name


    def add(self, name: str, *args: str) -> Role:
        self.roles[name] = Role(name, [sys.executable, "-m", "minips", *args])
        return self.roles[name]

    def tls_server(self, name: str) -> list[str]:
        d = self.plan.certs
        return ["--tls-cert", str(d / f"{name}.pem"), "--tls-key", str(d / f"{name}.key")]

    def define(self) -> None:
        p, d, ca = self.plan, str(self.plan.run_dir), str(self.plan.certs / "ca.pem")
        self.add("server", "server", "--host", self.net.host("server"), "--port",
                 str(self.port), "--run-dir", d, "--ready-file", f"{d}/server.addr", "--quiet",
                 "--checkpoint", str(self.checkpoint), *self.tls_server("server"),
                 *p.server_flags())
        clients = ["--connect", self.address, "--run-dir", d, "--reconnect", "150",
                   "--tls-ca", ca]
        for g in range(p.groups if p.external else 0):
            self.add(f"group{g}", "group", *clients, "--listen", f"{self.net.host(f'group{g}')}:0",
                     *self.tls_server("group"))
        for i, f in enumerate(SLOWDOWNS[:p.workers]):
            self.add(f"w{i}", "worker", *clients, "--id", str(i), "--slowdown", str(f),
                     "--timeout", "120")
        self.add("eval", "evaluator", *clients, "--timeout", "120")

    def launch(self) -> None:
        """The server (fresh, from init.npy) until ready, then every other role."""
        self.define()
        server = self.roles["server"]
        server.argv += ["--init", str(self.plan.run_dir / "init.npy")]
        self.start("server")
        server.argv = server.argv[:-2]
        self.wait_ready()
        for name in self.roles:
            if name != "server":
                self.start(name)

    def wait_ready(self, timeout: float = 90.0) -> None:
        ready = self.plan.run_dir / "server.addr"
        deadline = now() + timeout
        while not ready.exists():
            proc = self.roles["server"].proc
            if proc is None or proc.poll() is not None or now() > deadline:
                raise RuntimeError(f"the global server did not get ready (exit "
                                   f"{proc.poll() if proc else None}); see logs/server.log")
            time.sleep(0.1)

    def restart_server(self) -> None:
        (self.plan.run_dir / "server.addr").unlink(missing_ok=True)
        role = self.roles["server"]
        if "--resume" not in role.argv:
            role.argv.append("--resume")
        self.start("server")

    def signal(self, name: str, sig: int) -> bool:
        proc = self.roles[name].proc
        if proc is None or proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        return True

    def reap(self) -> list[Role]:
        """Roles whose process ended since the last call (recorded with their status)."""
        ended = []
        for role in self.roles.values():
            proc = role.proc
            if proc is not None and proc not in self.ended and proc.poll() is not None:
                self.ended.append(proc)
                self.history.write("exit", role=role.name, pid=proc.pid, rc=proc.returncode,
                                   by_nemesis=role.killed)
                role.done = not role.killed
                ended.append(role)
        return ended

    def alive(self, name: str) -> bool:
        proc = self.roles[name].proc
        return proc is not None and proc.poll() is None

    def close(self) -> None:
        """Every process group ended (SIGCONT first, so a stopped one dies), mounts undone."""
        for role in self.roles.values():
            if role.proc is not None and role.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(role.proc.pid, signal.SIGCONT)
                    os.killpg(role.proc.pid, signal.SIGKILL)
                role.proc.wait()
                self.history.write("killed_at_end", role=role.name, pid=role.proc.pid)
        self.reap()

    def unmount(self) -> None:
        if self.mounted is not None:
            subprocess.run(["umount", "-l", str(self.mounted)], capture_output=True, timeout=10)
            self.mounted = None


# -- the global server's resources ---------------------------------------------------------------

def sample_resources(cluster: Cluster, out: Any) -> None:
    proc = cluster.roles["server"].proc
    if proc is None or proc.poll() is not None or cluster.roles["server"].stopped:
        return
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
    except OSError:
        return
    rss = next((int(line.split()[1]) for line in status.splitlines()
                if line.startswith("VmRSS:")), 0)
    out.write(json.dumps({"t": now(), "pid": proc.pid, "rss_kb": rss, "fds": fds}) + "\n")


def progress(run_dir: Path, budget: float) -> float:
    """The share of the samples budget the global server's last record line says is spent."""
    path = run_dir / "global.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 8192))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0.0
    for line in reversed(tail):
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if "samples" in rec:  # what the budget counts (a resume sets it back)
                got = rec["samples"] or 0
                return float(got) / budget if budget else 0.0
    return 0.0


# -- the faults ---------------------------------------------------------------------------------

def garbage(host: str, port: int, rng: random.Random, n: int = 20) -> int:
    """``n`` fresh connections each writing random bytes, then closing."""
    sent = 0
    for _ in range(n):
        with contextlib.suppress(OSError), socket.create_connection((host, port), 3) as s:
            s.sendall(rng.randbytes(rng.randint(1, 4096)))
            sent += 1
    return sent


async def flood(host: str, port: int, ca: str, seconds: float) -> int:
    """An authenticated client (an evaluator's handshake, TLS) writing HEARTBEATs as fast as
    TCP takes them for ``seconds``; the frames sent."""
    from minips.net import transport
    from minips.net.endpoints import client_ssl
    from minips.wire import control

    sent = 0
    ch = await transport.connect(host, port, role="evaluator", token=TOKEN, timeout=10,
                                 retries=0, ssl=client_ssl(ca))
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await ch.send(control.Heartbeat(seq=sent))
            sent += 1
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            await ch.close()
    return sent


def hostile_main(kind: str, target: str, ca: str, seed: int) -> int:
    """``--hostile KIND``: one garbage burst or flood against ``target``, its figures as JSON
    on stdout (run as a process of its own, in a namespace of its own when there are some)."""
    host, port = target.rsplit(":", 1)
    try:
        if kind == "garbage":
            got: dict[str, Any] = {"connections": garbage(host, int(port), random.Random(seed))}
        else:
            got = {"frames": asyncio.run(flood(host, int(port), ca, 2.0))}
    except Exception as exc:  # noqa: BLE001 - a refused hostile client is an outcome
        got = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(got), flush=True)
    return 0


@dataclass
class Fault:
    """One injected fault, healed at ``heal_at`` (None: nothing to heal)."""

    fid: int
    kind: str
    target: str
    heal_at: float | None
    detail: dict[str, Any] = field(default_factory=dict)


class Nemesis:
    """Picks a fault every ``every_s`` (jittered, seeded) and heals each in its time."""

    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.c = cluster
        self.rng = random.Random(seed)
        self.active: list[Fault] = []
        # link_rate spells apart from ``active``: a slow link is no fault of the worker's, so
        # it neither keeps other faults off that worker nor counts as one down
        self.slowed: dict[str, Fault] = {}
        self.fid = 0
        self.next_at = now() + self.rng.uniform(3, 6)
        self.filler: Path | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self._grouped = False

    def kinds(self) -> list[str]:
        c = self.c
        kinds = ["kill_worker", "stop_worker", "kill_global", "stop_global", "kill_eval",
                 "stop_eval", "garbage", "flood"]
        if c.plan.external:
            kinds += ["kill_group", "stop_group"]
        if c.net.mode == "netns":
            kinds += ["link_cut", "link_rate", "link_rate"]
            if c.plan.external:
                kinds.append("partition")
        if c.mounted is not None:
            kinds.append("disk_full")
        return [k for k in kinds if k not in c.plan.skip]

    def grouped(self) -> bool:
        """Whether the global server has formed the groups (a `groups` line)."""
        if not self._grouped:
            with contextlib.suppress(OSError):
                self._grouped = '"event":"groups"' in (self.c.plan.run_dir /
                                                       "global.jsonl").read_text()
        return self._grouped

    def busy(self, target: str) -> bool:
        return any(f.target == target for f in self.active)

    def workers_down(self) -> int:
        return len({f.target for f in self.active if f.target.startswith("w")})

    def pick_target(self, kind: str) -> str | None:
        c, rng = self.c, self.rng
        if kind.endswith("_worker") or kind.startswith("link_"):
            if kind != "link_rate" and self.workers_down() >= c.plan.workers // 2:
                return None
            free = [f"w{i}" for i in range(c.plan.workers) if c.alive(f"w{i}") and not (
                f"w{i}" in self.slowed if kind == "link_rate" else self.busy(f"w{i}"))]
            return rng.choice(free) if free else None
        if kind.endswith("_group") or kind == "partition":
            if any(f.target.startswith("group") for f in self.active):
                return None  # one group process at a time
            if kind != "kill_group" and EARLY_GROUP in c.plan.skip and not self.grouped():
                return None
            free = [g for g in c.roles if g.startswith("group") and c.alive(g)]
            return rng.choice(free) if free else None
        if kind.endswith("_global") or kind in ("garbage", "flood", "disk_full"):
            if not c.alive("server") or self.busy("server"):
                return None
            if kind == "kill_global" and not c.checkpoint.exists():
                return None
            return "server"
        return None if self.busy("eval") or not c.alive("eval") else "eval"

    async def tick(self) -> None:
        for f in [f for f in self.active if f.heal_at is not None and now() >= f.heal_at]:
            await self.heal(f)
        for f in [f for f in self.slowed.values() if f.heal_at is not None and
                  now() >= f.heal_at]:
            self.end_spell(f)
        if now() >= self.next_at:
            self.next_at = now() + self.c.plan.every_s * self.rng.uniform(0.5, 1.5)
            kinds = self.kinds()
            for _ in range(5):  # a kind with no target now (all busy, no checkpoint yet): another
                kind = self.rng.choices(kinds, [WEIGHTS.get(k, 2) for k in kinds])[0]
                target = self.pick_target(kind)
                if target is not None:
                    await self.inject(kind, target)
                    break

    async def inject(self, kind: str, target: str) -> None:
        self.fid += 1
        rng, c = self.rng, self.c
        lasting = {"stop": rng.uniform(1, LEASE_S + 4), "kill": rng.uniform(0.5, 4),
                   "link_cut": rng.uniform(1, LEASE_S + 4),
                   "partition": rng.uniform(2, LEASE_S + 5), "disk_full": rng.uniform(3, 8)}
        verb = kind.split("_")[0]
        heal = lasting.get(kind, lasting.get(verb))
        f = Fault(self.fid, kind, target, None if heal is None else now() + heal)
        if verb == "kill":
            c.roles[target].killed = True
            c.signal(target, signal.SIGKILL)
        elif verb == "stop":
            c.roles[target].stopped = True
            c.signal(target, signal.SIGSTOP)
        elif kind == "link_cut":
            ip("-n", c.net.ns["_switch"], "link", "set", c.net.port[target], "down")
        elif kind == "link_rate":
            f.detail["mbit"] = rng.choice(RATES_MBIT)
            heal = rng.uniform(*RATE_SPELL_S)  # drawn last: the seeds' schedules up to here kept
            f.heal_at = now() + heal
            f.detail["ok"] = shape(c.net, target, f.detail["mbit"])
        elif kind == "partition":
            f.detail["ok"] = self.partition(target, True)
        elif kind == "disk_full":
            f.detail["filled"] = self.fill()
        elif kind in ("garbage", "flood"):
            self.tasks.append(asyncio.create_task(self.hostile(f)))
        c.history.write("inject", id=f.fid, kind=kind, target=target,
                        planned_s=heal, **f.detail)
        if kind == "link_rate":
            self.slowed[target] = f
        elif f.heal_at is not None:
            self.active.append(f)

    async def hostile(self, f: Fault) -> None:
        """The hostile client as a process (in the namespace ``hostile`` when there is one);
        its figures in a ``hostile_done`` line when it ends."""
        c = self.c
        argv = c.net.wrap("hostile", [sys.executable, str(Path(__file__).resolve()),
                                      "--hostile", f.kind, "--target", c.address, "--ca",
                                      str(c.plan.certs / "ca.pem"), "--seed", str(f.fid)])
        proc = await asyncio.create_subprocess_exec(*argv, env=c.env, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT)
        out, _ = await proc.communicate()
        text = out.decode(errors="replace").strip().splitlines()
        c.history.write("hostile_done", id=f.fid, kind=f.kind, rc=proc.returncode,
                        said=text[-1][:300] if text else "")

    def partition(self, group: str, on: bool) -> bool:
        """Cut ``group``'s machine from the server's both ways: a blackhole route to the other
        in each (packets dropped in silence, as a dead switch port would; this kernel may lack
        the prio and netem qdiscs that a tc filter would need)."""
        c, ok = self.c, True
        for ns_role, dst in ((group, c.net.addr["server"]), ("server", c.net.addr[group])):
            verb = "add" if on else "del"
            done = subprocess.run(["ip", "-n", c.net.ns[ns_role], "route", verb, "blackhole",
                                   f"{dst}/32"], capture_output=True, timeout=10)
            ok &= done.returncode == 0
        return ok

    def end_spell(self, f: Fault) -> None:
        """A link_rate spell is over: the worker's link back at the run's rate."""
        del self.slowed[f.target]
        shape(self.c.net, f.target, RATES_MBIT[-1])
        self.c.history.write("heal", id=f.fid, kind=f.kind, target=f.target)

    def fill(self) -> int:
        """A filler file taking every free byte of the checkpoint tmpfs."""
        d = self.c.checkpoint.parent
        self.filler = d / "filler"
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize
        with contextlib.suppress(OSError), open(self.filler, "wb") as f:
            f.write(b"\0" * free)
        return free

    async def heal(self, f: Fault) -> None:
        c = self.c
        self.active.remove(f)
        verb = f.kind.split("_")[0]
        if verb == "kill":
            role = c.roles[f.target]
            if role.proc is not None:
                role.proc.wait()
            c.reap()
            if f.target == "server":
                c.restart_server()
            else:
                c.start(f.target)
        elif verb == "stop":
            c.roles[f.target].stopped = False
            c.signal(f.target, signal.SIGCONT)
        elif f.kind == "link_cut":
            ip("-n", c.net.ns["_switch"], "link", "set", c.net.port[f.target], "up")
        elif f.kind == "partition":
            self.partition(f.target, False)
        elif f.kind == "disk_full" and self.filler is not None:
            self.filler.unlink(missing_ok=True)
        c.history.write("heal", id=f.fid, kind=f.kind, target=f.target)

    async def heal_all(self, restart: bool = True) -> None:
        """Every active fault healed now; killed roles restarted only when ``restart`` (not
        once the run is over: the restarted role would wait for a server that is gone)."""
        for f in list(self.slowed.values()):
            self.end_spell(f)
        for f in list(self.active):
            if not restart and f.kind.startswith("kill"):
                self.active.remove(f)
                self.c.history.write("not_restarted", id=f.fid, kind=f.kind, target=f.target)
                continue
            f.heal_at = now()
            await self.heal(f)
        await asyncio.gather(*self.tasks)


# -- one run ---------------------------------------------------------------------------------

async def drive(cluster: Cluster, budget_samples: float) -> None:
    """Faults while the budget lasts (the nemesis when the plan has faults), then healed; until
    the global server ends and the others after it (END_WAIT_S)."""
    plan = cluster.plan
    nemesis = Nemesis(cluster, plan.seed) if plan.faults else None
    res = open(plan.run_dir / "soak" / "resources.jsonl", "a", buffering=1)  # noqa: SIM115
    sampled_at, server_end = 0.0, None
    try:
        while True:
            for role in cluster.reap():
                if role.name == "server" and role.done:
                    server_end = now()
            if server_end is not None:
                if nemesis is not None:
                    await nemesis.heal_all(restart=False)
                    nemesis = None
                if all(not cluster.alive(n) for n in cluster.roles) or \
                        now() > server_end + END_WAIT_S:
                    return
            elif nemesis is not None:
                if progress(plan.run_dir, budget_samples) >= PROGRESS_STOP:
                    await nemesis.heal_all()
                    cluster.history.write("nemesis_off", reason="budget nearly spent")
                    nemesis = None
                else:
                    await nemesis.tick()
            if now() - sampled_at >= 2.0:
                sampled_at = now()
                sample_resources(cluster, res)
            await asyncio.sleep(0.2)
    finally:
        if nemesis is not None:
            await nemesis.heal_all()
        res.close()


def orphans(tag: str) -> list[int]:
    """Processes still carrying this run's SOAK_TAG in their environment."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if f"SOAK_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
    return found


def run_once(plan: Plan, net: Net, why_net: str) -> None:
    """One run of ``plan`` to its end; the history says everything that happened."""
    from minips.run.launch import write_init

    plan.run_dir.mkdir(parents=True, exist_ok=True)
    write_init(plan.run_dir, "lenet5", plan.seed)
    history = History(plan.run_dir / "soak" / "history.jsonl")
    cluster = Cluster(plan, net, history)
    cluster.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    why_disk = cluster.mount_checkpoint_fs() if plan.faults else "no faults"
    history.write("begin", seed=plan.seed, faults=plan.faults, external=plan.external,
                  net=net.mode, net_why=why_net, disk=why_disk, lease_s=LEASE_S,
                  heartbeat_s=HEARTBEAT_S, checkpoint_every_s=CHECKPOINT_EVERY_S,
                  epochs=plan.epochs, compressor=plan.compressor, workers=plan.workers,
                  checkpoint=str(cluster.checkpoint), addresses=dict(net.addr))
    try:
        if net.mode == "netns":
            for i in range(plan.workers):
                shape(net, f"w{i}", RATES_MBIT[-1])
        cluster.launch()
        asyncio.run(drive(cluster, plan.epochs * TRAIN_SIZE))
    finally:
        cluster.close()
        temps = sorted(p.name for p in cluster.checkpoint.parent.glob(".checkpoint.npz.tmp*"))
        if cluster.checkpoint.exists():  # kept for the checker: the tmpfs goes with the run
            shutil.copy(cluster.checkpoint, plan.run_dir / "soak" / "checkpoint-last.npz")
        cluster.unmount()
        history.write("end", orphans=orphans(cluster.env["SOAK_TAG"]), checkpoint_temps=temps)
        history.close()


def epochs_of(baseline: Path) -> float:
    """The epochs budget of an unfaulted run (its config.json)."""
    got = float(json.loads((baseline / "config.json").read_text()).get("epochs") or 0)
    if got <= 0:
        raise RuntimeError(f"the baseline {baseline} has no --epochs budget to repeat")
    return got


def run_seed(seed: int, epochs: float, every_s: float, out: Path, net_mode: str,
             baseline: Path | None, skip: tuple[str, ...] = ()) -> soak_check.Verdict:
    """The twin (unless ``baseline``, whose budget is then the soak's), the soak, the
    checker's verdict."""
    out.mkdir(parents=True, exist_ok=True)
    external = seed % 2 == 0
    net, why = make_net(net_mode, 2 if external else 0, len(SLOWDOWNS))
    print(f"seed {seed}: {why}; {'external' if external else 'in-process'} groups", flush=True)
    try:
        make_certs(out / "certs", net)
        if baseline is None:
            baseline = out / f"seed-{seed}" / "twin"
            shutil.rmtree(baseline, ignore_errors=True)
            run_once(Plan(seed, baseline, out / "certs", external, epochs, faults=False),
                     net, why)
        soak = out / f"seed-{seed}" / "soak"
        shutil.rmtree(soak, ignore_errors=True)
        run_once(Plan(seed, soak, out / "certs", external, epochs_of(baseline), faults=True,
                      every_s=every_s, skip=skip), net, why)
    finally:
        remove_net(net)
    return soak_check.check(soak, baseline)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="about how long the unfaulted "
                   "twin trains on this machine (the budget: minutes x RATE_SAMPLES_S samples; "
                   "the soak trains as many, faults make it longer)")
    p.add_argument("--epochs", type=float, default=0.0, help="the budget in epochs instead")
    p.add_argument("--seeds", type=int, default=1, help="seeds seed .. seed+N-1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=float, default=4.0, help="mean seconds between faults")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "soak")
    p.add_argument("--baseline", type=Path, help="an unfaulted run of the same seed (one seed)")
    p.add_argument("--net", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--skip", default="", help="fault kinds the nemesis leaves out, "
                   f"comma-separated (e.g. disk_full; {EARLY_GROUP}: no stop or partition of "
                   "a group process before the grouping)")
    p.add_argument("--hostile", choices=("garbage", "flood"), help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--ca", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hostile:
        return hostile_main(args.hostile, args.target, args.ca, args.seed)
    if args.minutes <= 0 or args.seeds < 1 or args.every <= 0:
        p.error("--minutes and --every must be > 0, --seeds >= 1")
    if args.baseline is not None and args.seeds != 1:
        p.error("--baseline is one seed's unfaulted run: give --seeds 1")
    verdicts = []
    for seed in range(args.seed, args.seed + args.seeds):
        epochs = args.epochs or args.minutes * 60 * RATE_SAMPLES_S / TRAIN_SIZE
        verdicts.append(run_seed(seed, epochs, args.every, args.out, args.net,
                                 args.baseline, tuple(filter(None, args.skip.split(",")))))
        print(verdicts[-1].text(), flush=True)
    print(soak_check.table(verdicts), flush=True)
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    def _stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # the finally blocks end every process, mount and namespace

    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
