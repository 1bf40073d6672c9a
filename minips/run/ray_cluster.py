"""`minips ray`: the cluster of `minips local` placed on a Ray cluster, one Ray actor per role.

This module imports ray; only `minips ray` imports it, and lazily (``flags.ray_command``), so
the rest of minips runs without ray installed. The file holds, in order:

- ``RoleActor``, the Ray actor: one minips role (server, group, worker, evaluator) as a child
  process on the node Ray placed the actor on. Ray places the actor and restarts it when it
  dies; the role itself is the ordinary `minips` command, so roles talk to each other over
  minips' own TCP protocol with its HMAC handshake (and TLS when configured), exactly as when
  started by hand. Ray carries no training traffic.
- The driver (``RayConfig``, ``Placement``, ``start_roles``, ``run_ray``): every role is a
  ``RoleActor`` that runs the ordinary `minips` command of that role as a child process on its
  node: the global server (in-process group servers, or ``external_groups`` `minips group`
  actors), the workers and the evaluator. Ray only places the actors, by resources and node
  labels, and restarts one that dies (``max_restarts``): the global server then resumes from its
  checkpoint (``--resume``), a worker rejoins under its id. The training traffic is minips' own
  TCP protocol, authenticated with MINIPS_TOKEN as always.

Before it places an actor, the driver compares what the actors ask for (each role's resources
and node labels) with the nodes' resources (``unplaceable``). On a Ray instance on this machine
(no ``address``) nothing else will join, so a shortfall is refused in one line (``ConfigError``:
`3 workers ask CPU=1 each; the cluster has 2 CPUs: give --worker-resources CPU=0.66 or add
nodes`), and workers given no resources share its CPUs (``share_cpus``: CPU=min(1, CPUs /
workers), so 3 workers fit on 2 CPUs). On a cluster it joins, nodes may still come: an actor that
is not placed is named with what it waits for every ``REPORT_S`` (``wait_placed``) until the run's
``timeout_s``, which then stops every actor and ends the run with one line.

The driver waits for the global server to finish the run (its budget), gives the other roles
``EXIT_TIMEOUT_S`` to end (then stops them), collects every role's files into one run directory
on the driver's machine (metrics, logs under logs/; files over ``MAX_COLLECT_BYTES`` stay on
their node), writes summary.json and kills every actor, also when interrupted or when something
fails.

Invariants:
- No role outlives ``run_ray``.
- The child dies with the actor: it is started with PR_SET_PDEATHSIG = SIGKILL, so a killed actor
  (``ray.kill``, a node failure, the driver ending) leaves no minips process behind.
- A restarted actor starts its role again in the same directory on its node. The global server's
  actor then adds ``--resume`` when its checkpoint (``resume_if``) is there; a worker's
  reconnects with its id and rejoins.
- ``{node_ip}`` and ``{dir}`` in the role's arguments become this node's address and the role's
  directory, which only the actor knows.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from minips.errors import ConfigError

if TYPE_CHECKING:  # every actor's process imports this module: numpy only where the driver runs
    from minips.core.config import RunConfig

__all__ = [
    "RoleActor",
    "MAX_COLLECT_BYTES",
    "RayConfig",
    "Placement",
    "run_ray",
    "parse_placement",
    "start_roles",
    "unplaceable",
    "share_cpus",
    "settle_local",
    "wait_placed",
]


# -- the Ray actor: one minips role as a child process on its node ---------------------------------

PR_SET_PDEATHSIG = 1  # linux/prctl.h
MAX_COLLECT_BYTES = 256 << 20  # files larger than this stay on the node (e.g. big checkpoints)
READY_POLL_S = 0.1


# The child's first lines: ask for SIGKILL when the actor's process ends (kept across exec), make
# sure the actor did not end before that, then become `python -m minips ARGS`. (Done in the child,
# not with preexec_fn, which is unsafe in a process with threads such as a Ray worker.)
LAUNCHER = ("import ctypes, os, signal, sys; "
            f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGKILL); "
            "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
            "os.execv(sys.executable, [sys.executable, '-m', 'minips', *sys.argv[2:]])")


class RoleActor:
    """One role's child process (see the module docstring)."""

    def __init__(self, name: str, run_id: str, argv: list[str], env: dict[str, str],
                 files: dict[str, bytes], resume_if: str = "") -> None:
        ctx = ray.get_runtime_context()
        self.name = name
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.node_id = ctx.get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.dir = Path(tempfile.gettempdir()) / "minips-ray" / run_id / name
        self.dir.mkdir(parents=True, exist_ok=True)
        for rel, data in files.items():  # e.g. the run config, written where the role reads it
            (self.dir / rel).write_bytes(data)
        args = [a.replace("{node_ip}", self.ip).replace("{dir}", str(self.dir)) for a in argv]
        if self.restarted and resume_if and (self.dir / resume_if).exists():
            args.append("--resume")  # the global server: continue from its checkpoint
        self.argv = args
        (self.dir / "ready").unlink(missing_ok=True)  # a restart's server writes a new one
        with open(self.dir / f"{name}.log", "ab") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCHER, str(os.getpid()), *args], cwd=self.dir,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=log,
                stderr=subprocess.STDOUT)

    def where(self) -> dict[str, Any]:
        """Where this role runs: node id and address, child pid, restarted or not, argv."""
        return {"name": self.name, "node_id": self.node_id, "ip": self.ip,
                "pid": self.proc.pid, "restarted": self.restarted, "argv": self.argv}

    def address(self, timeout_s: float) -> str:
        """HOST:PORT from the role's ready file ('host port', written once it listens)."""
        path = self.dir / "ready"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists() and (text := path.read_text().split()):
                return f"{text[0]}:{text[1]}"
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                   f"{self._tail()}")
            time.sleep(READY_POLL_S)
        raise TimeoutError(f"{self.name} did not listen within {timeout_s} s: {self._tail()}")

    def wait(self, timeout_s: float) -> int | None:
        """The child's exit status, or None if it still runs after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def collect(self) -> dict[str, bytes]:
        """The role's files (metrics, config, log, final weights), relative path -> bytes."""
        out: dict[str, bytes] = {}
        total = 0
        for path in sorted(p for p in self.dir.rglob("*") if p.is_file()):
            size = path.stat().st_size
            if path.name != "ready" and total + size <= MAX_COLLECT_BYTES:
                out[str(path.relative_to(self.dir))] = path.read_bytes()
                total += size
        return out

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the child, SIGKILL after ``grace_s``; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def remove(self) -> None:
        """Delete the role's directory on its node (after ``collect``)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the run's directory, once its last role is gone
            self.dir.parent.rmdir()

    def _tail(self) -> str:
        log = self.dir / f"{self.name}.log"
        return log.read_text(errors="replace")[-400:] if log.exists() else ""


RemoteRole: Any = ray.remote(RoleActor)  # the actor class; options (resources, restarts) per role


# -- the driver: place the roles, wait for the run, collect its files ------------------------------

READY_TIMEOUT_S = 120.0  # the global server must listen within this long, once placed
# After the global server exits the others have nothing left to do (the workers left before it
# ended): they get this long to end, then are stopped. An evaluator busy with an older version
# when the server ended ends once that score is written (the server's LEAVE "done"): the bound
# is on that score.
EXIT_TIMEOUT_S = 10.0
POLL_S = 1.0  # how often the driver looks at the global server's process
CHECKPOINT_FILE = "checkpoint.npz"  # the server actor resumes when this exists in its directory
REPORT_S = 5.0  # while an actor waits to be placed, the driver names it this often
CPU_STEP = 0.01  # a worker's share of a local instance's CPUs is rounded down to this
ROLE_NAMES = {"server": "server", "groups": "group server", "workers": "worker",
              "evaluator": "evaluator"}  # RayConfig's placements -> what a line calls the role
ROLE_FLAGS = {"server": "server", "groups": "group", "workers": "worker",
              "evaluator": "evaluator"}  # RayConfig's placements -> --ROLE-resources


@dataclass
class Placement:
    """Where one kind of role may run: Ray resources per actor and node labels."""

    resources: dict[str, float] = field(default_factory=dict)  # e.g. {"jetson": 1, "GPU": 1}
    labels: dict[str, str] = field(default_factory=dict)  # node labels the node must have

    def options(self) -> dict[str, Any]:
        """Ray actor options: CPU and GPU are Ray's own keywords, the rest custom resources."""
        res = dict(self.resources)
        opts: dict[str, Any] = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0)}
        if res:
            opts["resources"] = res
        if self.labels:
            opts["label_selector"] = dict(self.labels)
        return opts

    def text(self) -> str:
        """'jetson=1,CPU=0.5 on a node labelled zone=a', as the flags spell it."""
        asks = ",".join(f"{k}={v:g}" for k, v in self.resources.items() if v > 0) or "nothing"
        where = ",".join(f"{k}={v}" for k, v in self.labels.items())
        return asks + (f" on a node labelled {where}" if where else "")


