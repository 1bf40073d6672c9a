"""The Ray actor of `minips ray`: one minips role (server, group, worker, evaluator) as a child
process on the node Ray placed the actor on (imports ray; only `minips ray` imports this module).

Ray places the actor and restarts it when it dies; the role itself is the ordinary `minips`
command, so roles talk to each other over minips' own TCP protocol with its HMAC handshake (and
TLS when configured), exactly as when started by hand. Ray carries no training traffic.

Invariants:
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
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

__all__ = ["RoleActor", "MAX_COLLECT_BYTES"]

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
