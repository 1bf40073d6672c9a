"""The monitor: follows a run's metrics and serves them (dashboard, /metrics, TensorBoard).

One asyncio task in the global server's process (``minips server --dashboard`` /
``--tensorboard``) or in ``minips dashboard RUN_DIR`` (a replay). Every ``TICK_S`` it reads what
the run directory gained (``RunFollower``, or ``Replay`` for a finished run), adds the global
server's live view of its workers (``probe``: groups, clocks, who the SSP bound holds, who is
connected, which covers workers whose metrics files are on other machines) and of the run
(whether an evaluator is connected), writes the new records to TensorBoard and wakes the page's
event streams.

Its credential is its own: beyond loopback the page asks for the dashboard's read-only token
(MINIPS_DASHBOARD_TOKEN, or one made at start and printed once, in the URL), never the
cluster's secret; RUN_DIR/dashboard.url holds the address without any token.

Invariants: the monitor only reads the server's state (never changes it) and does its work
between the server's own tasks, at most once per tick; ``stop`` reads the files one last time,
so the TensorBoard files and the page end with the run's last records.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import secrets
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minips.dashboard.state import Replay, RunFollower, RunState
from minips.dashboard.tboard import TensorBoardSink
from minips.errors import ConfigError
from minips.net.endpoints import (
    DASHBOARD_TOKEN_BYTES,
    DASHBOARD_TOKEN_ENV,
    MIN_SECRET_BYTES,
    format_address,
    is_loopback,
    parse_address,
    run_dashboard_token,
)
from minips.record.rundir import read_config
from minips.server import GlobalServer, InProcGroup

__all__ = ["DEFAULT_PORT", "EXTRA_HINT", "Monitor", "MonitorConfig", "check_extra", "model_size",
           "probe", "serve_replay"]

TICK_S = 0.5  # page refresh and file poll period: live enough to watch, cheap for the server
# at the end, wait this long for the evaluator's record of the final weights (it is written
# after the server let the evaluator go; `minips local` waits for the evaluator anyway)
FINAL_EVAL_WAIT_S = 15.0
DEFAULT_PORT = 8080  # --dashboard HOST without a port
EXTRA_HINT = "pip install 'minips[dashboard]'"


@dataclass
class MonitorConfig:
    """What to serve and where; an empty ``dashboard`` / ``tensorboard`` turns that part off."""

    run_dir: str  # the run directory to follow
    dashboard: str = ""  # HOST:PORT of the page and /metrics ("" = none)
    tensorboard: str = ""  # directory for TensorBoard event files ("" = none)
    # the dashboard's own read-only token the page and /metrics ask for beyond loopback
    # (MINIPS_DASHBOARD_TOKEN, never the cluster's MINIPS_TOKEN); "": one is made at start
    token: str = ""
    insecure: bool = False  # a non-loopback dashboard without a token: open to anyone
    replay_speed: float | None = None  # a finished run at this speed (0 = all at once)


def check_extra() -> None:
    """ConfigError saying how to get the dashboard's packages when they are missing (found,
    not imported: importing them takes a while and is done once the server listens)."""
    for name in ("aiohttp", "prometheus_client"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            raise ConfigError(f"--dashboard needs the dashboard extra ({name} is missing): "
                              f"{EXTRA_HINT}")


def probe(srv: GlobalServer, now: float) -> list[dict[str, Any]]:
    """The global server's view of each worker, as ``probe`` records for ``RunState.add``."""
    core = srv.core
    tables = {g: p.server.core.table for g, p in srv.peers.items()
              if isinstance(p, InProcGroup)}
    clocks = {g: t.clocks for g, t in tables.items()}  # one copy per group, not per worker
    out = []
    for w, e in list(core.workers.items()):
        rec: dict[str, Any] = {"t": now, "worker": w, "group": e.group, "clock": e.clock,
                               "step_time": e.step_time, "iteration_s": e.iteration(),
                               "alive": e.connected and not e.left}
        if w in clocks.get(e.group, {}):  # its group server is in this process
            rec["clock"] = clocks[e.group][w]
            rec["waiting"] = not tables[e.group].may_start(w)
        out.append(rec)
    return out


def model_size(run_dir: str | os.PathLike[str]) -> int | None:
    """The model's coordinates, from the header of a weights file the run directory holds
    (``init.npy``, ``final_weights.npy``); None without one."""
    for name in ("init.npy", "final_weights.npy"):
        try:  # memory-mapped: only the header is read
            return int(np.load(Path(run_dir, name), mmap_mode="r", allow_pickle=False).size)
        except (OSError, ValueError):
            continue
    return None


