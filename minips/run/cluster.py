"""The child processes of one `minips local` run: the global server, the workers and the
evaluator, each `python -m minips ROLE` in a session of its own, with their logs in
``<run dir>/logs``; the links' shaping (``netshape.plan``) around them.

Invariants: every child runs in its own session, so Ctrl-C reaches the launcher only; ``stop``
sends SIGTERM to each child's session, SIGKILL after ``grace_s``. No child outlives its launcher
by any signal, SIGKILL included (``lifeline.py``: each child watches it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from minips.errors import MiniPSError
from minips.net import lifeline, links, netshape
from minips.run.config import LaunchConfig
from minips.run.progress import ProgressLine

__all__ = ["Cluster", "WorkersFailed", "READY_TIMEOUT_S", "EXIT_TIMEOUT_S"]

READY_TIMEOUT_S = 60.0  # the server must be listening within this long
EXIT_TIMEOUT_S = 30.0  # after the server exits, workers and evaluator get this long to leave
PROGRESS_PERIOD_S = 0.5  # progress line refresh


class WorkersFailed(MiniPSError):
    """Every worker of a local run exited, some with an error, while the server waits."""


class Cluster:
    """The child processes of one local run."""

    def __init__(self, cfg: LaunchConfig, run_dir: Path, token: str,
                 link: links.LinkProfile | None = None) -> None:
        self.cfg = cfg
        self.link = link  # the workers' links (--link), None: not limited
        self.shaping = "none"  # how they are shaped: none | kernel | pacer
        self.spaces: netshape.Namespaces | None = None  # the namespaces of kernel shaping
        self.run_dir = run_dir
        # children die with the launcher, by any signal (lifeline.py)
        self.env = lifeline.child_env({**os.environ, "MINIPS_TOKEN": token,
                                       "PYTHONUNBUFFERED": "1"})
        self.logs = run_dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.server: subprocess.Popen[bytes] | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}  # "server", "worker-0", ...
        self.address = ""

    def _spawn(self, name: str, args: list[str], netns: int = -1) -> subprocess.Popen[bytes]:
        """``minips ARGS`` as a child (in worker ``netns``'s namespace when >= 0)."""
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        argv = [sys.executable, "-m", "minips", *args]
        if netns >= 0 and self.spaces is not None:
            argv = self.spaces.command(netns, argv)  # ip netns exec: execs, stays our child
        proc = subprocess.Popen(argv, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()  # the child holds its own descriptor
        self.children[name] = proc
        return proc

    def shape(self) -> None:
        """Set up the links' shaping (before any child starts) and write link.json."""
        self.shaping, self.spaces = netshape.plan(self.link, self.cfg.run.workers,
                                                  self.cfg.link_shaping)
        if self.link is not None:
            record = self.link.record(self.cfg.run.workers, self.shaping)
            (self.run_dir / "link.json").write_text(json.dumps(record) + "\n")

    def unshape(self) -> None:
        """Remove the namespaces and veth pairs (after the children stopped)."""
        if self.spaces is not None:
            self.spaces.remove()
            self.spaces = None

    def start_server(self, init: Path) -> str:
        """Start the global server on a free port; return its "host:port"."""
        (self.run_dir / "run.json").write_text(json.dumps(self.cfg.run.to_info()))
        ready = self.run_dir / "server.addr"
        ready.unlink(missing_ok=True)
        (self.run_dir / "dashboard.url").unlink(missing_ok=True)  # not a URL of an earlier run
        watch = [f"--{k}={v}" for k in ("dashboard", "tensorboard") if (v := getattr(self.cfg, k))]
        self.server = self._spawn("server", [
            "server", "--host", self.spaces.server_host if self.spaces else "127.0.0.1",
            "--port", "0", "--run-dir", str(self.run_dir),
            "--run-config", str(self.run_dir / "run.json"), "--init", str(init),
            "--ready-file", str(ready), "--quiet", *watch])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise MiniPSError(f"the server did not start; see {self.logs / 'server.log'}")
            time.sleep(0.05)
        host, port = ready.read_text().split()
        self.address = f"{host}:{port}"
        return self.address

    def announce_dashboard(self) -> None:
        """Print the dashboard's URL once the server wrote it (it starts after the ready file)."""
        url_file = self.run_dir / "dashboard.url"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not url_file.exists():
            if self.server is None or self.server.poll() is not None \
                    or time.monotonic() > deadline:
                return  # the server's log says why; the run's end reports it
            time.sleep(0.05)
        url = url_file.read_text().strip()
        print(f"minips local: dashboard at {url}", file=sys.stderr, flush=True)

    def start_workers(self) -> None:
        """All workers at once (they calibrate while the others import torch)."""
        for i, factor in enumerate(self.cfg.factors()):
            self._spawn(f"worker-{i}", [
                "worker", "--connect", self.address, "--id", str(i), "--slowdown", str(factor),
                *self._link_args(i), "--run-dir", str(self.run_dir), "--timeout", "60",
                "--device", self.cfg.device(i), *(["--amp"] if self.cfg.amp else [])],
                netns=i if self.spaces else -1)

    def _link_args(self, worker: int) -> list[str]:
        """Worker flags of its link: the latency, and the pacer's rates (bytes/s) when the
        workers pace their links themselves."""
        if self.link is None:
            return []
        args = ["--latency", repr(self.link.latency_s)] if self.link.latency_s else []
        if self.shaping == "pacer":
            rate = self.link.rate(worker)
            args += ["--bandwidth", repr(rate.up_bps / 8), "--bandwidth-down",
                     repr(rate.down_bps / 8)]
        return args

    def start_evaluator(self) -> None:
        self._spawn("evaluator", ["evaluator", "--connect", self.address,
                                  "--run-dir", str(self.run_dir), "--timeout", "60"])

    def wait(self, timeout_s: float, progress: bool) -> int:
        """Until the server exits (its return code) or ``timeout_s`` passes (TimeoutError)."""
        assert self.server is not None
        line = ProgressLine(self.run_dir, self.cfg) if progress else None
        deadline = time.monotonic() + timeout_s
        while self.server.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run still going after {timeout_s:.0f} s")
            self._check_workers()
            if line is not None:
                line.draw()
            time.sleep(PROGRESS_PERIOD_S)
        if line is not None:
            line.draw(final=True)
        return int(self.server.returncode)

    def _check_workers(self) -> None:
        """Every worker exited, one at least with an error: nobody will rejoin (the server
        would wait --rejoin-wait for them); ``WorkersFailed`` ends the run now."""
        workers = {n: p for n, p in self.children.items() if n.startswith("worker-")}
        if workers and all(p.poll() is not None for p in workers.values()):
            failed = sorted(n for n, p in workers.items() if p.returncode)
            if failed:
                raise WorkersFailed(f"{', '.join(failed)} exited with an error; see their logs "
                                    f"in {self.logs}")

    def collect(self, timeout_s: float = EXIT_TIMEOUT_S) -> list[str]:
        """Give the other children ``timeout_s`` to exit on their own; return the names of
        those that exited with an error (their logs say why)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [name for name, proc in self.children.items() if proc.poll()]

    def stop(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after ``grace_s``."""
        live = [p for p in self.children.values() if p.poll() is None]
        for p in live:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.wait()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child's session: the child and anything it started
    except ProcessLookupError:
        pass