def _run_config() -> RunConfig:
    from minips.core.config import RunConfig  # not at the top: see there

    return RunConfig()


@dataclass
class RayConfig:
    """`minips ray`: one run on a Ray cluster."""

    run: RunConfig = field(default_factory=_run_config)  # the run's settings
    address: str | None = None  # Ray cluster to join ("auto", HOST:PORT); None = a local Ray
    server_port: int = 7070  # the global server's port (fixed: it must survive a restart)
    server: Placement = field(default_factory=Placement)  # where the global server runs
    groups: Placement = field(default_factory=Placement)  # where external group servers run
    workers: Placement = field(default_factory=lambda: Placement({"CPU": 1}))
    evaluator: Placement = field(default_factory=Placement)
    share_cpus: bool = False  # local instance: the workers share its CPUs (no --worker-resources)
    local_cpus: int | None = None  # CPUs of a local instance run_ray starts; None = all
    external_groups: int = 0  # `minips group` actors; 0 = group servers in the server process
    evaluate: bool = True  # start the evaluator
    slowdowns: list[float] = field(default_factory=list)  # emulated factor per worker
    max_restarts: int = 3  # restarts Ray may make of each actor
    checkpoint_every_s: float = 10.0  # global server checkpoints (what a restart resumes from)
    out_dir: str = "runs"  # parent of the run directory on the driver's machine
    name: str | None = None  # run directory name; None = time-mode-compressor
    timeout_s: float = 0.0  # hard stop, placement included; 0 = the wall budget (or 30 min) + 2 min