class Monitor:
    """Follows one run directory; serves the page / metrics and writes TensorBoard files."""

    def __init__(self, cfg: MonitorConfig, server: GlobalServer | None = None) -> None:
        self.cfg = cfg
        self.server = server
        self.replay = Replay(cfg.run_dir, cfg.replay_speed) if cfg.replay_speed is not None \
            else None
        self.state = self.replay.state if self.replay else RunState(
            read_config(cfg.run_dir), kind="live" if server is not None else "following")
        self.follower = None if self.replay else RunFollower(cfg.run_dir, self.state)
        self.state.add("server", {"t": 0.0, "size": model_size(cfg.run_dir)})
        self.t0 = float(self.state.config.get("t0") or time.time())
        self.started = time.monotonic()
        self.tb = TensorBoardSink(cfg.tensorboard, self.t0) if cfg.tensorboard else None
        self.ticker: Any = None
        self.runner: Any = None
        self.url = ""
        self._task: asyncio.Task[None] | None = None
        self._failed = False  # a tick raised (printed once)

    def now(self) -> float:
        """Run time shown: now since t0 (live), or the replay's horizon."""
        if self.replay is not None:
            return self.replay.horizon(time.monotonic() - self.started)
        return time.time() - self.t0

    async def start(self) -> str:
        """Start following (and serving, with a dashboard address); return the page's URL
        (with ``?token=`` when the token was made here: the caller prints it, once)."""
        if self.cfg.dashboard:
            self.url = await self._serve()
        self._task = asyncio.ensure_future(self._loop())
        return self.url

    async def _serve(self) -> str:
        check_extra()
        from minips.dashboard import web  # the extra's packages, imported only when asked

        host, port = parse_address(self.cfg.dashboard, DEFAULT_PORT)
        token, made = self._token(host)
        self.ticker = web.Ticker()
        app = web.make_app(self.state, self.now, self.ticker, token)
        self.runner, port = await web.start_site(app, host, port)
        url = f"http://{format_address(host, port)}/"
        if self.server is not None:  # only the server's own run directory gets the file
            tmp = Path(self.cfg.run_dir, f".dashboard.url.{os.getpid()}")
            tmp.write_text(url + "\n")  # never a token: run directories hold no secret
            os.replace(tmp, tmp.with_name("dashboard.url"))  # readers never see half of it
        return f"{url}?token={token}" if made else url  # a token made here: only we print it

    def _token(self, host: str) -> tuple[str, bool]:
        """The token the page asks for on ``host`` ("" none: loopback, or ``insecure``) and
        whether it was made here. Beyond loopback it is the dashboard's own (``cfg.token``, at
        least ``MIN_SECRET_BYTES``) or, without one, one made here: a live server's from its
        secret and the run's t0 (``run_dashboard_token``: a resume makes the same), else
        ``DASHBOARD_TOKEN_BYTES`` random bytes."""
        if is_loopback(host):
            return "", False
        if self.cfg.token:
            if len(self.cfg.token.encode()) < MIN_SECRET_BYTES:
                raise ConfigError(f"{DASHBOARD_TOKEN_ENV} has {len(self.cfg.token.encode())} "
                                  f"bytes: a dashboard on {host} needs at least "
                                  f"{MIN_SECRET_BYTES}, or unset it to have one made")
            return self.cfg.token, False
        if self.cfg.insecure:
            return "", False
        if self.server is not None and self.server.cfg.token:  # the same after a resume
            return run_dashboard_token(self.server.cfg.token, self.t0), True
        return secrets.token_urlsafe(DASHBOARD_TOKEN_BYTES), True

    async def _loop(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(TICK_S)

    def tick(self) -> None:
        """``step``, where an error is printed (once) instead of raised: a dashboard bug must
        not stop the page, let alone the run."""
        try:
            self.step()
        except Exception:
            if not self._failed:
                traceback.print_exc()
            self._failed = True

    def step(self) -> None:
        """One tick: new records in, probe, TensorBoard, wake the page."""
        if self.replay is not None:
            new = self.replay.poll(time.monotonic() - self.started)
        else:
            assert self.follower is not None
            new = self.follower.poll()
        if self.server is not None:
            for rec in probe(self.server, self.now()):
                self.state.add("probe", rec)
            weights = self.server.core.weights
            self.state.add("server", {"t": self.now(), "evaluator": self.server.has_evaluator(),
                                      "size": None if weights is None else int(weights.size),
                                      # the ledger itself: the page never lags the console
                                      # however far behind the record's tail is followed
                                      "ledger": self.server.figures()})
        if self.tb is not None:
            for src, rec in new:
                self.tb.add(src, rec)
            self.tb.flush()
        if self.ticker is not None:
            self.ticker.tick()

    async def stop(self) -> None:
        """Read the files one last time, end the page's streams and close everything."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.tick()
        deadline = time.monotonic() + FINAL_EVAL_WAIT_S
        while (self.server is not None and self.state.eval and not self.state.final_eval
               and time.monotonic() < deadline):
            await asyncio.sleep(0.1)
            self.tick()
        if self.ticker is not None:
            self.ticker.closed = True
            self.ticker.tick()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.tb is not None:
            self.tb.close()


def serve_replay(run_dir: str, listen: str, *, speed: float | None = 1.0, token: str = "",
                 insecure: bool = False) -> None:
    """`minips dashboard RUN_DIR`: serve a finished run's replay (``speed`` None: follow a run
    directory that is still being written) until interrupted."""
    check_extra()
    if not Path(run_dir).is_dir():
        raise ConfigError(f"no run directory at {run_dir}")

    async def main() -> None:
        monitor = Monitor(MonitorConfig(run_dir=run_dir, dashboard=listen, token=token,
                                        insecure=insecure, replay_speed=speed))
        url = await monitor.start()
        how = "following" if speed is None else f"replaying at {speed:g}x"
        print(f"minips dashboard: {how} {run_dir} on {url}  (Ctrl-C to stop)", flush=True)
        try:
            await asyncio.Event().wait()  # until Ctrl-C cancels the loop
        finally:
            await monitor.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
