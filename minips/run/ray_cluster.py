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

The driver waits for the global server to finish the run (its budget), gives the other roles
``EXIT_TIMEOUT_S`` to end, collects every role's files into one run directory on the driver's
machine (metrics, logs under logs/; files over ``MAX_COLLECT_BYTES`` stay on their node), writes
summary.json and kills every actor, also when interrupted or when something fails.

Invariants:
- No role outlives ``run_ray``.
- The child dies with the actor: it is started with PR_SET_PDEATHSIG = SIGKILL, so a killed actor
  (``ray.kill``, a node failure, the driver ending) leaves no minips process behind.
- A restarted actor starts its role again in the same directory on its node. The global server's
  actor then adds ``--resume`` when its checkpoint (``resume_if``) is there; a worker's
  reconnects with its id and rejoins.
- ``{node_ip}`` and ``{dir}`` in the role's arguments become this node's address and the role's
  directory, which only the actor knows.

Public API: ``RoleActor``, ``MAX_COLLECT_BYTES``, ``RayConfig``, ``Placement``, ``run_ray``,
``parse_placement``, ``start_roles``.
"""

from __future__ import annotations

import contextlib
import json
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
from typing import Any

import ray

from minips.core.config import RunConfig
from minips.errors import ConfigError
from minips.record.metrics import summarize

__all__ = [
    "RoleActor",
    "MAX_COLLECT_BYTES",
    "RayConfig",
    "Placement",
    "run_ray",
    "parse_placement",
    "start_roles",
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

READY_TIMEOUT_S = 120.0  # the global server must listen within this long (actor start included)
EXIT_TIMEOUT_S = 60.0  # after the server exits, the other roles get this long to end
POLL_S = 1.0  # how often the driver looks at the global server's process
CHECKPOINT_FILE = "checkpoint.npz"  # the server actor resumes when this exists in its directory


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


@dataclass
class RayConfig:
    """`minips ray`: one run on a Ray cluster."""

    run: RunConfig = field(default_factory=RunConfig)  # the run's settings
    address: str | None = None  # Ray cluster to join ("auto", HOST:PORT); None = a local Ray
    server_port: int = 7070  # the global server's port (fixed: it must survive a restart)
    server: Placement = field(default_factory=Placement)  # where the global server runs
    groups: Placement = field(default_factory=Placement)  # where external group servers run
    workers: Placement = field(default_factory=lambda: Placement({"CPU": 1}))
    evaluator: Placement = field(default_factory=Placement)
    external_groups: int = 0  # `minips group` actors; 0 = group servers in the server process
    evaluate: bool = True  # start the evaluator
    slowdowns: list[float] = field(default_factory=list)  # emulated factor per worker
    max_restarts: int = 3  # restarts Ray may make of each actor
    checkpoint_every_s: float = 10.0  # global server checkpoints (what a restart resumes from)
    out_dir: str = "runs"  # parent of the run directory on the driver's machine
    name: str | None = None  # run directory name; None = time-mode-compressor
    timeout_s: float = 0.0  # hard stop; 0 = the wall budget (or 30 min) + 2 min


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


def _argv(role: str, address: str, extra: list[str]) -> list[str]:
    return [role, "--connect", address, "--run-dir", "{dir}", *extra]


def start_roles(cfg: RayConfig, run_id: str, token: str) -> dict[str, Any]:
    """Create every actor (the server first, the others once it listens); name -> handle."""

    env = {"MINIPS_TOKEN": token}
    common = {"max_restarts": cfg.max_restarts, "max_task_retries": -1}
    server_argv = ["server", "--host", "{node_ip}", "--port", str(cfg.server_port), "--quiet",
                   "--run-dir", "{dir}", "--ready-file", "{dir}/ready", "--run-config",
                   "{dir}/run.json", "--external-groups", str(cfg.external_groups),
                   "--checkpoint-every", str(cfg.checkpoint_every_s)]
    files = {"run.json": json.dumps(cfg.run.to_info()).encode()}
    roles = {"server": RemoteRole.options(name=f"minips-{run_id}-server", **common,
                                          **cfg.server.options()).remote(
        "server", run_id, server_argv, env, files, resume_if=CHECKPOINT_FILE)}
    import ray

    address = str(ray.get(roles["server"].address.remote(READY_TIMEOUT_S)))
    for g in range(cfg.external_groups):
        argv = _argv("group", address, ["--listen", "{node_ip}:0"])
        roles[f"group-{g}"] = RemoteRole.options(**common, **cfg.groups.options()).remote(
            f"group-{g}", run_id, argv, env, {})
    factors = cfg.slowdowns + [1.0] * (cfg.run.workers - len(cfg.slowdowns))
    for i in range(cfg.run.workers):
        argv = _argv("worker", address, ["--id", str(i), "--slowdown", str(factors[i])])
        roles[f"worker-{i}"] = RemoteRole.options(**common, **cfg.workers.options()).remote(
            f"worker-{i}", run_id, argv, env, {})
    if cfg.evaluate:
        roles["evaluator"] = RemoteRole.options(**common, **cfg.evaluator.options()).remote(
            "evaluator", run_id, _argv("evaluator", address, []), env, {})
    return roles


def wait_server(roles: dict[str, Any], timeout_s: float) -> int:
    """Until the global server's process exits (across restarts); its exit status."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = ray.get(roles["server"].wait.remote(POLL_S))
        if status is not None:
            return int(status)
    raise TimeoutError(f"the run did not end within {timeout_s:.0f} s")


