"""Worker training loop and evaluator loop (PyTorch; the only torch code on the network path).

A worker knows only the global server's address. It connects (role ``worker``), learns the run
config from WELCOME.info, builds the model and its data shard, times ``calib_steps`` steps and
reports them (STATS, clock 0), then waits for ASSIGN (its group server, upload ratio, staleness).
Then, on the group server's connection:

    PULL(c, since) -> WEIGHTS   answered when the SSP bound allows; wait time and whom it waited
                                for are logged. The worker keeps a copy of the group's published
                                weights and names its version (``since``): the answer is either
                                the whole weights or the coordinates that changed since
                                (minips.downlink); a new connection starts from the whole weights
    gradient on the next batch  of its shard, in the reference loop's order (minips.reference)
    compress                    sparse.make_compressor, error feedback kept here (on the
                                device for top-k flavours off the CPU: compress.device_compress)
    sleep                       so that the step takes max(compute, F x base_step_s)
    PUSH(c + 1) -> ACK

until the server says ``done`` (WEIGHTS.done or LEAVE "done") or ``max_steps`` pushes were made,
then it sends LEAVE to both servers. Calibration does not touch the model, the data stream or the
compressor, so N workers in BSP reproduce ``reference.train`` exactly.

Device: ``cfg.device`` (``auto``: CUDA, then MPS, then CPU) holds the model, its flat weights
and gradient (minips.device.Trainer); the worker prints it and writes it to
``worker-<id>.device.json`` in the run directory, adding its resident memory (at the end and at
its peak) when it leaves.
Each step record carries the time of every phase (decode_s, compute_s, compress_s, encode_s,
push_s; wait_s is the pull) and the bytes copied from the device to the host (host_bytes).

Emulated heterogeneity: slowdown F stretches every step with sleep (so results do not depend on
CPU load); ``bandwidth_bps`` / ``bandwidth_down_bps`` pace the group connection's sends / reads
with token buckets (``links.Pacing``, applied by ``channel.Channel.set_pacing``) and
``latency_s`` delays each send (docs/links.md).

The evaluator (role ``evaluator``) pulls the global weights every ``eval_every_s`` and writes
accuracy, loss and the global counters to eval.jsonl until the run is done; when the global
server is lost it reconnects for up to ``reconnect_s``, as a worker does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from typing import Any

import numpy as np
import torch

from minips import data, device, links, models, protocol, provenance, sparse, transport
from minips.compress.device_compress import device_compressor
from minips.config import RunConfig, WorkerConfig, client_ssl, parse_address, reachable
from minips.downlink import apply_weights
from minips.errors import AuthError, MiniPSError, RemoteProtocolError
from minips.metrics import JsonlWriter, RunDir

__all__ = ["Worker", "WorkerStopped", "run_worker", "run_evaluator", "evaluate_loop"]

log = logging.getLogger("minips.worker")

STATS_EVERY_S = 1.0  # how often the worker reports its step time to the global server
ASSIGN_TIMEOUT_S = 300.0  # give up when no group is assigned after this long
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.1, 2.0  # group reconnect delays (doubling, jittered)
RECONNECT_ATTEMPTS = 10_000  # control reconnect: reconnect_s bounds it, not the count


class Link:
    """A channel on the worker's emulated link: paced to ``bandwidth_bps`` (sends) and
    ``down_bps`` (reads), bytes/s, 0 = full speed, as bytes go out and come in; ``latency_s``
    added before every send."""

    def __init__(self, ch: Any, bandwidth_bps: float, latency_s: float,
                 down_bps: float = 0.0) -> None:
        self.ch = ch
        self.latency_s = latency_s
        pacing = links.Pacing.of(bandwidth_bps, down_bps, time.monotonic())
        if pacing is not None:
            ch.set_pacing(pacing)

    async def send(self, msg: Any) -> None:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        await self.ch.send(msg)

    async def expect(self, kind: type) -> Any:
        """Next message of type ``kind``; heartbeats are skipped, ERROR / LEAVE raise."""
        while True:
            msg = await self.ch.recv()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, (protocol.Error, protocol.Leave)):
                raise _Stopped(msg)


class _Stopped(MiniPSError):
    """The server ended the session: LEAVE "done" or ERROR end the run, another LEAVE (a group
    server shutting down) only this connection."""

    def __init__(self, msg: Any) -> None:
        super().__init__(f"{type(msg).__name__}: {msg.reason}")
        self.error = ""  # why, when an ERROR ended the run
        if isinstance(msg, protocol.Error):
            self.final = msg.code != "lease"  # an expired lease only asks for a rejoin
            self.error = f"the group server sent ERROR {msg.code}: {msg.reason}"
        else:
            self.final = msg.reason == "done"


class WorkerStopped(MiniPSError):
    """A server ended this worker's run with ERROR (``minips worker`` exits non-zero)."""


