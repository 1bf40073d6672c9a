"""The worker: its training loop (PyTorch and asyncio; with evaluator.py the only torch code on
the network path).

A worker knows only the global server's address. It connects (role ``worker``), learns the run
config from WELCOME.info, builds the model and its data shard, times ``calib_steps`` steps and
reports them (the link probe, then STATS, clock 0), then waits for ASSIGN (its group server,
upload ratio, staleness). A global server lost at any point of this is reconnected to as mid-run
(``Control``), and the report goes again on the new channel.
Then, on the group server's connection, it drives its core (core/worker_core.py: what WEIGHTS
does to the copy held, what is pushed, what is recorded) around what needs torch and a clock:

    PULL(c, since) -> WEIGHTS   answered when the SSP bound allows; wait time and whom it waited
                                for are logged. The worker keeps a copy of the group's published
                                weights and names its version (``since``): the answer is either
                                the whole weights or the coordinates that changed since
                                (core.downlink); a new connection starts from the whole weights
    gradient on the next batch  of its shard, in the reference loop's order (minips.ml.reference);
                                with local steps H > 1 (WEIGHTS.local_steps) H gradients, each
                                at the local weights the core's local steps moved (core.local_steps)
    compress                    the core: with ``optimizer_at`` ``worker`` the update of the
                                worker's own SGD (core.worker_opt), through the run's compressor
                                with error feedback (on the device for top-k flavours off the
                                CPU: compress.device_compress)
    sleep                       so that the step takes max(compute, F x base_step_s)
    PUSH(c + 1) -> ACK          the core's step record, with the phases timed here

until the server says ``done`` (WEIGHTS.done or LEAVE "done") or ``max_steps`` pushes were made,
then it sends LEAVE to both servers. Calibration does not touch the model, the data stream or the
compressor, so N workers in BSP reproduce ``reference.train`` exactly.

Device: ``cfg.device`` (``auto``: CUDA, then MPS, then CPU) holds the model, its flat weights
and gradient (ml.device.Trainer); it goes to ``worker-<id>.device.json`` with the resident
memory (at the end and at its peak). Each step record carries the time of every phase (decode_s,
compute_s, compress_s, encode_s, push_s; wait_s is the pull) and the bytes copied from the
device to the host (host_bytes).

Emulated heterogeneity: slowdown F stretches every step of b samples to F x base_step_s x b /
batch_size with sleep (so results do not depend on CPU load); F may follow a schedule and random
throttling (``slowdown_schedule``, ``throttle``: core/slowdown.py, T counted from the first
ASSIGN), each change a ``slowdown`` event in the worker's file. In ``--mode lbbsp`` each WEIGHTS
names the batch of the next step (``batch``), taken in the shard's order (``data.BatchCursor``).
``bandwidth_bps`` / ``bandwidth_down_bps`` pace the group connection's sends / reads
with token buckets (``links.Pacing``, applied by ``channel.Channel.set_pacing``) and
``latency_s`` delays each send (docs/links.md; ``EmulatedLink`` below).

The module holds, in order: the worker's side of its connections, which the evaluator
(evaluator.py) uses too (``connect_role`` opens one with a ``WorkerConfig``'s settings,
``EmulatedLink`` is a channel on the worker's emulated link, ``Stopped`` says how a server ended
the session, ``leave`` says goodbye); what a worker builds from the run config before it trains
(``Parts``, ``build``: the model on its device, its data shard and endless batch stream, its
compressor, its files); its control session with the global server (``Control``: WELCOME, ASSIGN
again on regrouping or a new GDTopK ratio, the end of the run; when the global server is lost
it reconnects for up to ``reconnect_s``, and every new channel starts with the worker's latest
STATS, so a server resumed from an older checkpoint places it); and the training loop
(``Worker``), which reads ``Control.assign`` and ``done``, waits on ``assigned`` / ``changed`` /
``channel()`` and sends STATS on the control channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from minips import sparse
from minips.compress.base import Compressor
from minips.compress.device_compress import device_compressor
from minips.core.config import RunConfig, WorkerConfig
from minips.core.slowdown import Schedule, Slowdown, parse_schedule, parse_throttle
from minips.core.worker_core import Done, Step, WorkerCore
from minips.errors import AuthError, DataError, MiniPSError, RemoteProtocolError
from minips.ml import data, device, models
from minips.net import links, transport
from minips.net.channel import Channel
from minips.net.endpoints import client_ssl, parse_address, reachable
from minips.record.metrics import origin, record
from minips.record.rundir import JsonlWriter, RunDir, join_run
from minips.wire import control, messages

__all__ = [
    "EmulatedLink",
    "Stopped",
    "connect_role",
    "leave",
    "Parts",
    "build",
    "Control",
    "Worker",
    "WorkerStopped",
    "run_worker",
]


M = TypeVar("M", bound=messages.Message)


class EmulatedLink:
    """A channel on the worker's emulated link: paced to ``bandwidth_bps`` (sends) and
    ``down_bps`` (reads), bytes/s, 0 = full speed, as bytes go out and come in; ``latency_s``
    added before every send."""

    def __init__(self, ch: Channel, bandwidth_bps: float, latency_s: float,
                 down_bps: float = 0.0) -> None:
        self.ch = ch
        self.latency_s = latency_s
        pacing = links.Pacing.of(bandwidth_bps, down_bps, time.monotonic())
        if pacing is not None:
            ch.set_pacing(pacing)

    async def send(self, msg: messages.Message) -> None:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        await self.ch.send(msg)

    async def expect(self, kind: type[M]) -> M:
        """Next message of type ``kind``; heartbeats are skipped, ERROR / LEAVE raise."""
        while True:
            msg = await self.ch.recv()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, (control.Error, control.Leave)):
                raise Stopped(msg)


class Stopped(MiniPSError):
    """The server ended the session: LEAVE "done" or ERROR end the run, another LEAVE (a group
    server shutting down) only this connection."""

    def __init__(self, msg: control.Error | control.Leave) -> None:
        super().__init__(f"{type(msg).__name__}: {msg.reason}")
        self.error = ""  # why, when an ERROR ended the run
        if isinstance(msg, control.Error):
            self.final = msg.code != "lease"  # an expired lease only asks for a rejoin
            self.error = f"the group server sent ERROR {msg.code}: {msg.reason}"
        else:
            self.final = msg.reason == "done"


async def connect_role(cfg: WorkerConfig, host: str, port: int, role: str, worker_id: int, *,
                       group: int = -1, timeout: float | None = None,
                       retries: int | None = None) -> Channel:
    """One connection (``retries`` more attempts with backoff; None: as many as ``timeout``
    allows, so a board that boots before its server waits for it) within ``timeout`` seconds
    (default: ``cfg.connect_timeout_s``; inf: no end)."""
    timeout = cfg.connect_timeout_s if timeout is None else timeout
    return await transport.connect(host, port, role=role, worker_id=worker_id, group=group,
                                   token=cfg.token, timeout=timeout, ssl=client_ssl(cfg.tls_ca),
                                   retries=retries)


async def leave(ch: Channel) -> None:
    """Say LEAVE and close (whatever state the connection is in)."""
    with contextlib.suppress(Exception):
        await ch.close(leave="bye")


@dataclass
class Parts:
    """A worker's model, data and compressor, and the files it writes."""

    trainer: device.Trainer
    stream: Iterator[tuple[int, np.ndarray, np.ndarray]]  # (epoch, x, y) batches, endless
    first_batch: tuple[np.ndarray, np.ndarray]  # what calibration times (stream untouched)
    shard_size: int  # samples in the worker's shard
    compressor: Compressor  # placed on the device where it can be (device_compressor)
    writer: JsonlWriter  # worker-<id>.jsonl
    device_file: Path  # worker-<id>.device.json
    device_info: dict[str, Any]
    cursor: data.BatchCursor | None = None  # LB-BSP: batches of the size the group asks for
    data: dict[str, Any] = field(default_factory=dict)  # where its data came from (origin)

    def save_device_info(self, **more: Any) -> None:
        """Write worker-<id>.device.json with ``more`` added (resident memory at the end)."""
        self.device_info.update(more)
        self.device_file.write_text(json.dumps(self.device_info) + "\n")