def parse_placement(resources: str, labels: str = "") -> Placement:
    """'jetson=1,CPU=2' and 'zone=lab1' -> Placement; bad text raises ConfigError."""
    res: dict[str, float] = {}
    for item in filter(None, resources.split(",")):
        key, sep, value = item.partition("=")
        try:
            res[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip() or res.get(key.strip(), 0) < 0:
            raise ConfigError(f"resources: expected NAME=AMOUNT (>= 0), got {item!r}")
    lab = {}
    for item in filter(None, labels.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"labels: expected KEY=VALUE, got {item!r}")
        lab[key.strip()] = value.strip()
    return Placement(res, lab)


# -- what the actors ask for against what the nodes have ---------------------------------------

Node = dict[str, Any]  # {"resources": {name: amount}, "labels": {key: value}}


def cluster_nodes() -> list[Node]:
    """The live nodes of the Ray cluster this process is connected to."""
    return [{"resources": dict(n.get("Resources", {})), "labels": dict(n.get("Labels", {}))}
            for n in ray.nodes() if n.get("Alive")]


def asks(cfg: RayConfig) -> list[tuple[str, int, Placement]]:
    """(role key, actors, what each asks for) for every role with actors in this run."""
    counts = {"server": 1, "groups": cfg.external_groups, "workers": cfg.run.workers,
              "evaluator": int(cfg.evaluate)}
    return [(role, n, getattr(cfg, role)) for role, n in counts.items() if n > 0]


def _fits_labels(node: Node, labels: dict[str, str]) -> bool:
    # exact KEY=VALUE only; Ray's richer selectors ('!v', 'in(a,b)') are left to Ray to judge
    return all(node["labels"].get(k) == v for k, v in labels.items()
               if not v.startswith("!") and "(" not in v)


def _have(nodes: list[Node], key: str) -> float:
    return float(sum(n["resources"].get(key, 0.0) for n in nodes))


def _amount(key: str, value: float) -> str:
    """'2 CPUs', '1 GPU', 'no jetson', '3 jetson'."""
    if value <= 0:
        return f"no {key}"
    plural = "s" if key in ("CPU", "GPU") and value != 1 else ""
    return f"{value:g} {key}{plural}"


def _who(role: str, n: int) -> str:
    name = ROLE_NAMES[role]
    return f"{n} {name}s ask" if n > 1 else f"the {name} asks"


def _hint(role: str, key: str, n: int, have: float) -> str:
    flag = f"--{ROLE_FLAGS[role]}-resources"
    if have <= 0:
        return f"add a node with {key} or change {flag}"
    share = math.floor(have / n / CPU_STEP) * CPU_STEP
    return f"give {flag} {key}={share:g} or add nodes" if share > 0 else "add nodes"


def unplaceable(cfg: RayConfig, nodes: list[Node]) -> list[str]:
    """What no placement on ``nodes`` can hold, one sentence each ([] when it may all fit):
    a role whose actors ask more of a resource than the nodes it may use have in all, one
    actor no single node can hold, or the roles together asking more than the cluster has."""
    problems: list[str] = []
    for role, n, place in asks(cfg):
        mine = [node for node in nodes if _fits_labels(node, place.labels)]
        if not mine:
            problems.append(f"{_who(role, n)} for a node labelled "
                            f"{','.join(f'{k}={v}' for k, v in place.labels.items())}; "
                            f"no node has those labels")
            continue
        short = [(k, v) for k, v in place.resources.items() if v > 0 and n * v > _have(mine, k)]
        for key, v in short:
            have = _have(mine, key)
            each = " each" if n > 1 else ""
            problems.append(f"{_who(role, n)} {key}={v:g}{each}; the cluster has "
                            f"{_amount(key, have)}: {_hint(role, key, n, have)}")
        if not short and not any(all(node["resources"].get(k, 0.0) >= v
                                     for k, v in place.resources.items()) for node in mine):
            problems.append(f"a {ROLE_NAMES[role]} asks {place.text()}; no node has that much "
                            f"of all of it at once: change --{ROLE_FLAGS[role]}-resources")
    return problems or _together(cfg, nodes)


def _together(cfg: RayConfig, nodes: list[Node]) -> list[str]:
    """The roles together asking more of a resource than the cluster has."""
    problems = []
    for key in sorted({k for _, _, p in asks(cfg) for k in p.resources}):
        parts = [(role, n, p.resources.get(key, 0.0)) for role, n, p in asks(cfg)]
        total = sum(n * v for _, n, v in parts)
        if total > _have(nodes, key) + 1e-9:
            detail = ", ".join(f"{ROLE_NAMES[r]} {v:g}" if n == 1 else
                               f"{n} {ROLE_NAMES[r]}s {v:g} each" for r, n, v in parts if v > 0)
            problems.append(f"the roles ask {key}={total:g} in all ({detail}); the cluster "
                            f"has {_amount(key, _have(nodes, key))}: lower their --*-resources "
                            f"or add nodes")
    return problems


def share_cpus(cfg: RayConfig, nodes: list[Node]) -> None:
    """Workers given no resources on a local instance: each asks an equal share of the CPUs
    the other roles leave, at most 1, so every worker is placed (3 workers on 2 CPUs: 0.66)."""
    if not cfg.share_cpus or cfg.run.workers <= 0:
        return
    others = sum(n * p.resources.get("CPU", 0.0) for role, n, p in asks(cfg) if role != "workers")
    free = _have(nodes, "CPU") - others
    share = math.floor(free / cfg.run.workers / CPU_STEP) * CPU_STEP
    cfg.workers.resources["CPU"] = round(min(1.0, max(share, CPU_STEP)), 2)


def _planned_local(cfg: RayConfig) -> list[Node]:
    """The one node of the local instance run_ray is about to start (GPUs: known once it runs)."""
    return [{"resources": {"CPU": float(cfg.local_cpus or os.cpu_count() or 1)}, "labels": {}}]


def settle_local(cfg: RayConfig, nodes: list[Node]) -> None:
    """On a local instance: the workers' CPU share, then refuse what cannot be placed."""
    share_cpus(cfg, nodes)
    problems = unplaceable(cfg, nodes)
    if problems:
        raise ConfigError(problems[0])


def wait_placed(roles: dict[str, Any], asked: dict[str, Placement], deadline: float | None,
                timeout_s: float = 0.0, since: float | None = None) -> dict[str, dict[str, Any]]:
    """Until Ray has placed every actor of ``roles`` (its ``where`` answered); name -> where.
    Every ``REPORT_S`` from ``since`` (the placement's start; default now) one line names the
    actors not placed yet, what they ask and what the cluster has of it and has free (a process
    Ray is still starting is named too: the numbers tell which); ``TimeoutError`` naming them
    at ``deadline``."""
    pending = {roles[name].where.remote(): name for name in roles}
    placed: dict[str, dict[str, Any]] = {}
    since = time.monotonic() if since is None else since
    end = math.inf if deadline is None else deadline
    while pending:
        now = time.monotonic()
        if now >= end:
            raise TimeoutError(f"never placed: {_waiting(sorted(pending.values()), asked)}")
        report = since + REPORT_S * (math.floor((now - since) / REPORT_S) + 1)
        done, _ = ray.wait(list(pending), num_returns=len(pending),
                           timeout=max(0.0, min(report, end) - now))
        for ref in done:
            info = ray.get(ref)
            placed[info["name"]] = info
            del pending[ref]
        if pending and time.monotonic() >= report:
            bound = f" of --timeout {timeout_s:.0f} s" if timeout_s else ""
            print(f"minips ray: waiting {time.monotonic() - since:.0f} s{bound} for "
                  f"{_waiting(sorted(pending.values()), asked)}", file=sys.stderr, flush=True)
    return placed


def _waiting(names: list[str], asked: dict[str, Placement]) -> str:
    """'worker-0, worker-1 (each asks jetson=1; the cluster has no jetson)': the actors not placed
    yet, what they ask and what the cluster has of it, and has free."""
    total, free = ray.cluster_resources(), ray.available_resources()
    by_ask: dict[str, list[str]] = {}
    for name in names:
        by_ask.setdefault(asked[name].text(), []).append(name)
    parts = []
    for text, who in by_ask.items():
        has = "".join(f"; the cluster has {_amount(k, total.get(k, 0.0))}"
                      + (f", {free.get(k, 0.0):g} free" if total.get(k, 0.0) > 0 else "")
                      for k, v in asked[who[0]].resources.items() if v > 0)
        parts.append(f"{', '.join(who)} ({'each asks' if len(who) > 1 else 'asks'} {text}{has})")
    return "; ".join(parts)


def _argv(role: str, address: str, extra: list[str]) -> list[str]:
    return [role, "--connect", address, "--run-dir", "{dir}", *extra]


def start_roles(cfg: RayConfig, run_id: str, token: str, into: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
    """Create every actor (the server first, the others once it listens) and wait until Ray
    placed them all (``wait_placed``, naming those that wait); name -> handle, also in ``into``
    as they are created, so that a caller can stop them when this fails or times out."""
    roles = {} if into is None else into
    since = time.monotonic()  # the waiting lines count from here
    env = {"MINIPS_TOKEN": token}
    common = {"max_restarts": cfg.max_restarts, "max_task_retries": -1}
    asked = {"server": cfg.server}
    server_argv = ["server", "--host", "{node_ip}", "--port", str(cfg.server_port), "--quiet",
                   "--run-dir", "{dir}", "--ready-file", "{dir}/ready", "--run-config",
                   "{dir}/run.json", "--external-groups", str(cfg.external_groups),
                   "--checkpoint-every", str(cfg.checkpoint_every_s)]
    files = {"run.json": json.dumps(cfg.run.to_info()).encode()}
    roles["server"] = RemoteRole.options(name=f"minips-{run_id}-server", **common,
                                         **cfg.server.options()).remote(
        "server", run_id, server_argv, env, files, resume_if=CHECKPOINT_FILE)
    wait_placed(roles, asked, deadline, cfg.timeout_s, since)
    address = str(ray.get(roles["server"].address.remote(READY_TIMEOUT_S)))
    for g in range(cfg.external_groups):
        argv = _argv("group", address, ["--listen", "{node_ip}:0"])
        asked[f"group-{g}"] = cfg.groups
        roles[f"group-{g}"] = RemoteRole.options(**common, **cfg.groups.options()).remote(
            f"group-{g}", run_id, argv, env, {})
    factors = cfg.slowdowns + [1.0] * (cfg.run.workers - len(cfg.slowdowns))
    for i in range(cfg.run.workers):
        argv = _argv("worker", address, ["--id", str(i), "--slowdown", str(factors[i])])
        asked[f"worker-{i}"] = cfg.workers
        roles[f"worker-{i}"] = RemoteRole.options(**common, **cfg.workers.options()).remote(
            f"worker-{i}", run_id, argv, env, {})
    if cfg.evaluate:
        asked["evaluator"] = cfg.evaluator
        roles["evaluator"] = RemoteRole.options(**common, **cfg.evaluator.options()).remote(
            "evaluator", run_id, _argv("evaluator", address, []), env, {})
    wait_placed({n: a for n, a in roles.items() if n != "server"}, asked, deadline, cfg.timeout_s,
                since)
    return roles


def wait_server(roles: dict[str, Any], timeout_s: float) -> int:
    """Until the global server's process exits (across restarts); its exit status."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = ray.get(roles["server"].wait.remote(POLL_S))
        if status is not None:
            return int(status)
    raise TimeoutError(f"the run had not ended after {timeout_s:.0f} s")


def collect(roles: dict[str, Any], run_dir: Path) -> list[str]:
    """Wait for the other roles to end (``EXIT_TIMEOUT_S``, then stop them), copy every role's
    files here; the roles that failed or were stopped. Each step asks every actor at once."""
    others = [n for n in roles if n != "server"]
    ended = ray.get([roles[n].wait.remote(EXIT_TIMEOUT_S) for n in others])
    ray.get([roles[n].stop.remote() for n, status in zip(others, ended, strict=True)
             if status is None])  # still running: its files are whole once it stopped
    failed = [name for name, status in zip(others, ended, strict=True) if status != 0]
    order = others + ["server"]  # the server's files win
    for files in ray.get([roles[n].collect.remote() for n in order]):
        for rel, data in files.items():
            dest = run_dir / ("logs" if rel.endswith(".log") else "") / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
    ray.get([roles[n].remove.remote() for n in order])  # collected: the nodes' copies may go
    return failed


def stop_roles(roles: dict[str, Any]) -> None:
    """Kill every actor (its child dies with it; one still waiting to be placed is never
    created), never restarting it."""
    for actor in roles.values():
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone: nothing left to stop
            pass


def run_ray(cfg: RayConfig) -> dict[str, Any]:
    """Run one training run on Ray; return its summary (``status`` added). ``ConfigError``
    (nothing started, nothing written) when a local instance cannot hold the roles."""
    cfg.run.validate()
    if cfg.external_groups < 0 or cfg.max_restarts < 0:
        raise ConfigError("--external-groups and --max-restarts must be >= 0")
    timeout_s = cfg.timeout_s or (cfg.run.wall_s or 1800.0) + 120.0
    deadline = time.monotonic() + timeout_s
    started = not ray.is_initialized()
    if started and cfg.address is None and not any("GPU" in p.resources for _, _, p in asks(cfg)):
        settle_local(cfg, _planned_local(cfg))  # refused in a second, before Ray starts
    if started and cfg.address is None:  # without Ray's dashboard: nothing here reads it
        ray.init(num_cpus=cfg.local_cpus, include_dashboard=False, log_to_driver=False)
    elif started:
        ray.init(address=cfg.address, log_to_driver=False)
    try:
        if cfg.address is None:
            settle_local(cfg, cluster_nodes())
        run_dir = _make_run_dir(cfg)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    return _run(cfg, run_dir, started, deadline, timeout_s)


def _run(cfg: RayConfig, run_dir: Path, started: bool, deadline: float,
         timeout_s: float) -> dict[str, Any]:
    """run_ray once Ray runs and the roles may fit: place, wait, collect, stop, summarize."""
    from minips.record.metrics import summarize  # not at the top: numpy (see there)

    token = os.environ.get("MINIPS_TOKEN") or secrets.token_hex(16)
    (run_dir / "ray.json").write_text(json.dumps(asdict(cfg), indent=2))
    roles: dict[str, Any] = {}
    status, why = "done", ""
    try:
        start_roles(cfg, run_dir.name + "-" + secrets.token_hex(3), token, roles, deadline)
        _report(roles)
        if wait_server(roles, max(0.0, deadline - time.monotonic())) != 0:
            status = "failed"
        failed = collect(roles, run_dir)
        if failed:
            print(f"minips ray: {', '.join(failed)} did not end cleanly (or within "
                  f"{EXIT_TIMEOUT_S:.0f} s of the server, then stopped); see {run_dir}/logs",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        status = "interrupted"
    except TimeoutError as exc:
        status, why = "timeout", f" after --timeout {timeout_s:.0f} s: {exc}; every actor stopped"
    finally:
        stop_roles(roles)
        if started:
            ray.shutdown()
    summary = summarize(run_dir, write=False) if (run_dir / "config.json").exists() else {}
    summary.update(status=status, run_dir=str(run_dir))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"minips ray: {status}{why}; run directory {run_dir}", file=sys.stderr, flush=True)
    return summary


def _report(roles: dict[str, Any]) -> None:
    for info in ray.get([a.where.remote() for a in roles.values()]):
        print(f"minips ray: {info['name']} on node {info['node_id'][:12]} ({info['ip']})",
              file=sys.stderr, flush=True)


def _make_run_dir(cfg: RayConfig) -> Path:
    name = cfg.name or f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.run.mode}-{cfg.run.compressor}"
    path = Path(cfg.out_dir) / name
    path.mkdir(parents=True, exist_ok=cfg.name is not None)
    return path


def free_port() -> int:
    """A port free on this machine now (for a local Ray cluster's global server)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
