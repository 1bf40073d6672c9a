"""Global server: admission, grouping, GDTopK ratios, authoritative weights, budget (no torch).

Split by concept: ``global_core.py`` holds the rules without IO (the weights, ``merge``, the
grouping decisions, the budget, GDTopK's ratios, the checkpoint's state), ``roster.py`` who is
in which group; ``GlobalServer`` is their asyncio shell: it feeds the core messages and ticks and
performs the actions it returns (``global_core.py``). The sessions are ``client_sessions.py``
(workers' control channels, evaluators) and ``group_sessions.py`` (`minips group` processes),
sharing ``server_io.ServerIO``; ``server_checkpoint.py`` writes the checkpoint files and
``run_end.py`` ends a run. A group's server is a ``group_peer.GroupPeer``: ``InProcGroup`` here,
``group_sessions.RemoteGroup`` for a group process; the server never asks which.

One asyncio process. Clients connect with role ``worker`` (control channel: STATS, HEARTBEAT,
LEAVE; learns its group from ASSIGN), ``group`` (a separate `minips group` process: PUSH its
delta, get WEIGHTS) or ``evaluator`` (PULL the global weights every few seconds).

A run goes: workers connect and report their calibrated step time (STATS at clock 0); when all
``run.workers`` reported (or ``calib_timeout_s`` passed: at once if anyone reported, else at the
first STATS after it; a later worker is placed after its first STATS) the server clusters the
step times into groups (one group for bsp/ssp/asp, ``grouping.assign_groups`` for gssp), starts one
``GroupServer`` per group on its own port (or hands the groups to the connected external group
servers) and sends every worker ASSIGN(group address, ratio, staleness). Later STATS update the
group step times. GDTopK: every exchange reports its group's measured iteration time
(``iter_time``); the ratio policy (``compress.ratios``) turns these into new ratios, at most once a
second and only for a change worth it, which go to the group servers and, as a new ASSIGN, to
their workers (logged as a ``ratios`` event).

Invariants: ``weights`` changes only in ``merge`` (weights += delta of one group, version += 1;
with ``merge="mean"`` the delta is divided by the number of groups k, so k groups together move
the weights as far as one group would: GSSP then compares with SSP at one learning rate), so the
global weights are the initial weights plus every delta any group sent (scaled). Once the budget is
spent (``done``) merges still land — nothing sent is lost — and the run ends when every group
has flushed its final delta (or a grace period passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips.core import global_core
from minips.core.config import RunConfig
from minips.core.exchange import Delta, ExchangeResult
from minips.core.global_core import GlobalCore
from minips.core.roster import GroupHandle
from minips.errors import AuthError, RemoteProtocolError
from minips.net import transport
from minips.net.channel import Channel
from minips.net.endpoints import check_bind, format_address, server_ssl
from minips.record import checkpoint
from minips.record.rundir import RunDir
from minips.serve import (
    client_sessions,
    group_sessions,
    run_end,
    server_checkpoint,
    server_groups,
    validation,
)
from minips.serve.group import GroupServer
from minips.serve.inproc_group import InProcGroup
from minips.serve.server_io import ServerIO, send_quiet
from minips.wire import messages
from minips.wire.messages import Hello

__all__ = [
    "GlobalServer",
    "InProcLink",
    "ServerConfig",
]

FINAL_FLUSH_S = 10.0  # after `done`, wait this long for the groups' final deltas


class GlobalServer(GlobalCore):
    """The global server's rules (``GlobalCore``) on a port: sessions, grouping, budgets,
    checkpoints (``start`` / ``wait_finished``); ``io`` is what its sessions share."""

    def __init__(self, cfg: ServerConfig, weights: np.ndarray | None = None) -> None:
        self.cfg = cfg
        if not cfg.run.t0:
            cfg.run.t0 = time.time()
        super().__init__(cfg.run, weights, regroup=not cfg.external_groups,
                         clock=time.monotonic, wall=time.time)
        self.io = ServerIO(cfg, self, self.perform, self.open_group)
        self._restored: dict[str, Any] | None = None  # checkpoint state to resume from
        self.server: transport.Server | None = None
        self.port = 0
        self._ssl: Any = None  # the TLS context (start), shared with in-process group servers
        self.rundir = RunDir(cfg.run_dir, t0=self.run.t0)
        self.rundir.write_config(self.run.to_info())
        self.writer = self.rundir.writer("global")

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Listen, start the grouping deadline (or reopen the checkpoint's groups); return the
        bound port. Refuses a non-loopback address without a secret unless ``insecure``."""
        check_bind(self.cfg.host, self.cfg.token, self.cfg.insecure)  # group servers' host too
        self._ssl = server_ssl(self.cfg.tls_cert, self.cfg.tls_key)
        self.server = await transport.serve(self.cfg.host, self.cfg.port, token=self.cfg.token,
                                            accept=self._accept, handler=self._handle,
                                            ssl=self._ssl)
        self.port = int(self.server.port)
        server_checkpoint.clean(self.io)  # temp files of writes killed midway
        if self._restored is not None:
            await server_groups.reopen(self.io, self._restored)
        else:
            self.io.spawn(self._grouping_deadline())
        if self.cfg.ready_file:
            _write_atomic(self.cfg.ready_file, f"{self.cfg.host} {self.port}\n")
        return self.port

    async def wait_finished(self) -> None:
        """Until the run is over and (if one is connected) the evaluator saw the final weights."""
        await self.io.finished.wait()
        if self._has_evaluator():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.io.evaluated_final.wait(), self.cfg.linger_s)

    async def close(self) -> None:
        """Save the final weights and a last checkpoint, close every connection and group."""
        if self.weights is not None:
            np.save(Path(self.cfg.run_dir) / "final_weights.npy", self.weights)
        if self.io.saving is not None:
            await asyncio.gather(self.io.saving, return_exceptions=True)
        if self.grouped and self.cfg.checkpoint_every_s > 0:
            checkpoint.save(self.checkpoint_path, self.checkpoint_state())
        for g in self.groups.values():
            await g.peer.close()
        for t in list(self.io.tasks):
            t.cancel()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
        self.writer.close()

    # -- admission ---------------------------------------------------------------------------

    def _accept(self, hello: Hello) -> dict[str, Any]:
        info = self.run.to_info()
        if hello.role == "worker":
            info["worker_id"] = self.roster.admit(int(hello.worker_id), time.monotonic())
            info["need_init"] = self.weights is None
        elif hello.role == "group" and not self.cfg.external_groups:
            raise AuthError("this server runs its group servers in-process (no --external-groups)")
        return info

    async def _handle(self, ch: Channel) -> None:
        assert ch.peer_hello is not None
        role = ch.peer_hello.role
        try:
            if role == "worker":
                await client_sessions.worker_session(self.io, ch, int(ch.worker_id))
            elif role == "group":
                await group_sessions.group_session(self.io, ch)
            else:
                await client_sessions.evaluator_session(self.io, ch)
        except RemoteProtocolError as exc:
            await validation.reject(ch, exc, self.io.rejected, "global server")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass

    # -- the core's actions ------------------------------------------------------------------

    def perform(self, actions: list[global_core.Action]) -> None:
        """Do what the core decided (``global_core.py``), in order."""
        for a in actions:
            if isinstance(a, global_core.FormGroups):
                self.io.spawn(server_groups.form_groups(self.io))
            elif isinstance(a, global_core.PlaceLate):
                self.io.spawn(server_groups.place_late(self.io, self.workers[a.worker]))
            elif isinstance(a, global_core.Regroup):
                self.io.spawn(server_groups.regroup(self.io, a.assignment))
            elif isinstance(a, global_core.SendRatios):
                server_groups.send_ratios(self.io, a.ratios)
            elif isinstance(a, global_core.WeightsReady):
                self.io.weights_ready.set()
            elif isinstance(a, global_core.Done):
                self._on_done()
            elif isinstance(a, global_core.AllFinal):
                run_end.every_group_final(self.io)
            elif isinstance(a, global_core.Fail):
                run_end.fail(self.io, a.code, a.reason)

    async def _grouping_deadline(self) -> None:
        await asyncio.sleep(self.cfg.calib_timeout_s)
        self.perform(self.calib_timeout(time.monotonic()))

    async def open_group(self, g: int, members: list[int]) -> GroupHandle:
        """Group ``g``'s server: in this process on a port of its own, or the next waiting
        `minips group` process (``--external-groups``)."""
        assert self.weights is not None
        if self.cfg.external_groups:
            return await group_sessions.external_group(self.io, g, members)
        writer = self.rundir.writer(f"group-{g}")
        gs = GroupServer(g, self.run, self.weights, InProcLink(self), members=members,
                         writer=writer)
        gs.ratio = self.roster.ratio_of(g)
        port = await gs.serve(self.cfg.host, 0, self.cfg.token, self._ssl)
        # no host (":port"): "where you reached the global server"; the worker fills in the name
        # it dialled, so DNS names, NAT and TLS names work as they do for the global server
        address = format_address(self.cfg.advertise_host or "", port)
        return GroupHandle(g, address, members, peer=InProcGroup(gs))

    def _on_done(self) -> None:
        """Budget spent: tell groups and workers, then wait (bounded) for the final deltas."""
        for h in self.groups.values():
            self.io.spawn(h.peer.finish())
        for entry in self.workers.values():
            if entry.ch is not None:
                self.io.spawn(send_quiet(entry.ch, messages.Leave(reason="done")))
        self.io.spawn(self._final_flush())

    async def _final_flush(self) -> None:
        """Wait at most FINAL_FLUSH_S for the groups' final deltas: once all are final the
        core says ``AllFinal``, which sets ``finished``."""
        if not all(h.final for h in self.groups.values()):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.io.finished.wait(), FINAL_FLUSH_S)
        self.io.finished.set()

    def _has_evaluator(self) -> bool:
        return self.server is not None and any(
            ch.peer_hello is not None and ch.peer_hello.role == "evaluator"
            for ch in self.server.channels)

    # -- checkpoints (global_core.py, server_checkpoint.py, docs/operations.md) --------------

    @property
    def checkpoint_path(self) -> Path:
        return server_checkpoint.path_of(self.cfg)

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state (before ``start``, which opens its groups again);
        ``ConfigError`` when it belongs to another model or config."""
        self.load_state_dict(state)
        self.io.weights_ready.set()
        self._restored = state

    async def save_checkpoint(self) -> None:
        """Snapshot now and write it in a thread (the loop keeps serving)."""
        await server_checkpoint.save(self.io)

    def log(self, event: str, **fields: Any) -> None:
        self.writer.write({"t": time.time() - self.run.t0, "event": event, **fields,
                           "version": self.version, "samples": self.samples, **self.traffic()})


class InProcLink:
    """The uplink (``exchange.GroupLink``) of a group server in this process: a direct call.
    Its bytes are those of the PUSH and WEIGHTS a `minips group` process would exchange."""

    def __init__(self, server: GlobalServer) -> None:
        self.server = server

    async def exchange(self, group: int, delta: Delta,
                       stats: dict[str, Any]) -> ExchangeResult:
        res = self.server.merge_counted(group, delta, stats)
        self.server.perform(self.server.take_actions())
        return res


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


@dataclass
class ServerConfig:
    """The global server process."""

    run: RunConfig = field(default_factory=RunConfig)  # the run it serves
    host: str = "127.0.0.1"  # listen address
    port: int = 7070  # listen port; 0 = any free port
    token: str = ""  # shared secret (MINIPS_TOKEN)
    tls_cert: str | None = None  # PEM certificate file; None = plain TCP
    tls_key: str | None = None  # PEM key file for tls_cert
    run_dir: str = "runs/server"  # where metrics, config.json and final weights go
    init_path: str | None = None  # .npy initial flat weights; None = take them from a worker
    external_groups: int = 0  # group servers expected as separate processes; 0 = in-process
    # host told to workers for in-process group servers (they listen on ``host``); None: the host
    # each worker reached this server at (ASSIGN carries ":port")
    advertise_host: str | None = None
    calib_timeout_s: float = 60.0  # group the workers that reported after this long
    ready_file: str | None = None  # write "host port" here once listening (launcher)
    linger_s: float = 15.0  # after the budget, wait this long for the final evaluator pull
    rejoin_wait_s: float = 120.0  # every worker gone with budget left: wait this long for them
    checkpoint_path: str | None = None  # checkpoint file; None = <run_dir>/checkpoint.npz
    checkpoint_every_s: float = 30.0  # seconds between checkpoints; 0 = none
    resume: bool = False  # start from checkpoint_path instead of init_path / a worker
    insecure: bool = False  # allow a non-loopback listen address without a secret
    dashboard: str = ""  # HOST:PORT of the live web dashboard and /metrics; "" = none
    tensorboard: str = ""  # directory for TensorBoard event files; "" = none