def build(cfg: WorkerConfig, run: RunConfig, worker_id: int) -> Parts:
    """Build worker ``worker_id``'s parts, print where it computes and write that down."""
    aside = join_run(cfg.run_dir, run.to_info())  # never append to another run's files
    if aside is not None:
        print(f"minips worker {worker_id}: moved an earlier run's files in {cfg.run_dir} to "
              f"{aside}", file=sys.stderr, flush=True)
    torch.set_num_threads(cfg.torch_threads)
    dev = device.pick_device(cfg.device)
    model = models.build_model(run.model, run.seed)
    model.train()
    trainer = device.Trainer(model, run.model, dev, amp=cfg.amp)
    try:  # a worker never trains on a stand-in it was not asked for (`--data synthetic`)
        ds = data.load_dataset(run.dataset, "train", cfg.data_dir or run.data_dir,
                               synthetic=cfg.data == "synthetic", fallback=False)
    except DataError as exc:
        raise DataError(f"{exc} Or start the worker with --data synthetic to train on a "
                        "synthetic stand-in.") from None
    record(cfg.run_dir, f"worker-{worker_id}", ds.meta)
    shard = data.shard_indices(len(ds), worker_id, run.workers, run.seed, val_size=run.val_size)
    compressor = device_compressor(run.worker_compressor(trainer.size, worker_id), dev,
                                   on_device=cfg.compress_on_device)
    run_dir = RunDir(cfg.run_dir, t0=run.t0)
    info = {"worker": worker_id, **device.describe(dev, cfg.amp),
            "compress_on_device": compressor.on_device}
    parts = Parts(
        trainer=trainer, stream=data.batch_stream(ds, shard, run.batch_size, run.seed),
        first_batch=(ds.x[shard[: run.batch_size]], ds.y[shard[: run.batch_size]]),
        shard_size=len(shard), compressor=compressor,
        writer=run_dir.writer(f"worker-{worker_id}"),
        device_file=run_dir.file(f"worker-{worker_id}.device.json"), device_info=info,
        cursor=data.BatchCursor(ds, shard, run.seed) if run.sync.balanced else None,
        data=origin(ds.meta))
    print(f"minips worker {worker_id}: " + ", ".join(
        f"{k} {v}" for k, v in info.items() if k != "worker"), file=sys.stderr, flush=True)
    parts.save_device_info()
    return parts


