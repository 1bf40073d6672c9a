"""Global server: admission, grouping, GDTopK ratios, authoritative weights, budget (no torch).

One asyncio process. Clients connect with role ``worker`` (control channel: STATS, HEARTBEAT,
LEAVE; learns its group from ASSIGN), ``group`` (a separate `minips group` process: PUSH its
delta, get WEIGHTS) or ``evaluator`` (PULL the global weights every few seconds).

A run goes: workers connect and report their calibrated step time (STATS at clock 0); when all
``run.workers`` reported (or ``calib_timeout_s`` passed) the server clusters the step times
into groups (one group for bsp/ssp/asp, ``grouping.assign_groups`` for gssp), starts one
``GroupServer`` per group on its own port (or hands the groups to the connected external group
servers) and sends every worker ASSIGN(group address, ratio, staleness). Later STATS update the
group step times; with GDTopK a changed ratio is sent as a new ASSIGN.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips import checkpoint, compressors, grouping, protocol, sparse, transport, validation
from minips.config import ServerConfig, check_bind, dataset_train_size, server_ssl
from minips.errors import AuthError, ConfigError, RemoteProtocolError
from minips.group import ExchangeResult, GroupServer
from minips.metrics import RunDir

__all__ = ["GlobalServer", "GroupHandle", "InProcLink", "WorkerEntry"]

FINAL_FLUSH_S = 10.0  # after `done`, wait this long for the groups' final deltas
RATIO_EPS = 0.1  # relative ratio change that is worth a new ASSIGN
MAX_PARAMS = 1 << 31  # model size a worker's initial weights may claim (float32 elements)
REGROUP_EVERY_S = 2.0  # the Regrouper sees the step times once per this period


@dataclass
class WorkerEntry:
    """What the global server knows of one worker."""

    id: int
    ch: Any = None  # control channel, None while disconnected
    step_time: float | None = None  # last reported seconds per step
    clock: int = 0  # last reported clock
    group: int = -1  # assigned group, -1 before grouping
    left: bool = False  # sent LEAVE


@dataclass
class GroupHandle:
    """One group as the global server sees it."""

    id: int
    address: str  # "host:port" where its workers connect
    members: list[int] = field(default_factory=list)
    ratio: float = 0.01  # GDTopK kept fraction for its workers
    server: GroupServer | None = None  # in-process group server, else None
    ch: Any = None  # channel of an external group server
    step_time: float = 0.0  # smoothed mean worker step time, seconds
    traffic: dict[str, int] = field(default_factory=dict)  # bytes_in/out it last reported
    final: bool = False  # flushed its last delta
    merges: int = 0


class GlobalServer:
    """The global server's state and message handling (``start`` / ``wait_finished``)."""

    def __init__(self, cfg: ServerConfig, weights: np.ndarray | None = None) -> None:
        self.cfg = cfg
        self.run = cfg.run
        if not self.run.t0:
            self.run.t0 = time.time()
        self.weights = None if weights is None else np.array(weights, dtype=np.float32)
        self.version = 0  # merges applied to self.weights
        self.samples = 0  # training samples all groups reported
        self.workers: dict[int, WorkerEntry] = {}
        self.groups: dict[int, GroupHandle] = {}
        self.pending_groups: list[Any] = []  # channels of external group servers not yet used
        self.done = False
        self.done_reason = ""
        self.train_size = dataset_train_size(self.run.dataset, self.run.train_size)
        self.started_training = 0.0  # time.time() when the groups were formed
        self.finished = asyncio.Event()
        self.evaluated_final = asyncio.Event()
        self._weights_ready = asyncio.Event()
        self._grouped = asyncio.Event()
        self._groups_opened = asyncio.Event()  # every group has its handle (ch may be None)
        self.regrouper = grouping.Regrouper(k=self.run.fixed_groups or None,
                                            max_k=self.run.max_groups)
        self._regroup_at = 0.0  # time.monotonic() of the last Regrouper update
        self._tasks: set[asyncio.Task[Any]] = set()
        self.rejected: collections.Counter[str] = collections.Counter()  # ERRORs sent, by code
        self._restored: dict[str, Any] | None = None  # checkpoint state to resume from
        self._saving: asyncio.Future[Any] | None = None  # checkpoint write in flight
        self.server: Any = None
        self.port = 0
        self.rundir = RunDir(cfg.run_dir, t0=self.run.t0)
        self.rundir.write_config(self.run.to_info())
        self.writer = self.rundir.writer("global")
        if self.weights is not None:
            self._weights_ready.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Listen, start the grouping deadline (or reopen the checkpoint's groups); return the
        bound port. Refuses a non-loopback address without a secret unless ``insecure``."""
        for host in (self.cfg.host, self.cfg.group_host):
            check_bind(host, self.cfg.token, self.cfg.insecure)
        ssl = server_ssl(self.cfg.tls_cert, self.cfg.tls_key)
        self.server = await transport.serve(self.cfg.host, self.cfg.port, token=self.cfg.token,
                                            accept=self._accept, handler=self._handle, ssl=ssl)
        self.port = int(self.server.port)
        if self._restored is not None:
            await self._reopen(self._restored)
        else:
            self._spawn(self._grouping_deadline())
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
        if self._saving is not None:
            await asyncio.gather(self._saving, return_exceptions=True)
        if self._grouped.is_set() and self.cfg.checkpoint_every_s > 0:
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
            info["worker_id"] = self._admit_worker(int(hello.worker_id))
            info["need_init"] = self.weights is None
        elif hello.role == "group" and not self.cfg.external_groups:
            raise AuthError("this server runs its group servers in-process (no --external-groups)")
        return info

    def _admit_worker(self, wanted: int) -> int:
        if wanted < 0:
            wanted = next(i for i in range(len(self.workers) + 1) if i not in self.workers)
        if wanted >= self.run.workers:
            raise AuthError(f"worker id {wanted} out of range 0..{self.run.workers - 1}")
        self.workers.setdefault(wanted, WorkerEntry(wanted))
        return wanted

    async def _handle(self, ch: Any) -> None:
        role = ch.peer_hello.role
        try:
            if role == "worker":
                await self._worker_session(ch, int(ch.worker_id))
            elif role == "group":
                await self._group_session(ch)
            else:
                await self._evaluator_session(ch)
        except RemoteProtocolError as exc:
            await validation.reject(ch, exc, self.rejected, "global server")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass

    # -- workers -----------------------------------------------------------------------------

    async def _worker_session(self, ch: Any, w: int) -> None:
        entry = self.workers[w]
        if entry.ch is not None:  # a restarted worker replaces its stale connection
            self._spawn(entry.ch.close())
        entry.ch, entry.left = ch, False
        try:
            if entry.group >= 0:  # a reconnect after grouping: tell it its group again
                await self._assign(entry, entry.group)
            last_clock = 0  # clocks of this session's STATS never go backwards
            while not entry.left:
                last_clock = self._on_worker_msg(entry, await ch.recv(), last_clock)
        finally:
            if entry.ch is ch:
                entry.ch = None

    def _on_worker_msg(self, entry: WorkerEntry, msg: Any, last_clock: int) -> int:
        """Handle one control message; return the session's last STATS clock."""
        if isinstance(msg, protocol.Stats):
            validation.check_stats(msg, last_clock)
            self._on_stats(entry, msg)
            return int(msg.clock)
        if isinstance(msg, protocol.Push) and self.weights is None:
            self._set_initial(msg)
        elif isinstance(msg, protocol.Leave):
            entry.left = True
        else:
            raise validation.unexpected(msg, "worker on the control channel")
        return last_clock

    def _set_initial(self, msg: Any) -> None:
        """The first worker's initial weights (when the server was started without --init)."""
        size = msg.codec.get("size", 0)
        if not isinstance(size, int) or not 0 < size <= MAX_PARAMS:
            raise RemoteProtocolError("initial weights: bad size", expected=f"1..{MAX_PARAMS}",
                                      got=size)
        w = sparse.decode_gradient(msg.encoding, msg.codec, msg.buffers, size)
        if not isinstance(w, np.ndarray):
            raise RemoteProtocolError("initial weights must be dense", got=msg.encoding)
        self.weights = w.astype(np.float32)
        self._weights_ready.set()

    def _on_stats(self, entry: WorkerEntry, msg: Any) -> None:
        entry.step_time, entry.clock = float(msg.step_time), int(msg.clock)
        if not self._grouped.is_set():
            reported = [e for e in self.workers.values() if e.step_time]
            if len(reported) >= self.run.workers:
                self._spawn(self._form_groups())
        elif entry.group < 0:
            self._spawn(self._place_late(entry))
        elif (new := self._maybe_regroup()) is not None:
            self._spawn(self._regroup(new))
        else:
            self._update_ratios()

    def _maybe_regroup(self) -> dict[int, int] | None:
        """A new assignment when the Regrouper's hysteresis says the speeds drifted (GSSP with
        in-process groups only), else None."""
        if self.run.mode != "gssp" or self.cfg.external_groups:
            return None
        now = time.monotonic()
        if now - self._regroup_at < REGROUP_EVERY_S:
            return None  # one look per period, so the Regrouper's patience counts periods
        self._regroup_at = now
        live = {w: e.step_time for w, e in self.workers.items() if e.step_time and not e.left}
        new = self.regrouper.update(live)
        return None if new is None else _match_labels(new, {w: e.group for w, e in
                                                            self.workers.items()})

    async def _grouping_deadline(self) -> None:
        await asyncio.sleep(self.cfg.calib_timeout_s)
        if not self._grouped.is_set() and any(e.step_time for e in self.workers.values()):
            await self._form_groups()

    # -- grouping ----------------------------------------------------------------------------

    async def _form_groups(self) -> None:
        if self._grouped.is_set():
            return
        self._grouped.set()
        await self._weights_ready.wait()
        times = {w: e.step_time for w, e in self.workers.items() if e.step_time}
        assignment = self.regrouper.update(times) or {}
        for g in sorted(set(assignment.values())):
            members = sorted(w for w, gg in assignment.items() if gg == g)
            self.groups[g] = await self._open_group(g, members)
            self.groups[g].step_time = float(np.mean([times[w] for w in members]))
        self._set_ratios()
        self.started_training = time.time()
        self._log("groups", assignment={str(w): g for w, g in assignment.items()},
                  ratios={str(g): h.ratio for g, h in self.groups.items()})
        self._groups_opened.set()
        for w, g in assignment.items():
            await self._assign(self.workers[w], g)
        self._start_budgets()

    def _start_budgets(self) -> None:
        if self.run.wall_s > 0:
            self._spawn(self._wall_budget())
        if self.cfg.checkpoint_every_s > 0:
            self._spawn(self._checkpoint_loop())

    async def _open_group(self, g: int, members: list[int]) -> GroupHandle:
        assert self.weights is not None
        if self.cfg.external_groups:
            return await self._external_group(g, members)
        writer = self.rundir.writer(f"group-{g}")
        gs = GroupServer(g, self.run, self.weights, InProcLink(self), members=members,
                         writer=writer)
        port = await gs.serve(self.cfg.group_host, 0, self.cfg.token,
                              server_ssl(self.cfg.tls_cert, self.cfg.tls_key))
        host = self.cfg.advertise_host or self.cfg.group_host
        return GroupHandle(g, f"{host}:{port}", members, self.run.ratio, server=gs)

    async def _external_group(self, g: int, members: list[int]) -> GroupHandle:
        deadline = time.monotonic() + self.cfg.calib_timeout_s
        while not self.pending_groups:
            if time.monotonic() > deadline:
                raise ConfigError(f"no external group server connected for group {g}")
            await asyncio.sleep(0.1)
        ch = self.pending_groups.pop(0)
        handle = GroupHandle(g, ch.peer_hello.address, members, self.run.ratio, ch=ch)
        await ch.send(self._assign_msg(handle))
        return handle

    async def _regroup(self, assignment: dict[int, int]) -> None:
        """Speeds drifted (``grouping.Regrouper`` said so): move workers, open new groups."""
        assert self.weights is not None
        moved = {w: g for w, g in assignment.items() if self.workers[w].group != g}
        for g in sorted(set(moved.values()) - set(self.groups)):
            self.groups[g] = await self._open_group(g, [])
        for w, g in moved.items():
            old = self.groups[self.workers[w].group]
            old.members.remove(w)
            self._add_member(g, w)
        self._log("regroup", moved={str(w): g for w, g in moved.items()})
        self._update_ratios()
        for w, g in moved.items():
            await self._assign(self.workers[w], g)

    def _add_member(self, g: int, w: int) -> None:
        handle = self.groups[g]
        handle.members.append(w)
        handle.final = False
        if handle.server is not None:
            handle.server.expect(w)

    async def _place_late(self, entry: WorkerEntry) -> None:
        times = {g: h.step_time for g, h in self.groups.items()}
        g = grouping.nearest_group(entry.step_time or 1.0, times)
        self.regrouper.place(entry.id, entry.step_time or 1.0)
        self._add_member(g, entry.id)
        await self._assign(entry, g)

    def _assign_msg(self, h: GroupHandle) -> Any:
        return protocol.Assign(group=h.id, address=h.address, ratio=h.ratio,
                               staleness=_staleness(self.run))

    async def _assign(self, entry: WorkerEntry, g: int) -> None:
        entry.group = g
        if entry.ch is not None and self.groups[g].address:  # "": its group server is away
            with contextlib.suppress(ConnectionError):
                await entry.ch.send(self._assign_msg(self.groups[g]))

    def _set_ratios(self) -> bool:
        """GDTopK: one ratio per group from the group step times; True when any changed."""
        if self.run.compressor != "gdtopk" or not self.groups:
            return False
        ids = sorted(self.groups)
        ratios = compressors.gdtopk_ratios([self.groups[g].step_time for g in ids],
                                           floor=self.run.ratio, alpha=self.run.gdtopk_alpha,
                                           direction=self.run.gdtopk_direction,
                                           lo=min(self.run.ratio, 0.001), hi=0.05)
        changed = False
        for g, r in zip(ids, ratios, strict=True):
            if abs(r - self.groups[g].ratio) > RATIO_EPS * self.groups[g].ratio:
                self.groups[g].ratio, changed = r, True
        return changed

    def _update_ratios(self) -> None:
        for h in self.groups.values():
            times = [t for w in h.members if (t := self.workers[w].step_time)]
            if times:
                h.step_time = float(np.mean(times))
        if self._set_ratios():
            for entry in self.workers.values():
                if entry.group >= 0:
                    self._spawn(self._assign(entry, entry.group))

    # -- merging -----------------------------------------------------------------------------

    def merge(self, g: int, delta: np.ndarray, stats: dict[str, Any]) -> ExchangeResult:
        """Add group ``g``'s delta to the global weights; return a copy of the result."""
        assert self.weights is not None
        if self.run.merge == "mean" and len(self.groups) > 1:
            delta = delta * np.float32(1.0 / len(self.groups))  # (n,) float32, a new array
        self.weights += delta
        self.version += 1
        self.samples += int(stats.get("samples", 0))
        h = self.groups[g]
        h.merges += 1
        h.final = h.final or bool(stats.get("final"))
        h.traffic = {k: int(stats.get(k, 0)) for k in ("bytes_in", "bytes_out")}
        self._log("merge", group=g, group_samples=stats.get("samples", 0),
                  **{k: v for k, v in stats.items() if k not in ("version", "samples")})
        self._check_budget()
        return ExchangeResult(self.weights.copy(), self.version, self.done)

    def _check_budget(self) -> None:
        if self.run.epochs > 0 and self.samples >= self.run.epochs * self.train_size:
            self.finish("epochs")
        if self.groups and all(h.final for h in self.groups.values()):
            self.finish("workers left")
            self.finished.set()

    async def _wall_budget(self) -> None:
        await asyncio.sleep(max(0.0, self.run.wall_s - (time.time() - self.started_training)))
        self.finish("wall time")

    def finish(self, reason: str) -> None:
        """Budget spent: tell groups and workers, then wait (bounded) for the final deltas."""
        if self.done:
            return
        self.done, self.done_reason = True, reason
        self._log("done", reason=reason)
        for h in self.groups.values():
            if h.server is not None:
                h.server.finish()
            elif h.ch is not None:
                self._spawn(_send_quiet(h.ch, protocol.Leave(reason="done")))
        for entry in self.workers.values():
            if entry.ch is not None:
                self._spawn(_send_quiet(entry.ch, protocol.Leave(reason="done")))
        self._spawn(self._final_flush())

    async def _final_flush(self) -> None:
        deadline = time.monotonic() + FINAL_FLUSH_S
        while not all(h.final for h in self.groups.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.finished.set()

    # -- external groups and the evaluator ---------------------------------------------------

    async def _group_session(self, ch: Any) -> None:
        """A `minips group` process: initial PULL, then PUSH delta -> WEIGHTS, until it leaves.
        One that connects after the grouping adopts a group whose server was lost."""
        if not self._groups_opened.is_set():
            self.pending_groups.append(ch)
            await self._groups_opened.wait()
        handle = next((h for h in self.groups.values() if h.ch is ch), None)
        if handle is None:
            handle = await self._adopt(ch)
        try:
            while handle is not None and not await self._on_group_msg(ch, handle):
                pass
        finally:
            if handle is not None and handle.ch is ch:
                handle.ch = None
                self._log("group_lost", group=handle.id)

    async def _adopt(self, ch: Any) -> GroupHandle | None:
        """Give a (re)started group process the group whose server is gone (its own first)."""
        orphans = sorted((h for h in self.groups.values() if h.ch is None and h.server is None),
                         key=lambda h: h.id != ch.peer_hello.group)
        if not orphans:
            await ch.send_error("refused", "every group already has a group server")
            return None
        handle = orphans[0]
        handle.ch, handle.address = ch, ch.peer_hello.address
        await ch.send(self._assign_msg(handle))
        self._log("group_adopted", group=handle.id, address=handle.address)
        for w in handle.members:
            self._spawn(self._assign(self.workers[w], handle.id))
        return handle

    async def _on_group_msg(self, ch: Any, handle: GroupHandle) -> bool:
        """Handle one message of a group process; True when it left."""
        msg = await ch.recv()
        if isinstance(msg, protocol.Pull):
            await ch.send(self.weights_message(members=handle.members))
        elif isinstance(msg, protocol.Push):
            assert self.weights is not None
            delta = sparse.decode_gradient(msg.encoding, msg.codec, msg.buffers,
                                           self.weights.size)
            res = self.merge(handle.id, np.asarray(delta), validation.check_group_stats(msg.codec))
            await ch.send(self.weights_message(res.weights))
        elif isinstance(msg, protocol.Leave):
            handle.final = True
            self._check_budget()
            return True
        else:
            raise validation.unexpected(msg, "group server")
        return False

    async def _evaluator_session(self, ch: Any) -> None:
        while True:
            msg = await ch.recv()
            if isinstance(msg, protocol.Leave):
                return
            if not isinstance(msg, protocol.Pull):
                raise validation.unexpected(msg, "evaluator")
            await self._weights_ready.wait()
            final = self.done and self.finished.is_set()
            await ch.send(self.weights_message(final=final))
            if final:
                self.evaluated_final.set()

    def weights_message(self, weights: np.ndarray | None = None, final: bool = False,
                        members: list[int] | None = None) -> Any:
        """WEIGHTS with the global weights and the run's counters in ``info``."""
        w = self.weights if weights is None else weights
        w = w if w is not None else np.zeros(0, np.float32)
        encoding, codec, buffers = sparse.encode_gradient(w)
        info = {"samples": self.samples, "version": self.version, "t": time.time() - self.run.t0,
                "size": int(w.size), "members": members or [],
                "train_s": time.time() - self.started_training if self.started_training else 0.0,
                "done_reason": self.done_reason, **self.traffic()}
        return protocol.Weights(version=self.version, encoding=encoding, codec=codec,
                                buffers=tuple(buffers), done=final or self.done, info=info)

    def traffic(self) -> dict[str, int]:
        """Worker <-> group bytes so far (external groups: as of their last exchange)."""
        up = down = 0
        for h in self.groups.values():
            b = h.server.traffic() if h.server is not None else h.traffic
            up, down = up + b.get("bytes_in", 0), down + b.get("bytes_out", 0)
        return {"bytes_up": up, "bytes_down": down}

    def _has_evaluator(self) -> bool:
        return self.server is not None and any(
            ch.peer_hello is not None and ch.peer_hello.role == "evaluator"
            for ch in self.server.channels)


    # -- checkpoints (see checkpoint.py and docs/operations.md) --------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.cfg.checkpoint_path or Path(self.cfg.run_dir) / "checkpoint.npz")

    def checkpoint_state(self) -> dict[str, Any]:
        """A consistent snapshot (no await inside): global weights and counters, grouping, and
        each in-process group's weights, optimizer state and clocks. Arrays are copies."""
        assert self.weights is not None
        groups = {g: {"members": list(h.members), "ratio": h.ratio, "step_time": h.step_time,
                      "merges": h.merges, "state": None if h.server is None else
                      h.server.state_dict()} for g, h in self.groups.items()}
        workers = {w: {"group": e.group, "step_time": e.step_time, "clock": e.clock}
                   for w, e in self.workers.items()}
        return {"format": checkpoint.FORMAT, "saved_at": time.time(), "t0": self.run.t0,
                "fingerprint": checkpoint.fingerprint(self.run.to_info(), self.weights.size),
                "train_s": time.time() - self.started_training, "weights": self.weights.copy(),
                "version": self.version, "samples": self.samples, "workers": workers,
                "groups": groups}

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state (before ``start``); ``ConfigError`` when it belongs to
        another model or config."""
        weights = np.asarray(state["weights"], dtype=np.float32)
        checkpoint.check_compatible(state, self.run.to_info(), weights.size)
        self.weights, self.version, self.samples = weights, state["version"], state["samples"]
        self._weights_ready.set()
        for key, e in state["workers"].items():
            self.workers[int(key)] = WorkerEntry(int(key), step_time=e["step_time"],
                                                 clock=e["clock"], group=e["group"])
        self._restored = state

    async def _reopen(self, state: dict[str, Any]) -> None:
        """Open the checkpoint's groups again (in-process ones with their saved state)."""
        self._grouped.set()
        for key, saved in sorted(state["groups"].items(), key=lambda kv: int(kv[0])):
            g = int(key)
            if self.cfg.external_groups:  # a group process adopts it when it connects
                h = GroupHandle(g, "", list(saved["members"]), saved["ratio"])
            else:
                h = await self._open_group(g, list(saved["members"]))
                if h.server is not None and saved["state"] is not None:
                    h.server.load_state_dict(saved["state"])
            h.ratio, h.step_time, h.merges = saved["ratio"], saved["step_time"], saved["merges"]
            self.groups[g] = h
        times = {w: e.step_time for w, e in self.workers.items() if e.step_time}
        if times:
            self.regrouper.update(times)
            self.regrouper.assignment = {w: e.group for w, e in self.workers.items()
                                         if e.step_time and e.group >= 0}
        self.started_training = time.time() - float(state["train_s"])
        self._groups_opened.set()
        self._log("resumed", checkpoint=str(self.checkpoint_path), saved_at=state["saved_at"])
        self._start_budgets()

    async def _checkpoint_loop(self) -> None:
        while not self.done:
            await asyncio.sleep(self.cfg.checkpoint_every_s)
            await self.save_checkpoint()

    async def save_checkpoint(self) -> None:
        """Snapshot now, write it in a thread (the loop keeps serving), log its size."""
        t = time.monotonic()
        state = self.checkpoint_state()
        self._saving = asyncio.ensure_future(
            asyncio.to_thread(checkpoint.save, self.checkpoint_path, state))
        size = await asyncio.shield(self._saving)
        self._log("checkpoint", bytes=size, write_s=time.monotonic() - t)

    # -- helpers -----------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _log(self, event: str, **fields: Any) -> None:
        self.writer.write({"t": time.time() - self.run.t0, "event": event, **fields,
                           "version": self.version, "samples": self.samples, **self.traffic()})

class InProcLink:
    """GroupLink for a group server in the global server's process: a direct call."""

    def __init__(self, server: GlobalServer) -> None:
        self.server = server

    async def exchange(self, group: int, delta: np.ndarray,
                       stats: dict[str, Any]) -> ExchangeResult:
        return self.server.merge(group, delta, stats)


def _match_labels(new: dict[int, int], old: dict[int, int]) -> dict[int, int]:
    """Rename the new groups after the old group most of their members come from (greedy, by
    overlap), so a regroup moves only the workers whose group really changed."""
    overlap: dict[tuple[int, int], int] = {}
    for w, g in new.items():
        overlap[g, old.get(w, -1)] = overlap.get((g, old.get(w, -1)), 0) + 1
    rename: dict[int, int] = {}
    for (g, h), _ in sorted(overlap.items(), key=lambda kv: -kv[1]):
        if g not in rename and h >= 0 and h not in rename.values():
            rename[g] = h
    spare = (i for i in range(len(new) + len(old) + 1) if i not in rename.values())
    for g in sorted(set(new.values()) - set(rename)):
        rename[g] = next(spare)
    return {w: rename[g] for w, g in new.items()}


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