class Worker:
    """One training worker; ``await Worker(cfg).run()``."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.id = cfg.worker_id
        self.run_cfg = RunConfig()
        self.assign: Any = None  # latest ASSIGN
        self._assigned = asyncio.Event()  # the first ASSIGN (or the end) arrived
        self._assign_changed = asyncio.Event()  # set by every ASSIGN; cleared by its waiter
        self.done = False  # the server said the run is over
        self.stopped_by = ""  # the ERROR that ended the run, if one did
        self.clock = 0
        self.samples = 0
        self.replica: np.ndarray | None = None  # (n,) float32 the group's published weights
        self.held = -1  # their version on the current group connection; -1: none
        self.writer: JsonlWriter | None = None
        self.ctl: Any = None

    # -- setup -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, calibrate, train until done, leave."""
        self.ctl = await _connect(self.cfg, self.cfg.server_host, self.cfg.server_port,
                                  "worker", self.cfg.worker_id)
        info = dict(self.ctl.welcome_info)
        self.id = int(info.get("worker_id", self.cfg.worker_id))
        self.run_cfg = RunConfig.from_info(info)
        self.ctl.start_heartbeat(self.run_cfg.heartbeat_s)
        self._setup()
        reader = asyncio.create_task(self._control_loop())
        try:
            if info.get("need_init"):
                await self._send_initial()
            await self._calibrate()
            await asyncio.wait_for(self._assigned.wait(), ASSIGN_TIMEOUT_S)
            await self._train()
        finally:
            reader.cancel()
            await _leave(self.ctl)
            if self.writer is not None:
                self._save_device_info(**device.rss_mb(), steps=self.clock)
                self.writer.close()
        if self.stopped_by:
            raise WorkerStopped(self.stopped_by)

    def _setup(self) -> None:
        run = self.run_cfg
        torch.set_num_threads(self.cfg.torch_threads)
        dev = device.pick_device(self.cfg.device)
        self.model = models.build_model(run.model, run.seed)
        self.model.train()
        self.trainer = device.Trainer(self.model, run.model, dev, amp=self.cfg.amp)
        ds = data.load_dataset(run.dataset, "train", self.cfg.data_dir or run.data_dir)
        provenance.record(self.cfg.run_dir, f"worker-{self.id}", ds.meta)
        shard = data.shard_indices(len(ds), self.id, run.workers, run.seed)
        self.shard_size = len(shard)
        self.stream = data.batch_stream(ds, shard, run.batch_size, run.seed)
        self.first_batch = (ds.x[shard[: run.batch_size]], ds.y[shard[: run.batch_size]])
        size = sum(p.numel() for p in self.model.parameters())
        host = sparse.make_compressor(run.compressor, size, ratio=run.ratio,
                                      seed=run.seed * 1000 + self.id, **run.compressor_opts)
        self.compressor = device_compressor(host, dev, on_device=self.cfg.compress_on_device)
        run_dir = RunDir(self.cfg.run_dir, t0=run.t0)
        self.writer = run_dir.writer(f"worker-{self.id}")
        self.device_file = run_dir.file(f"worker-{self.id}.device.json")
        self.device_info = {"worker": self.id, **device.describe(dev, self.cfg.amp),
                            "compress_on_device": self.compressor.on_device}
        print(f"minips worker {self.id}: " + ", ".join(
            f"{k} {v}" for k, v in self.device_info.items() if k != "worker"),
            file=sys.stderr, flush=True)
        self._save_device_info()

    def _save_device_info(self, **more: Any) -> None:
        """worker-<id>.device.json in the run directory: where it computes (and, at the end, its
        resident memory)."""
        self.device_info.update(more)
        self.device_file.write_text(json.dumps(self.device_info) + "\n")

    async def _send_initial(self) -> None:
        flat = self.trainer.host_weights()  # (n,) float32
        encoding, codec, buffers = sparse.encode_gradient(flat)
        await self.ctl.send(protocol.Push(clock=0, encoding=encoding,
                                          codec={**codec, "size": int(flat.size)},
                                          buffers=tuple(buffers)))

    async def _calibrate(self) -> None:
        """Time a few steps on the first batch (model, stream and compressor untouched)."""
        times, loss = [], 0.0
        for _ in range(max(1, self.run_cfg.calib_steps)):
            t = time.perf_counter()
            loss, _ = await asyncio.to_thread(self.trainer.gradient, *self.first_batch)
            times.append(await self._stretch(time.perf_counter() - t))
        # The fastest step: other processes starting up only ever make a step slower.
        await self.ctl.send(protocol.Stats(clock=0, step_time=float(np.min(times)),
                                           loss=loss, samples=0))
        self._stats_at = time.monotonic()
        self._recent: list[float] = []  # step times since the last STATS

    async def _control_loop(self) -> None:
        """Read the control channel; when the global server is lost mid-run, reconnect with
        backoff (it may come back with --resume) until ``reconnect_s`` has passed."""
        while not self.done:
            await self._read_control()
            if self.done:
                return
            self._event("control_lost")
            try:
                self.ctl = await _connect(self.cfg, self.cfg.server_host, self.cfg.server_port,
                                          "worker", self.id, timeout=self.cfg.reconnect_s,
                                          retries=RECONNECT_ATTEMPTS)
            except (ConnectionError, AuthError) as exc:
                self._event("control_gave_up", reason=str(exc))
                return
            self.ctl.start_heartbeat(self.run_cfg.heartbeat_s)
            self._event("control_back")

    async def _read_control(self) -> None:
        """Control channel: ASSIGN (group, ratio), LEAVE "done"; returns when it closes."""
        with contextlib.suppress(ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError):
            while True:
                msg = await self.ctl.recv()
                if isinstance(msg, protocol.Assign):
                    self.assign = msg
                    self.compressor.set_ratio(msg.ratio)
                    self._assigned.set()
                    self._assign_changed.set()
                elif isinstance(msg, protocol.Error):
                    self._end(f"the global server sent ERROR {msg.code}: {msg.reason}")
                    return
                elif isinstance(msg, protocol.Leave) and msg.reason == "done":
                    self._end()
                    return
                elif isinstance(msg, protocol.Leave):
                    return

    def _end(self, error: str = "") -> None:
        """The run is over: normally (LEAVE "done"), or cut short by a server's ``error``."""
        if error and not self.done:
            self.stopped_by = error
            self._event("stopped", reason=error)
        self.done = True
        self._assigned.set()
        self._assign_changed.set()

    def _event(self, event: str, **fields: Any) -> None:
        if self.writer is not None:
            self.writer.write({"t": time.time() - self.run_cfg.t0, "worker": self.id,
                               "event": event, "clock": self.clock, **fields})

    # -- training ----------------------------------------------------------------------------

    async def _train(self) -> None:
        while not self.done:
            ch = await self._connect_group()
            if ch is None:
                return
            # the group server renews our lease on any bytes: heartbeats keep it while we wait
            # for a slower worker or compute a step longer than the lease; it sends them too, so
            # a silent group server is gone (stalled, or its machine vanished): leave it
            ch.start_heartbeat(self.run_cfg.heartbeat_s)
            ch.start_silence_limit(self.run_cfg.lease_s)
            link = Link(ch, self.cfg.bandwidth_bps, self.cfg.latency_s,
                        self.cfg.bandwidth_down_bps)
            self.held = -1  # a new connection (another group, a restarted one): whole weights
            try:
                ack = await link.expect(protocol.Ack)
                self.clock = int(ack.clock)  # the group's clock for us: pull before pushing
                await self._loop(link, self.assign.address)
            except _Stopped as exc:
                if exc.final:
                    self._end(exc.error)
                elif exc.error:  # ERROR lease: we were silent too long; rejoin on the next turn
                    self._event("lease_expired", reason=exc.error)
            except (ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError) as exc:
                self._event("group_lost", reason=str(exc))  # reconnect on the next turn
            finally:
                await _leave(ch)

    async def _connect_group(self) -> Any:
        """Connect to the assigned group server, retrying with backoff and jitter (and at once
        when a new ASSIGN arrives) for up to ``reconnect_s``; None once the run is done."""
        deadline = time.monotonic() + self.cfg.reconnect_s
        delay = RECONNECT_FIRST_S
        told = ""  # the address whose failure was reported (once each, not every retry)
        while not self.done:
            # no host (an in-process group server): the one we reached the global server at
            address = reachable(self.assign.address, self.cfg.server_host)
            host, port = parse_address(address)
            try:
                return await _connect(self.cfg, host, port, "worker", self.id,
                                      group=self.assign.group, retries=0)
            except (ConnectionError, AuthError) as exc:
                if told != address:
                    told = address
                    self._event("group_unreachable", address=address, reason=str(exc))
                    log.warning("worker %d: cannot reach group server %s (%s); retrying for "
                                "up to %.0f s", self.id, address, exc, self.cfg.reconnect_s)
                if time.monotonic() > deadline:
                    raise ConnectionError(f"group server lost for {self.cfg.reconnect_s} s: "
                                          f"{exc}") from None
            self._assign_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._assign_changed.wait(),
                                       delay * random.uniform(0.5, 1.0))
            delay = min(2 * delay, RECONNECT_MAX_S)
        return None

    async def _loop(self, link: Link, address: str) -> None:
        """Steps on one group server until done, the cap, or a new group address."""
        cap = self.run_cfg.max_steps
        while not self.done and address == self.assign.address:
            if cap and self.clock >= cap:
                self.done = True
                return
            t = time.monotonic()
            await link.send(protocol.Pull(clock=self.clock, since=self.held))
            w = await link.expect(protocol.Weights)
            wait_s = time.monotonic() - t
            if w.done:
                self.done = True
                return
            t_step = time.perf_counter()
            info = self._load(w)
            del w  # the weights frame, a whole model's worth, is not kept through the step
            await self._step(link, info, wait_s, t_step)

    def _load(self, w: Any) -> dict[str, Any]:
        """Decode WEIGHTS into the copy held and the model; returns its info."""
        self.replica = apply_weights(self.replica, self.held, w, self.compressor.size)
        self.held = int(w.version)
        self.trainer.load(self.replica)
        return dict(w.info)

    async def _step(self, link: Link, info: dict[str, Any], wait_s: float, t: float) -> None:
        epoch, xb, yb = next(self.stream)
        lap = [t, time.perf_counter()]  # phase boundaries: decode, compute, compress, encode
        # In a thread: the event loop keeps sending heartbeats during a long step.
        # grad: (n,) float32 on the device, reused by the next call (compressed before it)
        loss, grad = await asyncio.to_thread(self.trainer.gradient, xb, yb)
        lap.append(time.perf_counter())
        self.compressor.set_epoch(self.samples / max(1, self.shard_size))
        self.compressor.observe_loss(loss)
        packet = self.compressor.compress(grad)
        lap.append(time.perf_counter())
        encoding, codec, buffers = self.compressor.encode(packet)  # in the encoding it declares
        lap.append(time.perf_counter())
        step_time = await self._stretch(lap[-1] - t)
        push = protocol.Push(clock=self.clock + 1, step_time=step_time, loss=loss,
                             samples=len(yb), encoding=encoding, codec=codec,
                             buffers=tuple(buffers))
        sent_before, t_push = link.ch.bytes_sent, time.perf_counter()
        await link.send(push)
        wire_bytes = link.ch.bytes_sent - sent_before  # the whole frame, as counted by the channel
        await link.expect(protocol.Ack)
        push_s = time.perf_counter() - t_push
        self.clock += 1
        self.samples += len(yb)
        phases = dict(zip(("decode_s", "compute_s", "compress_s", "encode_s"),
                          np.diff(lap).tolist(), strict=True))
        self._record(info, wait_s, step_time, loss, push, wire_bytes, epoch, link, push_s=push_s,
                     host_bytes=self.compressor.host_bytes, **phases)
        await self._maybe_stats(step_time, loss)

    async def _stretch(self, compute_s: float) -> float:
        """Sleep so a step takes F x base_step_s at least; return the step's duration."""
        target = self.cfg.slowdown * self.run_cfg.base_step_s
        if compute_s < target:
            await asyncio.sleep(target - compute_s)
        return max(compute_s, target)

    async def _maybe_stats(self, step_time: float, loss: float) -> None:
        """Every STATS_EVERY_S: the median step time since the last report (one slow step under
        CPU contention must not move a worker to another group)."""
        self._recent.append(step_time)
        if time.monotonic() - self._stats_at >= STATS_EVERY_S:
            self._stats_at = time.monotonic()
            median, self._recent = float(np.median(self._recent)), []
            with contextlib.suppress(ConnectionError, MiniPSError):
                await self.ctl.send(protocol.Stats(clock=self.clock, step_time=median,
                                                   loss=loss, samples=self.samples))

    def _record(self, info: dict[str, Any], wait_s: float, step_time: float, loss: float,
                push: Any, wire_bytes: int, epoch: int, link: Link, **phases: Any) -> None:
        assert self.writer is not None
        self.writer.write({
            "t": time.time() - self.run_cfg.t0, "worker": self.id, "group": info.get("group"),
            "clock": self.clock, "staleness": info.get("lead", 0), "wait_s": wait_s,
            "waited_for": info.get("waited_for", []), "step_time": step_time, "loss": loss,
            "samples": push.samples, "epoch": epoch, "ratio": self.compressor.ratio,
            "kept_fraction": self.compressor.kept_fraction, "bytes_raw": 4 * self.compressor.size,
            "bytes_wire": wire_bytes, "link_bytes_up": link.ch.bytes_sent,
            "link_bytes_down": link.ch.bytes_received, **phases,
            **({"drift": info["drift"]} if "drift" in info else {})})