def _no_assign(msg: control.Assign) -> None:
    """``Control.on_assign`` until the worker has its core: no ratio to set yet."""


def _why_lost(ch: Channel) -> str:
    """Why a channel ended, in words (``transport.failure_kind``; "it closed the connection"
    when nothing failed: a LEAVE, or a clean close)."""
    return "it closed the connection" if ch.error is None else transport.failure_kind(ch.error)


class Control:
    """The control session of one worker. ``event(name, **fields)`` records what happened to
    it (lost, back, gave up, stopped) in the worker's metrics file."""

    ch: Channel  # the control channel (set by ``open``, replaced on reconnect)

    def __init__(self, cfg: WorkerConfig, event: Callable[..., None]) -> None:
        self.cfg, self.event = cfg, event
        self.worker_id = cfg.worker_id  # the id the global server gave (WELCOME)
        self.heartbeat_s = 0.0  # from the run config, once known
        # an ASSIGN for the worker's core (its upload ratio: WorkerCore.on_assign)
        self.on_assign: Callable[[control.Assign], None] = _no_assign
        self.assign: control.Assign | None = None  # latest ASSIGN
        self.assigned = asyncio.Event()  # the first ASSIGN (or the end) arrived
        self.changed = asyncio.Event()  # set by every ASSIGN; cleared by its waiter
        self.done = False  # the run is over
        self.stopped_by = ""  # the ERROR that ended the run, if one did
        # the answer to the calibration's link probe (``Worker._probe_link``), while it waits
        self.probe: asyncio.Future[messages.GlobalWeights] | None = None
        self.stats: control.Stats | None = None  # the latest STATS (``report``)
        self.back = asyncio.Event()  # set when a reconnect opened a channel (or the run ended)

    async def open(self) -> dict[str, Any]:
        """Connect to the global server; returns WELCOME's info (the run config)."""
        self.ch = await connect_role(self.cfg, self.cfg.server_host, self.cfg.server_port,
                                     "worker", self.cfg.worker_id)
        info = dict(self.ch.welcome_info)
        self.worker_id = int(info.get("worker_id", self.cfg.worker_id))
        return info

    def address(self) -> str:
        """The assigned group server's address (after the first ASSIGN)."""
        assert self.assign is not None
        return str(self.assign.address)

    def group(self) -> int:
        """The assigned group (after the first ASSIGN)."""
        assert self.assign is not None
        return int(self.assign.group)

    async def channel(self, lost: Channel | None = None) -> Channel | None:
        """The control channel once it is open and not ``lost`` (one a send just failed on):
        after the global server was lost, the one ``loop``'s reconnect opens; None once the
        run is over."""
        while (self.ch is lost or self.ch.closed) and not self.done:
            self.back.clear()
            await self.back.wait()
        return None if self.done else self.ch

    async def report(self, stats: control.Stats) -> None:
        """Send STATS (a channel lost meanwhile is no error here). The latest goes again first
        on every channel a reconnect opens: a global server resumed from a checkpoint older
        than this worker's place learns its speed, and places it if it had no group there."""
        self.stats = stats
        with contextlib.suppress(ConnectionError, MiniPSError):
            await self.ch.send(stats)

    async def loop(self) -> None:
        """Read the control channel; when the global server is lost (mid-run or during the
        worker's start-up), reconnect with backoff until ``reconnect_s`` has passed. A worker
        without a group when it gives up has nothing to train: its run ends with that error."""
        while not self.done:
            await self._read()
            if self.probe is not None and not self.probe.done():  # no answer will come
                self.probe.set_exception(ConnectionResetError("the control channel closed"))
            if self.done:
                return
            self.event("control_lost")
            lost = time.monotonic()
            where = f"{self.cfg.server_host}:{self.cfg.server_port}"
            log.warning("worker %d: the global server at %s is gone (%s); retrying for up to "
                        "%.0f s", self.worker_id, where, _why_lost(self.ch), self.cfg.reconnect_s)
            try:
                self.ch = await connect_role(self.cfg, self.cfg.server_host,
                                             self.cfg.server_port, "worker", self.worker_id,
                                             timeout=self.cfg.reconnect_s, retries=None)
            except (ConnectionError, AuthError) as exc:
                self.event("control_gave_up", reason=str(exc))
                log.warning("worker %d: the global server at %s did not come back: %s",
                            self.worker_id, where, exc)
                if not self.assigned.is_set():
                    self.end(f"the global server at {where} did not come back: {exc}")
                return
            self.ch.start_heartbeat(self.heartbeat_s)
            if self.stats is not None:
                await self.report(self.stats)
            self.event("control_back")
            log.warning("worker %d: the global server is back after %.1f s", self.worker_id,
                        time.monotonic() - lost)
            self.back.set()

    async def _read(self) -> None:
        """ASSIGN (group, ratio), LEAVE "done", ERROR; returns when the channel closes."""
        with contextlib.suppress(ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError):
            while True:
                msg = await self.ch.recv()
                if isinstance(msg, control.Assign):
                    self.assign = msg
                    self.on_assign(msg)
                    self.assigned.set()
                    self.changed.set()
                elif isinstance(msg, control.Error):
                    self.end(f"the global server sent ERROR {msg.code}: {msg.reason}")
                    return
                elif isinstance(msg, control.Leave) and msg.reason == "done":
                    self.end()
                    return
                elif isinstance(msg, control.Leave):
                    return
                elif isinstance(msg, messages.GlobalWeights) and self.probe is not None \
                        and not self.probe.done():
                    self.probe.set_result(msg)

    def end(self, error: str = "") -> None:
        """The run is over: normally (LEAVE "done"), or cut short by a server's ``error``."""
        if error and not self.done:
            self.stopped_by = error
            self.event("stopped", reason=error)
        self.done = True
        self.assigned.set()
        self.changed.set()
        self.back.set()


