"""Global server: admission, grouping, GDTopK ratios, authoritative weights, budget (no torch).

Split by concept: ``roster.py`` (who is in which group, ratios; sans-IO), ``client_sessions.py``
(worker control and evaluator sessions), ``group_sessions.py`` (external group processes),
``server_checkpoint.py`` (snapshot and resume), and ``global_core.py``: the rules without IO
(the weights, ``merge``, the budget, GDTopK's ratios), of which ``GlobalServer`` is the asyncio
shell. This module holds the lifecycle, admission, the grouping I/O and the hooks' IO.

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
import collections
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from minips import (
    checkpoint,
    client_sessions,
    group_sessions,
    protocol,
    run_end,
    server_checkpoint,
    transport,
    validation,
)
from minips.config import (
    ServerConfig,
    check_bind,
    format_address,
    server_ssl,
)
from minips.errors import AuthError, RemoteProtocolError
from minips.exchange import Delta, ExchangeResult
from minips.global_core import GlobalCore
from minips.group import GroupServer
from minips.metrics import RunDir
from minips.roster import GroupHandle, WorkerEntry

__all__ = ["GlobalServer", "GroupHandle", "InProcLink", "WorkerEntry"]

FINAL_FLUSH_S = 10.0  # after `done`, wait this long for the groups' final deltas


class GlobalServer(GlobalCore):
    """The global server's rules (``GlobalCore``) on a port: sessions, grouping, budgets,
    checkpoints (``start`` / ``wait_finished``)."""

    def __init__(self, cfg: ServerConfig, weights: np.ndarray | None = None) -> None:
        self.cfg = cfg
        if not cfg.run.t0:
            cfg.run.t0 = time.time()
        super().__init__(cfg.run, weights, regroup=not cfg.external_groups,
                         clock=time.monotonic, wall=time.time)
        self.pending_groups: list[Any] = []  # channels of external group servers not yet used
        self.rejoin: asyncio.Task[Any] | None = None  # waiting for every worker to come back
        self.finished = asyncio.Event()
        self.evaluated_final = asyncio.Event()
        self.weights_ready = asyncio.Event()
        self.grouped = asyncio.Event()
        self.calib_expired = False  # calib_timeout_s passed: the next STATS forms the groups
        self.groups_opened = asyncio.Event()  # every group has its handle (ch may be None)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.rejected: collections.Counter[str] = collections.Counter()  # ERRORs sent, by code
        self._restored: dict[str, Any] | None = None  # checkpoint state to resume from
        self.saving: asyncio.Future[Any] | None = None  # checkpoint write in flight
        self.server: Any = None
        self.port = 0
        self.rundir = RunDir(cfg.run_dir, t0=self.run.t0)
        self.rundir.write_config(self.run.to_info())
        self.writer = self.rundir.writer("global")
        if self.weights is not None:
            self.weights_ready.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Listen, start the grouping deadline (or reopen the checkpoint's groups); return the
        bound port. Refuses a non-loopback address without a secret unless ``insecure``."""
        check_bind(self.cfg.host, self.cfg.token, self.cfg.insecure)  # group servers' host too
        ssl = server_ssl(self.cfg.tls_cert, self.cfg.tls_key)
        self.server = await transport.serve(self.cfg.host, self.cfg.port, token=self.cfg.token,
                                            accept=self._accept, handler=self._handle, ssl=ssl)
        self.port = int(self.server.port)
        server_checkpoint.clean(self)  # temp files of writes killed midway
        if self._restored is not None:
            await server_checkpoint.reopen(self, self._restored)
        else:
            self.spawn(self._grouping_deadline())
        if self.cfg.ready_file:
            _write_atomic(self.cfg.ready_file, f"{self.cfg.host} {self.port}\n")
        return self.port

    async def wait_finished(self) -> None:
        """Until the run is over and (if one is connected) the evaluator saw the final weights."""
        await self.finished.wait()
        if self._has_evaluator():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.evaluated_final.wait(), self.cfg.linger_s)

    async def close(self) -> None:
        """Save the final weights and a last checkpoint, close every connection and group."""
        if self.weights is not None:
            np.save(Path(self.cfg.run_dir) / "final_weights.npy", self.weights)
        if self.saving is not None:
            await asyncio.gather(self.saving, return_exceptions=True)
        if self.grouped.is_set() and self.cfg.checkpoint_every_s > 0:
            checkpoint.save(self.checkpoint_path, self.checkpoint_state())
        for g in self.groups.values():
            if g.server is not None:
                await g.server.close()
        for t in list(self._tasks):
            t.cancel()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
        self.writer.close()

    # -- admission ---------------------------------------------------------------------------

    def _accept(self, hello: Any) -> dict[str, Any]:
        info = self.run.to_info()
        if hello.role == "worker":
            info["worker_id"] = self.roster.admit(int(hello.worker_id), time.monotonic())
            info["need_init"] = self.weights is None
        elif hello.role == "group" and not self.cfg.external_groups:
            raise AuthError("this server runs its group servers in-process (no --external-groups)")
        return info

    async def _handle(self, ch: Any) -> None:
        role = ch.peer_hello.role
        try:
            if role == "worker":
                await client_sessions.worker_session(self, ch, int(ch.worker_id))
            elif role == "group":
                await group_sessions.group_session(self, ch)
            else:
                await client_sessions.evaluator_session(self, ch)
        except RemoteProtocolError as exc:
            await validation.reject(ch, exc, self.rejected, "global server")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass

    # -- workers -----------------------------------------------------------------------------

    def on_stats(self, entry: WorkerEntry, msg: Any) -> None:
        """A worker's measured speed: form the groups, place it, regroup or update ratios."""
        entry.step_time, entry.clock = float(msg.step_time), int(msg.clock)
        if not self.grouped.is_set():
            if self.calib_expired or self.roster.all_reported():
                self.spawn(self._form_groups())
        elif entry.group < 0:
            self.spawn(self._place_late(entry))
        elif (new := self.roster.maybe_regroup(time.monotonic())) is not None:
            self.spawn(self._regroup(new))
        else:
            self._update_ratios()

    async def _grouping_deadline(self) -> None:
        """After calib_timeout_s, group whoever reported; with nobody yet, the first STATS will
        (on_stats), so a server started before its workers does not wait for all of them."""
        await asyncio.sleep(self.cfg.calib_timeout_s)
        if self.grouped.is_set():
            return
        self.calib_expired = True
        reported = sorted(self.roster.step_times())
        self.log("calib_timeout", reported=reported, expected=self.run.workers)
        if reported:
            await self._form_groups()

    async def _place_late(self, entry: WorkerEntry) -> None:
        """A worker whose first STATS came after the groups were drawn up: once they are open,
        the group nearest its speed."""
        await self.groups_opened.wait()
        if entry.group < 0:
            await self.assign(entry, self.roster.place_late(entry))

    # -- grouping ----------------------------------------------------------------------------

    async def _form_groups(self) -> None:
        if self.grouped.is_set():
            return
        self.grouped.set()
        await self.weights_ready.wait()
        times = self.roster.step_times()
        assignment = self.roster.first_assignment()
        self.roster.first_ratios(assignment, time.monotonic())  # open_group takes ratio_of(g)
        for g in sorted(set(assignment.values())):
            members = sorted(w for w, gg in assignment.items() if gg == g)
            self.groups[g] = await self.open_group(g, members)
            self.groups[g].step_time = float(np.mean([times[w] for w in members]))
        self.started_training = time.time()
        for w, g in assignment.items():  # before groups_opened: _place_late skips them
            self.workers[w].group = g
        self.log("groups", assignment={str(w): g for w, g in assignment.items()},
                  ratios={str(g): h.ratio for g, h in self.groups.items()},
                  addresses={str(g): h.address for g, h in self.groups.items()})
        self.groups_opened.set()
        for w, g in assignment.items():
            await self.assign(self.workers[w], g)
        self.start_budgets()

    def start_budgets(self) -> None:
        if self.run.wall_s > 0:
            self.spawn(self._wall_budget())
        if self.cfg.checkpoint_every_s > 0:
            self.spawn(server_checkpoint.save_loop(self))

    async def open_group(self, g: int, members: list[int]) -> GroupHandle:
        assert self.weights is not None
        if self.cfg.external_groups:
            return await group_sessions.external_group(self, g, members)
        writer = self.rundir.writer(f"group-{g}")
        gs = GroupServer(g, self.run, self.weights, InProcLink(self), members=members,
                         writer=writer)
        gs.ratio = self.roster.ratio_of(g)
        port = await gs.serve(self.cfg.host, 0, self.cfg.token,
                              server_ssl(self.cfg.tls_cert, self.cfg.tls_key))
        # no host (":port"): "where you reached the global server"; the worker fills in the name
        # it dialled, so DNS names, NAT and TLS names work as they do for the global server
        address = format_address(self.cfg.advertise_host or "", port)
        return GroupHandle(g, address, members, gs.ratio, server=gs)

    async def _regroup(self, assignment: dict[int, int]) -> None:
        """Speeds drifted (``grouping.Regrouper`` said so): move workers, open new groups."""
        assert self.weights is not None
        moved = self.roster.moved(assignment)
        for g in sorted(set(moved.values()) - set(self.groups)):
            self.groups[g] = await self.open_group(g, [])
        for w, g in moved.items():
            self.roster.move(w, g)
        self.log("regroup", moved={str(w): g for w, g in moved.items()})
        self._update_ratios()
        for w, g in moved.items():
            await self.assign(self.workers[w], g)

    def assign_msg(self, h: GroupHandle) -> Any:
        return protocol.Assign(group=h.id, address=h.address, ratio=h.ratio,
                               staleness=_staleness(self.run))

    async def assign(self, entry: WorkerEntry, g: int) -> None:
        entry.group = g
        if entry.ch is not None and self.groups[g].address:  # "": its group server is away
            with contextlib.suppress(ConnectionError):
                await entry.ch.send(self.assign_msg(self.groups[g]))

    def on_ratios(self, new: dict[int, float]) -> None:
        """Hand each new ratio to its group server (in-process: its attribute; a `minips group`:
        a new ASSIGN) and send every worker of those groups a new ASSIGN carrying its ratio."""
        for g in new:
            h = self.groups[g]
            if h.server is not None:
                h.server.ratio = h.ratio
            elif h.ch is not None:
                self.spawn(_send_quiet(h.ch, self.assign_msg(h)))
        for entry in self.workers.values():
            if entry.group in new:
                self.spawn(self.assign(entry, entry.group))

    def on_all_final(self) -> None:
        run_end.every_group_final(self)

    def on_diverged(self, reason: str) -> None:
        run_end.fail(self, "diverged", reason)

    async def _wall_budget(self) -> None:
        await asyncio.sleep(max(0.0, self.run.wall_s - self.trained_s()))
        self.finish("wall time")

    def on_done(self) -> None:
        """Budget spent: tell groups and workers, then wait (bounded) for the final deltas."""
        for h in self.groups.values():
            if h.server is not None:
                h.server.finish()
            elif h.ch is not None:
                self.spawn(_send_quiet(h.ch, protocol.Leave(reason="done")))
        for entry in self.workers.values():
            if entry.ch is not None:
                self.spawn(_send_quiet(entry.ch, protocol.Leave(reason="done")))
        self.spawn(self._final_flush())

    async def _final_flush(self) -> None:
        """Wait at most FINAL_FLUSH_S for the groups' final deltas: every place that marks a
        group final calls check_budget, which sets ``finished`` once all of them are."""
        if not all(h.final for h in self.groups.values()):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.finished.wait(), FINAL_FLUSH_S)
        self.finished.set()

    # -- traffic, evaluator ------------------------------------------------------------------

    def _has_evaluator(self) -> bool:
        return self.server is not None and any(
            ch.peer_hello is not None and ch.peer_hello.role == "evaluator"
            for ch in self.server.channels)


    # -- checkpoints (server_checkpoint.py, checkpoint.py, docs/operations.md) ----------------

    @property
    def checkpoint_path(self) -> Path:
        return server_checkpoint.path_of(self)

    def checkpoint_state(self) -> dict[str, Any]:
        """A consistent snapshot (no await inside); see ``server_checkpoint.snapshot``."""
        return server_checkpoint.snapshot(self)

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state (before ``start``); ``ConfigError`` when it belongs to
        another model or config."""
        server_checkpoint.restore(self, state)
        self._restored = state

    async def save_checkpoint(self) -> None:
        """Snapshot now and write it in a thread (the loop keeps serving)."""
        await server_checkpoint.save(self)

    # -- helpers -----------------------------------------------------------------------------

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def log(self, event: str, **fields: Any) -> None:
        self.writer.write({"t": time.time() - self.run.t0, "event": event, **fields,
                           "version": self.version, "samples": self.samples, **self.traffic()})


class InProcLink:
    """GroupLink for a group server in the global server's process: a direct call. Its bytes
    are those of the PUSH and WEIGHTS a `minips group` process would exchange instead."""

    def __init__(self, server: GlobalServer) -> None:
        self.server = server

    async def exchange(self, group: int, delta: Delta,
                       stats: dict[str, Any]) -> ExchangeResult:
        return self.server.merge_counted(group, delta, stats)


def _staleness(run: Any) -> int:
    s = run.staleness_bound
    return -1 if s is None else int(s)


async def _send_quiet(ch: Any, msg: Any) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        await ch.send(msg)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(text)
    os.replace(tmp, path)
