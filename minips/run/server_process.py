"""`minips server`'s process: a ``GlobalServer`` (fresh, or resumed from its checkpoint) served
until its run is over, with the dashboard / TensorBoard monitor and an evaluator child when
asked.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from minips.errors import ConfigError
from minips.net import lifeline, transport
from minips.run import checkpoint
from minips.run.config import WILDCARD_HOSTS, ServerConfig
from minips.server import GlobalServer

__all__ = ["serve_run", "run_server"]


async def serve_run(cfg: ServerConfig, *, announce: bool = True,
                    spawn_evaluator: bool = False) -> GlobalServer:
    """Run a global server until its run is over; return it (closed) for inspection.
    With ``cfg.resume`` it starts from the checkpoint (refused if from another config)."""
    srv = _make_server(cfg)
    port = await srv.start()
    try:  # after the ready file: importing the dashboard's packages does not delay workers
        monitor = await _start_monitor(cfg, srv)
    except BaseException:  # e.g. its port is taken: the error ends the server, cleanly
        await srv.close()
        raise
    if announce:
        _announce(cfg, port)
    child = _spawn_evaluator(cfg, port) if spawn_evaluator else None
    try:
        await srv.wait_finished()
    finally:
        await srv.close()
        if monitor is not None:
            await monitor.stop()
        if child is not None:
            await asyncio.get_running_loop().run_in_executor(None, _reap, child)
    return srv


async def _start_monitor(cfg: ServerConfig, srv: GlobalServer) -> Any:
    """The dashboard / TensorBoard monitor of ``--dashboard`` / ``--tensorboard``, or None."""
    if not (cfg.dashboard or cfg.tensorboard):
        return None
    from minips.dashboard import Monitor, MonitorConfig

    monitor = Monitor(MonitorConfig(run_dir=cfg.run_dir, dashboard=cfg.dashboard,
                                    tensorboard=cfg.tensorboard, token=cfg.token,
                                    insecure=cfg.insecure), srv)
    url = await monitor.start()
    if url:
        print(f"minips server: dashboard at {url}  (Prometheus: {url.split('?')[0].rstrip('/')}"
              f"/metrics)", flush=True)
    return monitor


def _make_server(cfg: ServerConfig) -> GlobalServer:
    if not cfg.resume:
        return GlobalServer(cfg, np.load(cfg.init_path) if cfg.init_path else None)
    state = checkpoint.load(cfg.checkpoint_path or Path(cfg.run_dir) / "checkpoint.npz")
    checkpoint.check_compatible(state, cfg.run.to_info(), np.asarray(state["weights"]).size)
    cfg.run.t0 = float(state["t0"])  # metrics keep one time axis across the restart
    srv = GlobalServer(cfg, None)
    srv.restore(state)
    return srv


def _announce(cfg: ServerConfig, port: int) -> None:
    host = cfg.host if cfg.host not in WILDCARD_HOSTS else "<this-host>"
    print(f"minips server listening on {cfg.host}:{port} ({cfg.run.mode}, "
          f"{cfg.run.compressor}, waiting for {cfg.run.workers} workers)\n"
          f"  join with:  MINIPS_TOKEN=... minips worker --connect {host}:{port}\n"
          f"  group:      MINIPS_TOKEN=... minips group --connect {host}:{port} "
          f"--listen <this-host>:7071", flush=True)


def run_server(cfg: ServerConfig, *, spawn_evaluator: bool = False,
               announce: bool = True) -> GlobalServer:
    """`minips server`: serve one run (optionally with an evaluator child process); return
    the closed server (``failure`` says whether the run ended short)."""
    if spawn_evaluator and cfg.tls_cert:
        raise ConfigError("--eval cannot be used with --tls-cert: the evaluator child would have "
                          "to verify the certificate by a name this machine resolves; start "
                          "'minips evaluator --connect NAME:PORT --tls-ca CA' instead")
    transport.install_uvloop()
    return asyncio.run(serve_run(cfg, announce=announce, spawn_evaluator=spawn_evaluator))


def _spawn_evaluator(cfg: ServerConfig, port: int) -> subprocess.Popen[bytes]:
    host = "127.0.0.1" if cfg.host in WILDCARD_HOSTS else cfg.host
    cmd = [sys.executable, "-m", "minips", "evaluator", "--connect", f"{host}:{port}",
           "--run-dir", cfg.run_dir, "--timeout", "30"]
    return subprocess.Popen(cmd, env=lifeline.child_env())


def _reap(child: subprocess.Popen[bytes]) -> None:
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