async def _connect(cfg: WorkerConfig, host: str, port: int, role: str, worker_id: int, *,
                   group: int = -1, timeout: float | None = None, retries: int = 5) -> Any:
    """One connection (``retries`` more attempts with backoff) within ``timeout`` seconds."""
    timeout = cfg.connect_timeout_s if timeout is None else timeout
    return await transport.connect(host, port, role=role, worker_id=worker_id, group=group,
                                   token=cfg.token, timeout=timeout, ssl=client_ssl(cfg.tls_ca),
                                   retries=retries)


async def _leave(ch: Any) -> None:
    with contextlib.suppress(Exception):
        await ch.close(leave="bye")


def run_worker(cfg: WorkerConfig) -> None:
    """`minips worker`: train until the server says done."""
    device.pick_device(cfg.device)  # a device that is not here fails before connecting
    transport.install_uvloop()
    asyncio.run(Worker(cfg).run())


# -- evaluator -------------------------------------------------------------------------------


async def evaluate_loop(cfg: WorkerConfig) -> None:
    """Pull the global weights every eval_every_s, evaluate, append to eval.jsonl; until done."""
    torch.set_num_threads(cfg.torch_threads)
    ch = await _connect(cfg, cfg.server_host, cfg.server_port, "evaluator", -1)
    run = RunConfig.from_info(dict(ch.welcome_info))
    test = data.load_dataset(run.dataset, "test", cfg.data_dir or run.data_dir)
    provenance.record(cfg.run_dir, "evaluator", test.meta)
    if run.eval_limit:
        test = test.subset(np.arange(min(run.eval_limit, len(test))))
    writer = RunDir(cfg.run_dir, t0=run.t0).writer("eval")
    size = models.param_count(run.model)
    last = -1
    try:
        while True:
            t = time.monotonic()
            try:
                await ch.send(protocol.Pull(clock=0))
                w = await Link(ch, 0, 0).expect(protocol.Weights)
            except (ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError,
                    _Stopped) as exc:
                if isinstance(exc, _Stopped) and exc.final:
                    raise
                ch = await _reconnect_evaluator(cfg, writer, run, exc)
                continue
            if w.version != last or w.done:
                last = w.version
                _evaluate_once(run, w, size, test, writer)
            if w.done:
                return
            await asyncio.sleep(max(0.0, run.eval_every_s - (time.monotonic() - t)))
    finally:
        writer.close()
        await _leave(ch)


