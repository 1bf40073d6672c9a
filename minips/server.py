"""Global server: admission, grouping, GDTopK ratios, authoritative weights, budget (no torch).

Split by concept: ``global_core.py`` holds the rules without IO (the weights, ``merge``, the
grouping decisions, the budget, GDTopK's ratios, the checkpoint's state), ``roster.py`` who is
in which group; ``GlobalServer`` is their asyncio shell: it *holds* a ``GlobalCore`` (``core``),
feeds it messages and ticks and performs the actions it returns (``global_core.py``): it opens
the groups, tells workers their group, ends the run, writes the record and the checkpoint
files. It never writes the core's fields. The sessions are ``serve/sessions.py`` (workers'
control channels, evaluators, `minips group` processes). It holds each group's server, a
``peers.GroupPeer`` (``peers``): ``InProcGroup`` here, ``sessions.RemoteGroup`` for a group
process; the server never asks which. It owns the run's figures (``record/ledger.py``) and hands
the core the worker traffic with the events that need it (``traffic``).

One asyncio process. Clients connect with role ``worker`` (control channel: STATS, HEARTBEAT,
LEAVE; learns its group from ASSIGN), ``group`` (a separate `minips group` process: EXCHANGE its
delta, get EXCHANGE_REPLY; refused at the handshake unless it serves its workers TLS exactly
when this server does, HELLO capability ``tls``) or ``evaluator`` (PULL the global weights
every few seconds).

A run goes: workers connect and report their calibrated step time (STATS at clock 0); when all
``run.workers`` reported (or ``calib_timeout_s`` passed since the first worker joined: at once
if anyone reported, else at the first STATS after it; a later worker is placed after its first
STATS, a ``placed`` record and a console line) the server clusters the step times into
groups (one group for bsp/ssp/asp, ``grouping.assign_groups`` for gssp), starts one
``GroupServer`` per group on its own port (or hands the groups to the connected external group
servers) and sends every worker ASSIGN(group address, ratio, staleness). Later STATS update the
group step times. GDTopK: every exchange reports its group's measured iteration time
(``iter_time``); the ratio policy (``compress.ratios``) turns these into new ratios, at most once a
second and only for a change worth it, which go to the group servers and, as a new ASSIGN, to
their workers (logged as a ``ratios`` event).

How a run ends: its budget is spent (epochs, wall time: ``GlobalCore.finish``), or every group
has flushed its final delta because its last worker left. The second is a success only when
nothing is left to train for (the workers' ``max_steps`` cap, or no budget at all). With budget
left, every worker is gone at once only for a while (stopped, partitioned past the lease,
restarted), so the server waits ``rejoin_wait_s`` for them, saying so on its console; a group's
first non-final merge means they are back. If none comes back in time, the run ends with
``failure`` set and `minips server` exits 3, naming the cause. A merge whose delta is not finite
(NaN or inf: the model diverged) is not applied; the run ends at once with ``failure`` set, and
every connected worker gets ERROR "diverged".

Checkpoints: what one holds is the core's (``GlobalCore.checkpoint_state`` / ``load_state_dict``);
the server writes the file (``checkpoint.py``: atomic, no pickle) from a forked child while the
loop keeps serving, every ``checkpoint_every_s`` until the budget is spent; after a write that
found no room (a full disk), as soon as there is room again (``ROOM_POLL_S``). Failure handling:
docs/operations.md.

Invariants: ``weights`` changes only in ``merge`` (weights += delta of one group, version += 1;
with ``merge="mean"`` the delta is divided by the number of groups k, so k groups together move
the weights as far as one group would: GSSP then compares with SSP at one learning rate), so the
global weights are the initial weights plus every delta any group sent (scaled). Once the budget is
spent (``done``) merges still land — nothing sent is lost — and the run ends when every group
has flushed its final delta (or a grace period passed). ``core.failure`` is "" for a run that
ended normally, else one line saying why not.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips.core.actions import (
    Admitted,
    AllFinal,
    Fail,
    FormGroups,
    GlobalAction,
    Log,
    Placed,
    PlaceLate,
    Regroup,
    Rehomed,
    RunDone,
    SendSettings,
    WeightsReady,
    reply,
)
from minips.core.config import RunConfig
from minips.core.exchange import Delta, ExchangeResult, exchange_message
from minips.core.global_core import GlobalCore
from minips.core.roster import GroupHandle
from minips.errors import AuthError, MiniPSError, RemoteProtocolError
from minips.net import transport
from minips.net.channel import Channel
from minips.net.endpoints import (
    check_bind,
    check_group_address,
    format_address,
    port_error,
    server_ssl,
    tls_mismatch,
)
from minips.record import checkpoint, trace
from minips.record.checkpoint import remove_stale_temps
from minips.record.ledger import Ledger, progress_text
from minips.record.rundir import RunDir, tail_jsonl
from minips.serve import sessions, validation
from minips.serve.group import GroupServer
from minips.serve.peers import GroupPeer, NoGroup
from minips.serve.sessions import send_quiet
from minips.wire import checks, control, frames
from minips.wire.control import Hello

__all__ = [
    "GlobalServer",
    "console_line",
    "InProcGroup",
    "InProcLink",
    "ServerConfig",
    "FINAL_FLUSH_S",
    "REJOIN_POLL_S",
    "EVALUATOR_POLL_S",
    "ROOM_POLL_S",
]

log = logging.getLogger("minips.server")

FINAL_FLUSH_S = 10.0  # after `done`, wait this long for the groups' final deltas
REJOIN_POLL_S = 0.5  # how often the wait for workers looks whether a group is training again
EVALUATOR_POLL_S = 0.1  # after the run, how often the wait for the final PULL looks who is left
ROOM_POLL_S = 0.25  # after a checkpoint write found no room (a full disk, its directory gone):
# how often the server looks for room again (statvfs, no write), so that the next checkpoint is
# written this soon after room is back, not a whole period later (docs/operations.md)


class GlobalServer:
    """The global server's rules (``core``, a ``GlobalCore``) on a port: sessions, grouping,
    budgets, checkpoints (``start`` / ``wait_finished``)."""

    def __init__(self, cfg: ServerConfig, weights: np.ndarray | None = None) -> None:
        self.cfg = cfg
        if not cfg.run.t0:
            cfg.run.t0 = time.time()
        self.core = GlobalCore(cfg.run, weights, regroup=not cfg.external_groups,
                               wall=time.time)
        self.controls: dict[int, Channel] = {}  # worker id -> its control channel
        self.peers: dict[int, GroupPeer] = {}  # group id -> its server (serve/peers.py)
        # group id -> its exchanges' bytes on the wire (bytes_to_global, bytes_from_global):
        # counted here as the frames go, kept across a resume
        self.hops: dict[int, dict[str, int]] = {}
        self.finished = asyncio.Event()  # the run is over
        self.evaluated_final = asyncio.Event()  # the evaluator got the final weights
        self.weights_ready = asyncio.Event()  # the global weights exist
        self.groups_opened = asyncio.Event()  # every group of the grouping has its handle
        if weights is not None:
            self.weights_ready.set()
        self.pending_groups: list[Channel] = []  # group processes not given a group yet
        self.rejected: collections.Counter[str] = collections.Counter()  # ERRORs sent, by code
        self.rejoin: asyncio.Task[None] | None = None  # waiting for every worker to come back
        self.deadline: asyncio.Task[None] | None = None  # the grouping deadline, once one joined
        self.saving: asyncio.Future[int] | None = None  # checkpoint write in flight
        self.save_failing = False  # the last checkpoint write failed (said once a streak)
        self.no_room = False  # ... and the checkpoint's directory had no room for another
        self.saved_bytes = 0  # the last checkpoint written: the room the next one needs
        self.tasks: set[asyncio.Task[Any]] = set()
        self._restored: dict[str, Any] | None = None  # checkpoint state to resume from
        self.server: transport.Server | None = None
        self.port = 0
        self._ssl: Any = None  # the TLS context (start), shared with in-process group servers
        self.rundir = RunDir(cfg.run_dir, t0=cfg.run.t0)
        self.rundir.write_config(cfg.run.to_info())
        self.writer = self.rundir.writer("global")
        self.ledger = Ledger()  # the run's figures (record/ledger.py): every reader reads it
        self.boot = secrets.token_hex(4)  # names the counters that start anew in this process
        self.data_synthetic: set[bool] = set()  # what the workers' data events said

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Listen (or also reopen the checkpoint's groups); return the bound port. The grouping
        deadline starts with the first worker that joins (``_handle``), not here: a server
        started long before its workers gives them the whole of it. Refuses a non-loopback
        address without a secret unless ``insecure``."""
        check_bind(self.cfg.host, self.cfg.token, self.cfg.insecure)  # group servers' host too
        self._ssl = server_ssl(self.cfg.tls_cert, self.cfg.tls_key)
        try:
            self.server = await transport.serve(self.cfg.host, self.cfg.port,
                                                token=self.cfg.token, accept=self._accept,
                                                handler=self._handle, ssl=self._ssl)
        except OSError as exc:  # taken since cli's check_port, or no such address here
            raise port_error("--port", self.cfg.host, self.cfg.port, exc) from None
        self.port = int(self.server.port)
        self.fit_limits()
        self._clean_temps()
        if self._restored is not None:
            await self._reopen(self._restored)
        if self.cfg.ready_file:
            _write_atomic(self.cfg.ready_file, f"{self.cfg.host} {self.port}\n")
        return self.port

    def fit_limits(self) -> None:
        """Narrow what peers may send to this model's frames (``checks.Limits.sized_for``),
        once the model is known (given, restored, or a worker's INIT_WEIGHTS)."""
        if self.server is not None and self.core.weights is not None:
            self.server.set_limits(checks.DEFAULT_LIMITS.sized_for(self.core.weights.size))

    async def wait_finished(self) -> None:
        """Until the run is over and the evaluators connected saw the final weights (at most
        ``linger_s``; no longer than they stay: one that left will not PULL them)."""
        await self.finished.wait()
        deadline = asyncio.get_running_loop().time() + self.cfg.linger_s
        while self.has_evaluator() and not self.evaluated_final.is_set() \
                and asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.evaluated_final.wait(), EVALUATOR_POLL_S)

    async def close(self) -> None:
        """Save the final weights and a last checkpoint, close every connection and group; once
        the run is over, an evaluator still connected gets LEAVE(done) first (it stops instead
        of retrying an ended server: it missed the final weights, ``wait_finished``)."""
        core = self.core
        if core.weights is not None:
            np.save(Path(self.cfg.run_dir) / "final_weights.npy", core.weights)
        if self.saving is not None:
            await asyncio.gather(self.saving, return_exceptions=True)
        if core.grouped and self.cfg.checkpoint_every_s > 0:
            try:
                checkpoint.save(self.checkpoint_path, self.checkpoint_state())
            except OSError as exc:  # a full disk: the run's end is no worse for it
                self.log("checkpoint_failed", reason=str(exc), final=True)
        for peer in self.peers.values():
            await peer.close()
        for t in list(self.tasks):
            t.cancel()
        if self.finished.is_set():  # the run is over: an evaluator still here stops, no retry
            await asyncio.gather(*(_close_done(ch) for ch in self._evaluators()))
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
        self.writer.close()

    @property
    def failure(self) -> str:
        """Why the run ended short of its budget or broke ("": it did not; ``GlobalCore.fail``)."""
        return self.core.failure

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; ``close`` cancels what is left. An exception in it
        ends the run (``_task_done``): never a task whose error nobody reads."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """A background task ended: one that raised fails the run with one line saying why
        (a ``MiniPSError`` is the user's to fix; anything else is a bug, logged with its
        traceback), and the run is over: a server that cannot go on does not hang. A peer
        gone meanwhile (``ConnectionError``) is no reason to end the run."""
        self.tasks.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        if isinstance(exc, (ConnectionError, asyncio.IncompleteReadError)):
            log.info("a peer went away during a server task: %s", exc)  # its session says so
            return
        if not isinstance(exc, MiniPSError):
            log.error("a server task failed", exc_info=exc)
        why = str(exc) if isinstance(exc, MiniPSError) else f"{type(exc).__name__}: {exc}"
        self.perform(self.core.fail("internal", f"the run cannot go on: {why}"))
        self.finished.set()

    def log(self, event: str, **fields: Any) -> None:
        """One line of the run's record, with the run's counters (and, with ``cfg.console``,
        the events an operator follows as one console line each: ``console_line``)."""
        core = self.core
        if event == "data":
            self.data_synthetic.add(bool(fields.get("synthetic")))
        elif event == "merge":  # a group process's merged counters: its traffic as of now
            self.peer(fields["group"]).reported(fields)
            fields.update(self.hop(fields["group"]))  # the exchange's frames included
            self._group_events(fields)
            self.ledger.add("merges_done", 1)
            self.ledger.add("pushes_merged", int(fields.get("pushes") or 0))
            self.ledger.add("samples_trained", int(fields.get("group_samples") or 0))
        figures = self.figures()
        self.writer.write({"t": time.time() - core.run.t0, "event": event, **fields,
                           "version": core.version, "samples": core.samples,
                           "bytes_up": figures["bytes_worker_group"],
                           "bytes_down": figures["bytes_group_worker"], **figures})
        line = console_line(core, event, {**figures, **fields}) if self.cfg.console else None
        if line:
            print(f"minips server: {line}", flush=True)

    def _group_events(self, fields: dict[str, Any]) -> None:
        """What a group process reported with the exchange merged (EXCHANGE ``events``): one
        line each, as an in-process group's (``GroupServer.event``)."""
        g = fields.get("group")
        for event, w, ms in zip(fields.pop("events", None) or [],
                                fields.pop("event_workers", None) or [],
                                fields.pop("event_ms", None) or [], strict=False):
            if event == "left":
                self.perform(self.core.group_saw_gone(int(fields["group"]), w))
                continue
            said = {"link_lost": {"silent_s": ms / 1000}, "link_back": {"after_s": ms / 1000},
                    "expired": {"workers": [w]}}.get(event, {})
            self.log(event, group=g, **({"worker": w} if event != "expired" else {}), **said)

    def figures(self) -> dict[str, int]:
        """The ledger's figures as of now, fed first with each group's counters: its workers'
        traffic (its channels' bytes here, or what its group process last reported: both go
        on across its sessions and a resume) and the bytes of its exchanges with this server
        (counted anew in each process: ``boot``)."""
        for g in self.core.groups:
            t = self.peer(g).traffic()
            self.ledger.count(f"workers-{g}", {"bytes_worker_group": t.get("bytes_in", 0),
                                               "bytes_group_worker": t.get("bytes_out", 0)})
            hop = self.hop(g)
            self.ledger.count(f"exchanges-{g}-{self.boot}",
                              {"bytes_group_global": hop["bytes_to_global"],
                               "bytes_global_group": hop["bytes_from_global"]})
        return self.ledger.figures()

    def peer(self, g: int) -> GroupPeer:
        """Group ``g``'s server (``NoGroup`` when none was opened here for a group the core
        holds)."""
        return self.peers.setdefault(g, NoGroup())

    def hop(self, g: int) -> dict[str, int]:
        """Group ``g``'s exchanges' bytes so far (``bytes_to_global``, ``bytes_from_global``)."""
        return self.hops.setdefault(g, {"bytes_to_global": 0, "bytes_from_global": 0})

    def count_exchange(self, g: int, up: int, down: int) -> None:
        """Group ``g``'s exchange took ``up`` bytes on the wire and its reply ``down``."""
        hop = self.hop(g)
        hop["bytes_to_global"] += up
        hop["bytes_from_global"] += down

    def traffic(self, g: int | None = None) -> dict[str, int]:
        """Worker <-> group bytes for the core's events: the run's as the ledger counts them
        (``bytes_up``, ``bytes_down``: what GLOBAL_WEIGHTS carries) and, for group ``g``, its
        own so far (``bytes_in``, ``bytes_out``: its peer's)."""
        figures = self.figures()
        run = {"bytes_up": figures["bytes_worker_group"],
               "bytes_down": figures["bytes_group_worker"]}
        return run if g is None else {**run, **self.peer(g).traffic()}

    def progress_text(self) -> str:
        """The console's progress line as of now, from memory: the ledger, the core's
        version and samples, the last score (no file is read: ``launch.progress_text``)."""
        core, kinds = self.core, self.data_synthetic
        clock = f"training {core.trained_s():.1f} s" if core.grouped else "start-up"
        kind = None if not kinds else "real" if kinds == {False} else \
            "synthetic" if kinds == {True} else "mixed"
        score = self.ledger.last_accuracy()
        figures = {**self.figures(), "version": core.version, "samples": core.samples}
        return progress_text(clock, core.run.mode, core.run.compressor, figures,
                             score["accuracy"] if score else None, kind,
                             _epoch_samples(core.run))

    def scored(self, score: control.Score) -> None:
        """An evaluator's SCORE (``sessions.evaluator_session``): the ledger, an ``eval``
        line of the record and, for the final one, the console."""
        t = time.time() - self.core.run.t0
        self.ledger.scored(t, score.accuracy, score.loss, final=score.final)
        self.log("eval", accuracy=score.accuracy, loss=score.loss, scored_version=score.version,
                 tested=score.tested, final=score.final)

    # -- admission ---------------------------------------------------------------------------

    def _accept(self, hello: Hello) -> dict[str, Any]:
        info = self.core.run.to_info()
        if hello.role == "worker":
            actions = self.core.admit(int(hello.worker_id), time.monotonic())
            self.perform(actions)
            info["worker_id"] = next(a.worker for a in actions
                                     if isinstance(a, Admitted))
            info["need_init"] = self.core.weights is None
            info["link_probe"] = True  # time your link before the grouping (roster.py)
        elif hello.role == "evaluator":
            info["scores"] = True  # send your scores (SCORE): this server keeps them
        elif hello.role == "group" and not self.cfg.external_groups:
            raise AuthError("this server runs its group servers in-process (no --external-groups)")
        elif hello.role == "group" and (why := tls_mismatch(self._ssl is not None,
                                                            hello.capabilities)):
            raise AuthError(why)  # its workers would fail on every connection
        if hello.role == "group":
            check_group_address(hello.address)
        return info

    async def _handle(self, ch: Channel) -> None:
        assert ch.peer_hello is not None
        role = ch.peer_hello.role
        if role == "worker" and self.deadline is None and self._restored is None:
            self.deadline = self.spawn(self._grouping_deadline())  # from the first join
        try:
            if role == "worker":
                await sessions.worker_session(self, ch, int(ch.worker_id))
            elif role == "group":
                await sessions.group_session(self, ch)
            else:
                await sessions.evaluator_session(self, ch)
        except RemoteProtocolError as exc:
            await validation.reject(ch, exc, self.rejected, "global server")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass

    def has_evaluator(self) -> bool:
        """An evaluator is connected (it PULLs the global weights: accuracy and loss)."""
        return bool(self._evaluators())

    def _evaluators(self) -> list[Channel]:
        """The evaluators' connections open now."""
        return [] if self.server is None else [
            ch for ch in self.server.channels
            if ch.peer_hello is not None and ch.peer_hello.role == "evaluator"]

    # -- the core's actions ------------------------------------------------------------------

    def perform(self, actions: list[GlobalAction]) -> None:
        """Do what the core decided (``global_core.py``), in order. ``Admitted`` and
        ``GroupReply`` answer the one who asked: its caller carries them out."""
        for a in actions:
            if isinstance(a, Log):
                self.log(a.event, **a.fields)
            elif isinstance(a, FormGroups):
                self.spawn(self._form_groups())
            elif isinstance(a, PlaceLate):
                self.spawn(self._place_late(a.worker))
            elif isinstance(a, Regroup):
                self.spawn(self._regroup(a.assignment))
            elif isinstance(a, SendSettings):
                self._send_settings(a.ratios)
            elif isinstance(a, WeightsReady):
                self.weights_ready.set()
                self.fit_limits()
            elif isinstance(a, RunDone):
                self._on_done()
            elif isinstance(a, AllFinal):
                self._every_group_final()
            elif isinstance(a, Fail):
                self._tell_failure(a.code, a.reason)
            elif isinstance(a, Placed):  # its caller tells the worker (``_place_late``)
                self.peer(a.group).expect(a.worker)
            elif isinstance(a, Rehomed):
                for w, g in a.moved.items():
                    self.peer(g).expect(w)
                    self.spawn(self.tell_group(w))

    async def tell_group(self, w: int) -> None:
        """Tell worker ``w`` its group (ASSIGN) if it is connected and the group has a server
        ("" address: it is away). A resumed server listens before it has opened the
        checkpoint's groups again (``start``): a worker back that soon is told once they are."""
        if self._restored is not None:
            await self.groups_opened.wait()
        ch, g = self.controls.get(w), self.core.workers[w].group
        if ch is not None and g in self.core.groups and self.core.groups[g].address:
            with contextlib.suppress(ConnectionError):
                await ch.send(self.core.assign_message(self.core.groups[g]))

    # -- grouping ----------------------------------------------------------------------------

    async def _grouping_deadline(self) -> None:
        await asyncio.sleep(self.cfg.calib_timeout_s)
        self.perform(self.core.calib_timeout(time.monotonic()))

    async def _form_groups(self) -> None:
        """The first grouping: open each group, tell every worker its group, start the budgets."""
        await self.weights_ready.wait()
        assignment = self.core.first_assignment(time.monotonic())
        handles = []
        for g in sorted(set(assignment.values())):
            members = sorted(w for w, gg in assignment.items() if gg == g)
            handles.append(await self.open_group(g, members))
        self.perform(self.core.groups_formed(handles, assignment, time.monotonic()))
        self.groups_opened.set()
        for w in assignment:
            await self.tell_group(w)
        self._start_budgets()

    async def open_group(self, g: int, members: list[int]) -> GroupHandle:
        """Group ``g``'s server (in ``peers``, its handle returned): in this process on a port
        of its own, or the next waiting `minips group` process (``--external-groups``)."""
        core = self.core
        assert core.weights is not None
        if self.cfg.external_groups:
            return await sessions.external_group(self, g, members, self.cfg.calib_timeout_s)
        gs = GroupServer(g, core.run, core.weights, InProcLink(self), members=members,
                         writer=self.rundir.writer(f"group-{g}"))
        gs.set_send_settings(core.ratio_of(g))
        gs.notify = lambda event, fields: self.log(event, **fields)  # the operator's events
        port = await gs.serve(self.cfg.host, self.cfg.group_port(g), self.cfg.token, self._ssl)
        # no host (":port"): "where you reached the global server"; the worker fills in the name
        # it dialled, so DNS names, NAT and TLS names work as they do for the global server
        address = format_address(self.cfg.advertise_host or "", port)
        self.peers[g] = InProcGroup(gs)
        core.merger.share(g, gs.core.xchg)  # its copy of the global weights is the mirror's
        return GroupHandle(g, address, members, ratio=core.ratio_of(g), served=True)

    async def _place_late(self, w: int) -> None:
        """A worker whose first STATS came after the groups were drawn up: once they are open,
        the group nearest its speed."""
        await self.groups_opened.wait()
        actions = self.core.place_late(w)
        self.perform(actions)
        for a in actions:
            if isinstance(a, Placed):
                await self.tell_group(a.worker)

    async def _regroup(self, assignment: dict[int, int]) -> None:
        """Speeds drifted (``grouping.Regrouper`` said so): move workers, open new groups."""
        core = self.core
        moves = core.roster.moved(assignment)
        for g in sorted(set(moves.values()) - set(core.groups)):
            self.perform(core.group_opened(await self.open_group(g, []), time.monotonic()))
        actions = core.moved(moves, time.monotonic())
        for w, g in moves.items():
            self.peer(g).expect(w)
        self.perform(actions)
        for w in moves:
            await self.tell_group(w)

    def _send_settings(self, new: dict[int, float]) -> None:
        """New send settings, GDTopK's ratios or local steps auto's H (already in the groups'
        handles): to the group servers and to every worker of those groups (a new ASSIGN)."""
        core = self.core
        for g in new:
            self.peer(g).send_settings(core.assign_message(core.groups[g]))
        for w, entry in core.workers.items():
            if entry.group in new:
                self.spawn(self.tell_group(w))

    def _start_budgets(self) -> None:
        """The wall-time budget's timer and the periodic checkpoint, once the groups exist."""
        if self.core.run.wall_s > 0:
            self.spawn(self._wall_budget())
        if self.cfg.checkpoint_every_s > 0:
            self.spawn(self._save_loop())

    async def _wall_budget(self) -> None:
        await asyncio.sleep(max(0.0, self.core.run.wall_s - self.core.trained_s()))
        self.perform(self.core.finish("wall time"))

    # -- the end of a run --------------------------------------------------------------------

    def _on_done(self) -> None:
        """Budget spent: tell groups and workers, then wait (bounded) for the final deltas. A
        worker's control channel is closed after its LEAVE(done): its session is over."""
        for peer in self.peers.values():
            self.spawn(peer.finish())
        for ch in self.controls.values():
            self.spawn(_close_done(ch))
        self.spawn(self._final_flush())

    async def _final_flush(self) -> None:
        """Wait at most FINAL_FLUSH_S for the groups' final deltas: once all are final the
        core says ``AllFinal``, which sets ``finished``."""
        if not all(h.final for h in self.core.groups.values()):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.finished.wait(), FINAL_FLUSH_S)
        self.finished.set()

    def _every_group_final(self) -> None:
        """Every group flushed its final delta: the core ends the run or waits for the workers
        to rejoin (``GlobalCore.all_final``; a wait running starts over: it counts from the
        latest group's end, or from a group process adopting a group, ``sessions.adopt``)."""
        self.perform(self.core.all_final(time.monotonic(), self.cfg.rejoin_wait_s))
        if self.core.done:
            self.finished.set()
        else:
            log.warning("every worker is gone with budget left (%s); waiting up to %.0f s for "
                        "them to rejoin (--rejoin-wait)", self.core.budget_left(),
                        self.cfg.rejoin_wait_s)
            if self.rejoin is None or self.rejoin.done():
                self.rejoin = self.spawn(self._tick_rejoin())

    async def _tick_rejoin(self) -> None:
        """The core's rejoin wait, ticked every REJOIN_POLL_S until it ends: the workers are
        back, or the run is over (it failed: ``GlobalCore.tick``)."""
        while not self.core.done:
            actions = self.core.tick(time.monotonic())
            self.perform(actions)
            if Log("workers_back") in actions:
                log.warning("workers are back; training goes on")
                return
            await asyncio.sleep(REJOIN_POLL_S)

    def _tell_failure(self, code: str, reason: str) -> None:
        """The run fails (``core.failure``): say why, tell the workers; the run is over."""
        log.error("%s", reason)
        for ch in self.controls.values():
            self.spawn(send_quiet(ch, control.Error(code=code, reason=reason)))
        self.finished.set()

    # -- checkpoints (global_core.py, checkpoint.py, docs/operations.md) ---------------------

    @property
    def checkpoint_path(self) -> Path:
        """Where the server keeps its checkpoint (``--checkpoint`` or run_dir/checkpoint.npz)."""
        return Path(self.cfg.checkpoint_path or Path(self.cfg.run_dir) / "checkpoint.npz")

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds: the core's state (with each group's traffic, exchange bytes
        and, in-process, training state) and the ledger's."""
        held = {g: {"traffic": self.peer(g).traffic(), "state": self.peer(g).state_dict(),
                    "hop_bytes": dict(self.hop(g))} for g in self.core.groups}
        return {**self.core.checkpoint_state(held), "ledger": self.ledger.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state (before ``start``, which opens its groups again);
        ``ConfigError`` when it belongs to another model or config. The ledger goes on from
        the checkpoint's and from the figures the record wrote last before the restart
        (``Ledger.catch_up``): no counter falls."""
        self.perform(self.core.load_state_dict(state))
        self.ledger.load_state_dict(state.get("ledger") or {})
        written = [r for r in tail_jsonl(Path(self.cfg.run_dir) / "global.jsonl", 1 << 16)
                   if "bytes_total" in r]
        if written:
            self.ledger.catch_up(written[-1])
        self._restored = state

    async def _reopen(self, state: dict[str, Any]) -> None:
        """Open a checkpoint's groups again (the core took the rest: ``restore``): in-process
        ones with their saved state; a group process adopts its group when it connects."""
        handles = {}
        for key, saved in sorted(state["groups"].items(), key=lambda kv: int(kv[0])):
            g, members = int(key), list(saved["members"])
            if self.cfg.external_groups:  # a group process adopts it with the traffic so far
                handles[g] = GroupHandle(g, "", members)
                self.peers[g] = NoGroup(saved.get("traffic"))
            else:
                handles[g] = await self.open_group(g, members)
            if saved["state"] is not None:
                self.peers[g].load_state_dict(saved["state"])
            self.hop(g).update({k: int(v) for k, v in (saved.get("hop_bytes") or {}).items()})
        self.perform(self.core.resume(handles, state))
        for h in handles.values():  # the saved ratios, to the group servers here
            self.peer(h.id).send_settings(self.core.assign_message(h))
            if self.cfg.external_groups:  # said lost when no group process comes back
                self.spawn(sessions.awaited(self, h.id))
        self.groups_opened.set()
        self.log("resumed", checkpoint=str(self.checkpoint_path), saved_at=state["saved_at"],
                 train_s=float(state["train_s"]), down_s=time.time() - float(state["saved_at"]))
        self._start_budgets()

    def _clean_temps(self) -> None:
        """Delete the temporary files of checkpoint writes that were killed midway."""
        removed = remove_stale_temps(self.checkpoint_path)
        if removed:
            self.log("checkpoint_temps_removed", files=[str(p) for p in removed])

    async def _save_loop(self) -> None:
        """Checkpoint every ``checkpoint_every_s`` until the budget is spent; after a write that
        found no room, again as soon as there is room (``_room_back``), not a period later: what
        a crash loses stops growing once the disk has room again."""
        while not self.core.done:
            if self.no_room:
                await self._room_back()
            else:
                await asyncio.sleep(self.cfg.checkpoint_every_s)
            await self._save()

    async def _room_back(self) -> None:
        """Until the checkpoint's directory has room again (every ``ROOM_POLL_S``), or the
        budget is spent."""
        while not self.core.done and not self._has_room():
            await asyncio.sleep(ROOM_POLL_S)

    def _has_room(self) -> bool:
        """Whether the checkpoint's directory has room for the last checkpoint written (for
        the weights' bytes at least) beside it (``checkpoint.has_room``)."""
        weights = self.core.weights
        need = max(self.saved_bytes, 0 if weights is None else weights.nbytes)
        return checkpoint.has_room(self.checkpoint_path, need)

    async def _save(self) -> None:
        """Checkpoint as of now while the loop keeps serving (``checkpoint.save_in_child``: a
        forked child takes the snapshot and writes it), log its size. With group processes the
        snapshot is taken here: it marks what their replies name as saved (global_core.py), and
        holds the global weights only."""
        t = time.monotonic()
        take = self.checkpoint_state
        marks = {g: list(h.snapshots) for g, h in self.core.groups.items()}
        if self.cfg.external_groups:
            state = take()

            def take() -> dict[str, Any]:
                return state
        self.saving = asyncio.ensure_future(checkpoint.save_in_child(self.checkpoint_path, take))
        try:
            size = await asyncio.shield(self.saving)
        except OSError as exc:  # a full disk, a directory gone: the previous file stays
            # what the replies name as saved goes back to the file that is there (taken here
            # only with group processes; an in-process group's snapshot was the child's)
            for g, kept in marks.items():
                self.core.groups[g].snapshots = kept
            self.no_room = not self._has_room()
            self.log("checkpoint_failed", reason=str(exc), first=not self.save_failing,
                     no_room=self.no_room)
            self.save_failing = True
            return
        self.saved_bytes, self.no_room = size, False
        if self.save_failing:
            self.save_failing = False
            self.log("checkpoint_back", bytes=size)
        self.log("checkpoint", bytes=size, write_s=time.monotonic() - t)


def _epoch_samples(run: RunConfig) -> int:
    try:
        return run.epoch_samples()
    except MiniPSError:
        return 1


# -- a group server in this process ------------------------------------------------------------

class InProcGroup:
    """``GroupPeer`` (``serve/peers.py``) of a group server the global server started itself: direct
    calls. Its uplink (the group's ``exchange.GroupLink``) is ``InProcLink``."""

    def __init__(self, server: GroupServer) -> None:
        self.server = server
        # the worker traffic of the run before a resume (the checkpoint's): its counters go on
        self.before = {"bytes_in": 0, "bytes_out": 0}

    @property
    def connected(self) -> bool:
        return True

    def expect(self, w: int) -> None:
        self.server.expect(w)

    def forget(self, w: int) -> None:
        self.server.forget(w)

    def traffic(self) -> dict[str, int]:
        now = self.server.traffic()
        return {k: self.before[k] + now[k] for k in self.before}

    def reported(self, stats: dict[str, Any]) -> None:
        """Its traffic is read live (``traffic``)."""

    def state_dict(self) -> dict[str, Any] | None:
        """The group's state, with the run's worker traffic so far (it survives a resume)."""
        return {**self.server.state_dict(), "traffic": self.traffic()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("traffic") or {}  # absent in older checkpoints: from 0
        self.before = {k: int(saved.get(k, 0)) for k in self.before}
        self.server.load_state_dict({k: v for k, v in state.items() if k != "traffic"})

    def send_settings(self, assign: control.Assign) -> None:
        self.server.set_send_settings(assign.ratio, assign.local_steps)

    async def finish(self) -> None:
        self.server.finish()

    async def close(self) -> None:
        await self.server.close()


class InProcLink:
    """The uplink (``exchange.GroupLink``) of a group server in this process: a direct call.
    Its bytes are those of the EXCHANGE and EXCHANGE_REPLY a `minips group` process would
    exchange instead (``frames.wire_size`` of each), counted here, where they would be sent."""

    def __init__(self, server: GlobalServer) -> None:
        self.server = server

    async def exchange(self, group: int, delta: Delta,
                       stats: dict[str, Any]) -> ExchangeResult:
        core, srv = self.server.core, self.server
        msg = exchange_message(delta, stats)
        actions = core.merge(group, delta, stats, time.monotonic(), srv.traffic(group))
        result = reply(actions, ExchangeResult)
        answer = core.merger.exchange_reply(group, result.weights, result.done)
        result.bytes_up, result.bytes_down = frames.wire_size(msg), frames.wire_size(answer)
        srv.count_exchange(group, result.bytes_up, result.bytes_down)
        srv.perform(actions)
        if trace.TRACER is not None:  # --trace: written as the frames a group process sends
            trace.TRACER.inproc(f"group-{group}", "server", "send", msg, result.bytes_up)
            trace.TRACER.inproc(f"group-{group}", "server", "recv", answer, result.bytes_down)
        return result


# -- what an operator reads on the server's console ------------------------------------------------

def _ms(seconds: float | None) -> str:
    return f"{1e3 * seconds:.0f} ms" if seconds else "?"


def _groups_line(core: GlobalCore, assignment: dict[str, int]) -> str:
    """'2 group(s) by speed: 0 = workers 0,1 (45 ms/iteration, 41 ms compute), 1 = worker 2
    (830 ms/iteration, 42 ms compute)': the iteration the grouping used (roster.py), and the
    compute time beside it (a link-bound worker computes fast and iterates slowly)."""
    parts = []
    for g in sorted(set(assignment.values())):
        members = sorted(int(w) for w, gg in assignment.items() if gg == g)
        its = [t for w in members if (t := core.workers[w].iteration())]
        steps = [t for w in members if (t := core.workers[w].step_time)]
        it = sum(its) / len(its) if its else None
        step = sum(steps) / len(steps) if steps else None
        parts.append(f"{g} = worker{'s' if len(members) > 1 else ''} "
                     f"{','.join(map(str, members))} ({_ms(it)}/iteration, {_ms(step)} compute)")
    return f"{len(parts)} group(s) by speed: " + ", ".join(parts)


def _deadline_line(fields: dict[str, Any]) -> str:
    """The grouping deadline passed: with whom training starts, and what happens to the rest."""
    n, m = len(fields.get("reported") or []), fields.get("expected")
    wait = "grouping deadline passed (--calib-timeout, counted from the first join)"
    if not n:
        return f"{wait} with no worker reported yet: the first one to report forms the groups"
    return f"{wait} with {n} of {m} workers reported: training starts with them; a worker " \
        "that reports later is placed in the group nearest its speed"


def console_line(core: GlobalCore, event: str, fields: dict[str, Any]) -> str | None:
    """The console line of a record event, None for those only the record keeps (merges,
    checkpoints, ratios)."""
    w = fields.get("worker")
    if event == "joined":
        return f"worker {w} joined ({sum(e.connected for e in core.workers.values())} " \
            f"connected, {core.run.workers} expected)"
    if event == "left":
        return f"worker {w} left ({fields.get('reason')})"
    if event == "groups":
        return _groups_line(core, fields["assignment"]) + "; training"
    if event == "calib_timeout":
        return _deadline_line(fields)
    if event == "resumed":
        mb = (fields.get("bytes_total") or 0) / 1e6
        return f"resumed from checkpoint {fields.get('checkpoint')} (merge {core.version}, " \
            f"{core.samples:,} samples, {fields.get('train_s', 0):.1f} s of training, " \
            f"{mb:.1f} MB on the wire so far; saved {fields.get('down_s', 0):.0f} s ago)"
    if event == "placed":
        return f"worker {w} reported after the grouping: placed in group {fields.get('group')} " \
            f"(the nearest in speed to its {_ms(fields.get('iteration_s'))}/iteration, " \
            f"{_ms(fields.get('step_time'))} compute)"
    if event in ("regroup", "rehomed"):
        moves = [f"worker {w} moves to group {g}" for w, g in (fields.get("moved") or {}).items()]
        why = "regrouped by speed" if event == "regroup" else f"group {fields.get('group')} lost"
        return f"{why}: {', '.join(moves)}"
    if event == "done":
        return f"budget spent ({fields.get('reason')}); collecting the groups' final deltas"
    if event == "data" and fields.get("synthetic"):
        return f"worker {w} trains on SYNTHETIC {fields.get('dataset')} data, not the real " \
            f"files ({fields.get('reason') or 'started with --data synthetic'})"
    if event == "checkpoint_failed" and fields.get("first", True):
        return f"checkpoint not written ({fields.get('reason')}): the last one written stays; " \
            "training goes on, and the next checkpoint is written as soon as " + \
            ("the disk has room again" if fields.get("no_room") else "its period comes")
    if event == "checkpoint_back":
        return "checkpoints are written again"
    if event == "link_lost":
        return f"worker {w}: no bytes from it at group {fields.get('group')} for " \
            f"{fields.get('silent_s')} s (its link is down, or it is stopped); its lease " \
            f"({core.run.lease_s:g} s) decides when its group stops waiting for it"
    if event == "link_back":
        return f"worker {w}: its link to group {fields.get('group')} is back after " \
            f"{fields.get('after_s')} s"
    if event == "expired":
        ids = ", ".join(str(x) for x in fields.get("workers") or [])
        return f"group {fields.get('group')}: lease expired for worker(s) {ids} (silent " \
            f"{core.run.lease_s:g} s): the group no longer waits for them"
    if event in ("group_adopted", "group_lost"):
        return f"{event.replace('_', ' ')}: group {fields.get('group')} " \
            f"{fields.get('address', '')}".rstrip()
    return None


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


async def _close_done(ch: Channel) -> None:
    """LEAVE(done) on a worker's control channel or an evaluator's, then close it
    (protocol.md, section 6)."""
    with contextlib.suppress(ConnectionError, OSError):
        await ch.close(leave="done")


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
    calib_timeout_s: float = 60.0  # group who reported this long after the first worker joined
    ready_file: str | None = None  # write "host port" here once listening (launcher)
    linger_s: float = 15.0  # after the budget, wait this long for the final evaluator pull
    rejoin_wait_s: float = 120.0  # every worker gone with budget left: wait this long for them
    checkpoint_path: str | None = None  # checkpoint file; None = <run_dir>/checkpoint.npz
    checkpoint_every_s: float = 30.0  # seconds between checkpoints; 0 = none
    resume: bool = False  # start from checkpoint_path instead of init_path / a worker
    insecure: bool = False  # allow a non-loopback listen address without a secret
    dashboard: str = ""  # HOST:PORT of the live web dashboard and /metrics; "" = none
    tensorboard: str = ""  # directory for TensorBoard event files; "" = none
    # in-process group servers' ports, group g on group_ports[g] (port forwarding, firewalls);
    # a group beyond the list (or none given) takes a free port
    group_ports: list[int] = field(default_factory=list)
    console: bool = False  # print joins, groups and the end as lines on stdout (`minips server`)

    def __post_init__(self) -> None:
        # group processes serve the groups, one each, and a group process cannot be started
        # on the fly: a run that chooses its group count (GSSP, --groups 0) forms as many as
        # there are group processes (else a second group would wait for a server forever)
        if self.external_groups > 0 and self.run.fixed_groups == 0:
            self.run = dataclasses.replace(self.run, groups=self.external_groups)

    def group_port(self, g: int) -> int:
        """The port group ``g``'s in-process server listens on (0: any free one)."""
        return self.group_ports[g] if 0 <= g < len(self.group_ports) else 0