log = logging.getLogger("minips.worker")

STATS_EVERY_S = 1.0  # how often the worker reports its step time to the global server
STATUS_EVERY_S = 10.0  # how often it says where it is on its console (one line)
ASSIGN_TIMEOUT_S = 300.0  # give up when no group is assigned after this long
# the link probe's answer, the weights whole, may take this long (a 25 MB model over 2 mbit:
# 100 s); a worker that waits longer reports its compute time alone
PROBE_TIMEOUT_S = 120.0
PROBES = 2  # link probes a worker sends; the fastest counts (roster.Roster.probe_pushed)
LEAVE_REASON_CHARS = 2000  # a LEAVE's reason is cut to this (the wire allows 4096)
# A gradient that took less than this share of heartbeat_s runs on the event loop's thread
# (``Worker._gradient``): 0.25 s at the default 2 s, far inside the lease (2 x heartbeat_s)
INLINE_SHARE = 0.125
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.1, 2.0  # group reconnect delays (doubling, jittered)


# Calibration: the speed a worker reports before it is grouped. A CPU quota (a cgroup's, or a
# board that throttles) runs a process at full speed for its share of each period, then not at
# all: steps shorter than the period mostly run fast, with one long step per period. So the
# worker times windows of consecutive steps, each longer than two quota periods (the kernel's
# default period is 100 ms), takes each window's mean step (what the quota allows) and reports
# the median window (a start-up hiccup in one window does not count). The fastest step, reported
# before, read a worker held to 20% of a core as faster than a free one.
CALIB_WINDOW_S = 0.25  # seconds of steps in one window
CALIB_WINDOWS = 3  # windows timed at least; their median is the reported step time


def calibrated_step_time(times: list[float], window_s: float = CALIB_WINDOW_S) -> float:
    """The step time (s) to report from calibration step ``times`` (s, in order): consecutive
    steps in windows of at least ``window_s`` (a shorter rest joins the last window), each
    window's mean step, their median. Steps longer than ``window_s`` are windows of one: the
    median of the steps."""
    windows: list[list[float]] = [[]]
    for t in times:
        if sum(windows[-1]) >= window_s:
            windows.append([])
        windows[-1].append(t)
    if len(windows) > 1 and sum(windows[-1]) < window_s:
        rest = windows.pop()
        windows[-1] += rest
    return float(np.median([np.mean(w) for w in windows]))