async def _reconnect_evaluator(cfg: WorkerConfig, writer: JsonlWriter, run: RunConfig,
                               exc: BaseException) -> Any:
    """The global server is lost (it may come back with --resume): reconnect as a worker does,
    for up to ``reconnect_s`` (then ConnectionError)."""
    writer.write({"t": time.time() - run.t0, "event": "server_lost", "reason": str(exc)})
    log.warning("evaluator: global server lost (%s); reconnecting for up to %.0f s", exc,
                cfg.reconnect_s)
    ch = await _connect(cfg, cfg.server_host, cfg.server_port, "evaluator", -1,
                        timeout=cfg.reconnect_s, retries=RECONNECT_ATTEMPTS)
    writer.write({"t": time.time() - run.t0, "event": "server_back"})
    return ch


def _evaluate_once(run: RunConfig, w: Any, size: int, test: Any, writer: JsonlWriter) -> None:
    flat = np.asarray(sparse.decode_gradient(w.encoding, w.codec, w.buffers, size))
    acc, loss = models.evaluate(run.model, flat, test)
    writer.write({**dict(w.info), "t": time.time() - run.t0, "version": w.version,
                  "accuracy": acc, "loss": loss, "final": bool(w.done)})


def run_evaluator(cfg: WorkerConfig) -> None:
    """`minips evaluator`: evaluate the global weights until the run is done."""
    transport.install_uvloop()
    asyncio.run(evaluate_loop(cfg))