def collect(roles: dict[str, Any], run_dir: Path) -> list[str]:
    """Wait for the other roles to end, copy every role's files here; the roles that failed."""
    import ray

    failed = []
    for name, actor in roles.items():
        if name != "server" and ray.get(actor.wait.remote(EXIT_TIMEOUT_S)) not in (0,):
            failed.append(name)
    for name in [n for n in roles if n != "server"] + ["server"]:  # the server's files win
        for rel, data in ray.get(roles[name].collect.remote()).items():
            dest = run_dir / ("logs" if rel.endswith(".log") else "") / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        ray.get(roles[name].remove.remote())  # collected: the node's copy may go
    return failed


def stop_roles(roles: dict[str, Any]) -> None:
    """Kill every actor (its child dies with it), never restarting it."""
    import ray

    for actor in roles.values():
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone: nothing left to stop
            pass


def run_ray(cfg: RayConfig) -> dict[str, Any]:
    """Run one training run on Ray; return its summary (``status`` added)."""
    import ray

    cfg.run.validate()
    if cfg.external_groups < 0 or cfg.max_restarts < 0:
        raise ConfigError("--external-groups and --max-restarts must be >= 0")
    run_dir = _make_run_dir(cfg)
    token = os.environ.get("MINIPS_TOKEN") or secrets.token_hex(16)
    (run_dir / "ray.json").write_text(json.dumps(asdict(cfg), indent=2))
    started = not ray.is_initialized()
    if started:
        ray.init(address=cfg.address, log_to_driver=False)
    roles: dict[str, Any] = {}
    status = "done"
    try:
        roles = start_roles(cfg, run_dir.name + "-" + secrets.token_hex(3), token)
        _report(roles)
        if wait_server(roles, cfg.timeout_s or (cfg.run.wall_s or 1800.0) + 120.0) != 0:
            status = "failed"
        failed = collect(roles, run_dir)
        if failed:
            print(f"minips ray: {', '.join(failed)} did not end cleanly; see {run_dir}/logs",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        status = "interrupted"
    except TimeoutError:
        status = "timeout"
    finally:
        stop_roles(roles)
        if started:
            ray.shutdown()
    summary = summarize(run_dir, write=False) if (run_dir / "config.json").exists() else {}
    summary.update(status=status, run_dir=str(run_dir))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"minips ray: {status}; run directory {run_dir}", file=sys.stderr, flush=True)
    return summary


def _report(roles: dict[str, Any]) -> None:
    import ray

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