def calibration_done(times: list[float], steps: int) -> bool:
    """Enough steps timed: at least ``steps`` of them and ``CALIB_WINDOWS`` windows."""
    return len(times) >= max(1, steps) and sum(times) >= CALIB_WINDOWS * CALIB_WINDOW_S


def probe_payload(grad: Any, wire: Any, ratio: float) -> Any:
    """What a PUSH of the (n,) gradient ``grad`` (torch or numpy) carries on the wire, for the
    link probe: dense as ``wire`` (a compressor's ``WireSpec``) says, or its ``ratio`` largest
    entries (sparse); the compressor and its residual are not touched."""
    g = grad.detach().float().cpu().numpy() if hasattr(grad, "detach") else np.asarray(grad)
    g = g.astype(np.float32, copy=False).reshape(-1)  # (n,) float32
    if not wire.sparse:
        return sparse.encode_vector(g, value_dtype=wire.dtype)
    k = max(1, min(g.size, round(ratio * g.size)))
    idx = np.sort(np.argpartition(np.abs(g), g.size - k)[g.size - k:]).astype(np.uint32)  # (k,)
    return sparse.encode_vector(sparse.SparseVector(idx, g[idx], g.size), value_dtype=wire.dtype)


class WorkerStopped(MiniPSError):
    """A server ended this worker's run with ERROR (``minips worker`` exits non-zero)."""


class Worker:
    """One training worker; ``await Worker(cfg).run()``."""

    parts: Parts  # model, data, compressor, files (``_setup``)
    core: WorkerCore  # the worker's rules: WEIGHTS, PUSH, ACK, the step record (``_setup``)

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.id = cfg.worker_id
        self.run_cfg = RunConfig()
        self.control = Control(cfg, self._event)  # the session with the global server
        self.writer: JsonlWriter | None = None  # set up once WELCOME told the run config
        self.slowdown = Slowdown(Schedule.flat(cfg.slowdown))  # F over time (core/slowdown.py)
        self.factor = self.slowdown.factor(0.0)  # F of the last step
        self.trained_at: float | None = None  # monotonic time of the first ASSIGN
        self.compute_s = math.inf  # the last gradient's time (``_gradient``); none yet
        self._init_sent: Channel | None = None  # the channel INIT_WEIGHTS went on (if any)
        self._stats_at = self._status_at = time.monotonic()  # last STATS, console line
        self._recent: list[float] = []  # step times since the last STATS

    @property
    def clock(self) -> int:
        """Pushes the group acknowledged (0 before the core exists: calibration)."""
        return self.core.clock if "core" in vars(self) else 0

    @property
    def samples(self) -> int:
        """Samples of the pushes acknowledged."""
        return self.core.samples if "core" in vars(self) else 0

    # -- setup -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, calibrate, train until done, leave."""
        info = await self.control.open()
        self.id = self.control.worker_id
        self.run_cfg = RunConfig.from_info(info)
        self.control.heartbeat_s = self.run_cfg.heartbeat_s
        self.control.ch.start_heartbeat(self.run_cfg.heartbeat_s)
        try:
            self._setup()
        except MiniPSError as exc:  # no data here, say: the server is told why, not "lost"
            await self.control.ch.close(leave=f"refused to start: {exc}"[:LEAVE_REASON_CHARS])
            raise
        self.control.on_assign = self.core.on_assign
        self.slowdown = _slowdown(self.cfg, self.run_cfg.seed, self.id)
        self.factor = self.slowdown.factor(0.0)
        reader = asyncio.create_task(self.control.loop())
        try:
            # lost meanwhile: ``_join`` sends them on the next channel if its WELCOME asks
            with contextlib.suppress(ConnectionError):
                await self._send_initial(self.control.ch)
            calibrated = await self._calibrate()
            if calibrated is not None:
                await self._join(*calibrated)
            if not self.control.done:  # a worker that joined as the run ended trains nothing
                await asyncio.wait_for(self.control.assigned.wait(), ASSIGN_TIMEOUT_S)
                self.trained_at = time.monotonic()  # a slowdown schedule counts from here
                await self._train()
        finally:
            reader.cancel()
            await leave(self.control.ch)
            if self.writer is not None:
                self.parts.save_device_info(**device.rss_mb(), steps=self.clock)
                self.writer.close()
        if self.control.stopped_by:
            raise WorkerStopped(self.control.stopped_by)
        core = self.core
        print(f"minips worker {self.id}: done after {core.own_steps} steps of its own in "
              f"{core.pushes} pushes, {self.samples:,} samples (its group's clock {self.clock})",
              file=sys.stderr, flush=True)

    def _setup(self) -> None:
        """Model, data, compressor and files, once WELCOME told the run config."""
        parts = build(self.cfg, self.run_cfg, self.id)
        self.parts, self.trainer, self.compressor = parts, parts.trainer, parts.compressor
        self.stream, self.writer = parts.stream, parts.writer
        self.core = WorkerCore(self.run_cfg, self.compressor, self.id, parts.shard_size)

    async def _send_initial(self, ch: Channel) -> None:
        """INIT_WEIGHTS on ``ch`` when its WELCOME asks for them (a server started without
        --init), once a channel."""
        if not ch.welcome_info.get("need_init") or ch is self._init_sent:
            return
        self._init_sent = ch
        flat = self.trainer.host_weights()  # (n,) float32
        await ch.send(messages.InitWeights(size=int(flat.size),
                                           payload=sparse.encode_vector(flat)))

    async def _calibrate(self) -> tuple[Any, float, float] | None:
        """Time steps on the first batch (model, stream and compressor untouched) until
        ``calibration_done``; return the last (gradient, loss) and ``calibrated_step_time`` of
        them (None when the run ended meanwhile: nothing to report). The first step is not
        timed: it pays for one-off allocations and lazy initialisation. Nothing here talks to
        the global server: a server lost meanwhile costs the calibration nothing."""
        loss, grad = await self._gradient(*self.parts.first_batch)
        times: list[float] = []
        while not calibration_done(times, self.run_cfg.calib_steps) and not self.control.done:
            t = time.perf_counter()
            loss, grad = await self._gradient(*self.parts.first_batch)
            times.append(await self._stretch(time.perf_counter() - t))
        if self.control.done:
            return None
        step_time = calibrated_step_time(times)
        print(f"minips worker {self.id}: {1e3 * step_time:.0f} ms/step measured "
              f"({len(times)} steps); waiting for its group", file=sys.stderr, flush=True)
        return grad, loss, step_time

    async def _join(self, grad: Any, loss: float, step_time: float) -> None:
        """Report the calibration on the control channel: the initial weights and the link
        probe when its WELCOME asks for them, then STATS (``Control.report``: sent again first
        on every channel a reconnect opens). A global server lost before the probe is through
        is not an error: all of it again on the channel ``Control.loop`` opens, as mid-run."""
        lost: Channel | None = None
        while (ch := await self.control.channel(lost)) is not None:
            try:
                await self._send_initial(ch)
                if ch.welcome_info.get("link_probe"):  # a server that groups by it
                    await self._probe_link(ch, grad, loss, step_time)
            except ConnectionError:
                lost = ch
                continue
            await self.control.report(control.Stats(clock=0, step_time=step_time, loss=loss,
                                                    samples=0, data=self.parts.data))
            self._stats_at = self._status_at = time.monotonic()
            return

    async def _probe_link(self, ch: Channel, grad: Any, loss: float, step_time: float) -> None:
        """The calibration's link probe (``roster.Roster.probe_pulled`` says why): a PULL on
        the control channel ``ch``, answered with the global weights whole, then a PUSH the
        size of a real one, which the global server times and drops. The control channel goes
        over the worker's emulated link from here on, as all of a real link's traffic would.
        ``ConnectionError`` when ``ch`` is lost meanwhile."""
        link = EmulatedLink(ch, self.cfg.bandwidth_bps, self.cfg.latency_s,
                            self.cfg.bandwidth_down_bps)
        payload = probe_payload(grad, self.compressor.wire, self.compressor.ratio)
        try:
            for _ in range(PROBES):
                self.control.probe = asyncio.get_running_loop().create_future()
                await link.send(messages.Pull(clock=0))
                await asyncio.wait_for(self.control.probe, PROBE_TIMEOUT_S)
                await link.send(messages.Push(clock=1, step_time=step_time, loss=loss,
                                              payload=payload))
        except TimeoutError as exc:  # grouped by its compute time alone
            self._event("link_probe_failed", reason=str(exc) or type(exc).__name__)
        finally:
            self.control.probe = None

    def _event(self, event: str, **fields: Any) -> None:
        if self.writer is not None:
            self.writer.write({"t": time.time() - self.run_cfg.t0, "worker": self.id,
                               "event": event, "clock": self.clock, **fields})

    # -- training ----------------------------------------------------------------------------

    async def _train(self) -> None:
        while not self.control.done:
            ch = await self._connect_group()
            if ch is None:
                return
            # the group server renews our lease on any bytes: heartbeats keep it while we wait
            # for a slower worker or compute a step longer than the lease; it sends them too, so
            # a silent group server is gone (stalled, or its machine vanished): leave it
            ch.start_heartbeat(self.run_cfg.heartbeat_s)
            ch.start_silence_limit(self.run_cfg.lease_s)
            link = EmulatedLink(ch, self.cfg.bandwidth_bps, self.cfg.latency_s,
                        self.cfg.bandwidth_down_bps)
            try:
                # the group's clock for us (pull before pushing), and whole weights next
                self.core.on_join(await link.expect(messages.Ack))
                await self._loop(link, self.control.address())
            except Stopped as exc:
                if exc.final:
                    self.control.end(exc.error)
                elif exc.error:  # ERROR lease: we were silent too long; rejoin on the next turn
                    self._event("lease_expired", reason=exc.error)
            except (ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError) as exc:
                if not self.control.done:  # at the end the group server closes: not a loss
                    self._event("group_lost", reason=str(exc))  # reconnect on the next turn
            finally:
                await leave(ch)

    async def _connect_group(self) -> Channel | None:
        """Connect to the assigned group server, retrying with backoff and jitter (and at once
        when a new ASSIGN arrives) for up to ``reconnect_s``; None once the run is done."""
        told = ""  # the address whose failure was reported (once each, not every retry)

        async def attempt(left: float) -> Channel | None:
            if self.control.done:
                return None
            # no host (an in-process group server): the one we reached the global server at
            address = reachable(self.control.address(), self.cfg.server_host)
            host, port = parse_address(address)
            try:
                return await connect_role(self.cfg, host, port, "worker", self.id,
                                          group=self.control.group(), retries=0)
            except (ConnectionError, AuthError) as exc:
                nonlocal told
                if told != address:
                    told = address
                    self._event("group_unreachable", address=address, reason=str(exc))
                    log.warning("worker %d: cannot reach group server %s (%s); retrying for "
                                "up to %.0f s", self.id, address, exc, self.cfg.reconnect_s)
                raise

        return await transport.backoff(
            attempt, timeout=self.cfg.reconnect_s, what="group server lost",
            retry_on=(ConnectionError, AuthError), first=RECONNECT_FIRST_S,
            most=RECONNECT_MAX_S, wake=self.control.changed)

    async def _loop(self, link: EmulatedLink, address: str) -> None:
        """Steps on one group server until done, the cap, or a new group address."""
        while not self.control.done and address == self.control.address():
            pull = self.core.pull(time.monotonic())
            if isinstance(pull, Done):  # max_steps pushes made
                self.control.done = True
                return
            await link.send(pull)
            w = await link.expect(messages.Weights)
            t_step = time.perf_counter()
            step = self.core.on_weights(w, time.monotonic())
            del w  # the weights frame, a whole model's worth, is not kept through the step
            if isinstance(step, Done):
                self.control.done = True
                return
            await self._step(link, step, t_step)

    async def _step(self, link: EmulatedLink, step: Step, t: float) -> None:
        """One push from WEIGHTS decoded at ``t``: its gradients, packet, PUSH and ACK, and
        the step's record with the time of each phase."""
        self.trainer.load(step.weights)
        lap = [t, time.perf_counter()]  # phase boundaries: decode, compute, compress, encode
        epoch, step_time = await self._compute(step, t)
        lap.append(time.perf_counter())
        packet = self.core.compress()
        lap.append(time.perf_counter())
        payload = self.core.encode(packet)  # in the compressor's declared encoding
        lap.append(time.perf_counter())
        if step_time is None:  # one gradient: its step runs until its push is encoded
            step_time = await self._stretch(lap[-1] - t, self.core.step_samples)
        push = self.core.push(payload, step_time)
        sent_before, t_push = link.ch.bytes_sent, time.perf_counter()
        await link.send(push)
        wire_bytes = link.ch.bytes_sent - sent_before  # the whole frame, as counted by the channel
        record = self.core.on_ack(await link.expect(messages.Ack), wire_bytes)
        push_s = time.perf_counter() - t_push
        phases = dict(zip(("decode_s", "compute_s", "compress_s", "encode_s"),
                          np.diff(lap).tolist(), strict=True))
        self._record(record, epoch, link, push_s=push_s,
                     host_bytes=self.compressor.host_bytes, **phases)
        await self._maybe_stats(step_time, push.loss)

    async def _compute(self, step: Step, t: float) -> tuple[int, float | None]:
        """The step's gradients, each handed to the core: (the last batch's epoch, and with
        local steps the mean of their times, each max(compute, F x base_step_s), the first
        from ``t`` so it includes decoding; None for one gradient: ``_step`` times it)."""
        weights: np.ndarray | None = step.weights
        epoch, t_i = 0, t
        times: list[float] = []
        while weights is not None:
            if times:
                self.trainer.load(weights)  # the local weights the last local step moved
            epoch, xb, yb = self._next_batch(step.batch)
            # grad: (n,) float32 on the device, reused by the next call (the core reads it first)
            loss, grad = await self._gradient(xb, yb)
            weights = self.core.on_gradient(grad, loss, len(yb))
            if step.local_steps > 1:
                times.append(await self._stretch(time.perf_counter() - t_i, len(yb)))
                t_i = time.perf_counter()
        return epoch, float(np.mean(times)) if times else None

    async def _gradient(self, xb: Any, yb: Any) -> tuple[float, Any]:
        """``trainer.gradient(xb, yb)``: on the event loop's thread when the last one took
        less than ``INLINE_SHARE`` of the heartbeat interval, else in a thread, so that the loop
        keeps sending heartbeats during a long step. A short step stays inline because a hand-off
        to a thread and back costs two wake-ups, and on a machine whose cores are shared by
        more processes than it has (8 workers on 2 cores) each wake-up can wait for a time
        slice: in threads, a 17 ms LeNet-5 step took 30 ms (median) there, inline 16 ms."""
        t = time.perf_counter()
        if self.compute_s < INLINE_SHARE * self.run_cfg.heartbeat_s:
            out = self.trainer.gradient(xb, yb)
        else:  # the first one (its time is not known yet), and every long one
            out = await asyncio.to_thread(self.trainer.gradient, xb, yb)
        self.compute_s = time.perf_counter() - t
        return out

    def _next_batch(self, batch: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The step's (epoch, x, y): the stream's next batch, or (LB-BSP) the next ``batch``
        samples (0: the run's) in the same order."""
        if self.parts.cursor is None:
            return next(self.stream)
        return self.parts.cursor.take(batch or self.run_cfg.batch_size)

    async def _stretch(self, compute_s: float, samples: int = 0) -> float:
        """Sleep so a step of ``samples`` (0: the run's batch) takes F x base_step_s x samples
        / batch_size at least, F as the slowdown says now (a change is an event); return the
        step's duration."""
        factor = self.slowdown.factor(self.training_s())
        if factor != self.factor:
            self._event("slowdown", factor=factor, was=self.factor)
            self.factor = factor
        share = (samples or self.run_cfg.batch_size) / self.run_cfg.batch_size
        target = factor * self.run_cfg.base_step_s * share
        if compute_s < target:
            await asyncio.sleep(target - compute_s)
        return max(compute_s, target)

    def training_s(self) -> float:
        """Seconds since the first ASSIGN (0 before it: calibration)."""
        return 0.0 if self.trained_at is None else time.monotonic() - self.trained_at

    async def _maybe_stats(self, step_time: float, loss: float) -> None:
        """Every STATS_EVERY_S: the median step time since the last report (one slow step under
        CPU contention must not move a worker to another group)."""
        self._recent.append(step_time)
        if time.monotonic() - self._status_at >= STATUS_EVERY_S:
            self._status_at = time.monotonic()
            print(f"minips worker {self.id}: group {self.control.group()}, step {self.clock}, "
                  f"loss {loss:.3f}, {1e3 * step_time:.0f} ms/step", file=sys.stderr, flush=True)
        if time.monotonic() - self._stats_at >= STATS_EVERY_S:
            self._stats_at = time.monotonic()
            median, self._recent = float(np.median(self._recent)), []
            await self.control.report(control.Stats(clock=self.clock, step_time=median,
                                                    loss=loss, samples=self.samples))

    def _record(self, record: dict[str, Any], epoch: int, link: EmulatedLink,
                **measured: Any) -> None:
        """The core's step ``record`` (core.worker_core.step_record) with what the worker
        measured: its time, the batch's epoch, F, the link's counters and the phases."""
        assert self.writer is not None
        self.writer.write({"t": time.time() - self.run_cfg.t0, **record, "epoch": epoch,
                           "slowdown": self.factor, "link_bytes_up": link.ch.bytes_sent,
                           "link_bytes_down": link.ch.bytes_received, **measured})


def _slowdown(cfg: WorkerConfig, seed: int, worker: int) -> Slowdown:
    """The worker's emulated factor over time: ``slowdown_schedule`` (else the flat
    ``slowdown``) times its ``throttle`` (core/slowdown.py)."""
    schedule = (parse_schedule(cfg.slowdown_schedule) if cfg.slowdown_schedule
                else Schedule.flat(cfg.slowdown))
    throttle = parse_throttle(cfg.throttle) if cfg.throttle else None
    return Slowdown(schedule, throttle, seed=seed, worker=worker)


def run_worker(cfg: WorkerConfig) -> None:
    """`minips worker`: train until the server says done."""
    device.pick_device(cfg.device)  # a device that is not here fails before connecting
    transport.install_uvloop()
    asyncio.run(Worker(cfg).run())



