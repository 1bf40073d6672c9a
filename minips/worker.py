"""The worker's face: its training loop (PyTorch; with evaluator.py the only torch code on the
network path).

A worker knows only the global server's address. It connects (role ``worker``), learns the run
config from WELCOME.info, builds the model and its data shard, times ``calib_steps`` steps and
reports them (STATS, clock 0), then waits for ASSIGN (its group server, upload ratio, staleness).
Then, on the group server's connection:

    PULL(c, since) -> WEIGHTS   answered when the SSP bound allows; wait time and whom it waited
                                for are logged. The worker keeps a copy of the group's published
                                weights and names its version (``since``): the answer is either
                                the whole weights or the coordinates that changed since
                                (core.downlink); a new connection starts from the whole weights
    gradient on the next batch  of its shard, in the reference loop's order (minips.ml.reference)
    compress                    sparse.make_compressor, error feedback kept here (on the
                                device for top-k flavours off the CPU: compress.device_compress)
    sleep                       so that the step takes max(compute, F x base_step_s)
    PUSH(c + 1) -> ACK

until the server says ``done`` (WEIGHTS.done or LEAVE "done") or ``max_steps`` pushes were made,
then it sends LEAVE to both servers. Calibration does not touch the model, the data stream or the
compressor, so N workers in BSP reproduce ``reference.train`` exactly.

Device: ``cfg.device`` (``auto``: CUDA, then MPS, then CPU) holds the model, its flat weights
and gradient (ml.device.Trainer); it goes to ``worker-<id>.device.json`` with the resident
memory (at the end and at its peak). Each step record carries the time of every phase (decode_s,
compute_s, compress_s, encode_s, push_s; wait_s is the pull) and the bytes copied from the
device to the host (host_bytes).

Emulated heterogeneity: slowdown F stretches every step with sleep (so results do not depend on
CPU load); ``bandwidth_bps`` / ``bandwidth_down_bps`` pace the group connection's sends / reads
with token buckets (``links.Pacing``, applied by ``channel.Channel.set_pacing``) and
``latency_s`` delays each send (docs/links.md; ``worker_link.Link``).

Parts: worker_control.py (the session with the global server: ASSIGN, the end, reconnecting),
worker_setup.py (model, data shard, compressor, files), worker_link.py (connections, ``Link``),
evaluator.py (``evaluate_loop``, ``run_evaluator``, re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import numpy as np

from minips import sparse
from minips.client import worker_setup
from minips.client.evaluator import evaluate_loop, run_evaluator
from minips.client.worker_control import Control
from minips.client.worker_link import Link, Stopped, connect_role, leave
from minips.core.downlink import apply_weights
from minips.errors import AuthError, MiniPSError, RemoteProtocolError
from minips.ml import device
from minips.net import net_retry, transport
from minips.net.channel import Channel
from minips.run.config import RunConfig, WorkerConfig, parse_address, reachable
from minips.run.metrics import JsonlWriter
from minips.wire import protocol

__all__ = ["Worker", "WorkerStopped", "Link", "run_worker", "run_evaluator", "evaluate_loop"]

log = logging.getLogger("minips.worker")

STATS_EVERY_S = 1.0  # how often the worker reports its step time to the global server
ASSIGN_TIMEOUT_S = 300.0  # give up when no group is assigned after this long
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.1, 2.0  # group reconnect delays (doubling, jittered)


class WorkerStopped(MiniPSError):
    """A server ended this worker's run with ERROR (``minips worker`` exits non-zero)."""


class Worker:
    """One training worker; ``await Worker(cfg).run()``."""

    parts: worker_setup.Parts  # model, data, compressor, files (``_setup``)

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.id = cfg.worker_id
        self.run_cfg = RunConfig()
        self.control = Control(cfg, self._event)  # the session with the global server
        self.clock = 0
        self.samples = 0
        self.replica: np.ndarray | None = None  # (n,) float32 the group's published weights
        self.held = -1  # their version on the current group connection; -1: none
        self.writer: JsonlWriter | None = None  # set up once WELCOME told the run config

    # -- setup -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, calibrate, train until done, leave."""
        info = await self.control.open()
        self.id = self.control.worker_id
        self.run_cfg = RunConfig.from_info(info)
        self.control.heartbeat_s = self.run_cfg.heartbeat_s
        self.control.ch.start_heartbeat(self.run_cfg.heartbeat_s)
        self._setup()
        self.control.on_ratio = self.compressor.set_ratio
        reader = asyncio.create_task(self.control.loop())
        try:
            if info.get("need_init"):
                await self._send_initial()
            await self._calibrate()
            await asyncio.wait_for(self.control.assigned.wait(), ASSIGN_TIMEOUT_S)
            await self._train()
        finally:
            reader.cancel()
            await leave(self.control.ch)
            if self.writer is not None:
                self.parts.save_device_info(**device.rss_mb(), steps=self.clock)
                self.writer.close()
        if self.control.stopped_by:
            raise WorkerStopped(self.control.stopped_by)

    def _setup(self) -> None:
        """Model, data, compressor and files, once WELCOME told the run config."""
        parts = worker_setup.build(self.cfg, self.run_cfg, self.id)
        self.parts, self.trainer, self.compressor = parts, parts.trainer, parts.compressor
        self.stream, self.writer = parts.stream, parts.writer

    async def _send_initial(self) -> None:
        flat = self.trainer.host_weights()  # (n,) float32
        encoding, codec, buffers = sparse.encode_gradient(flat)
        await self.control.ch.send(protocol.InitWeights(size=int(flat.size), encoding=encoding,
                                                        codec=codec, buffers=tuple(buffers)))

    async def _calibrate(self) -> None:
        """Time a few steps on the first batch (model, stream and compressor untouched)."""
        times, loss = [], 0.0
        for _ in range(max(1, self.run_cfg.calib_steps)):
            t = time.perf_counter()
            loss, _ = await asyncio.to_thread(self.trainer.gradient, *self.parts.first_batch)
            times.append(await self._stretch(time.perf_counter() - t))
        # The fastest step: other processes starting up only ever make a step slower.
        await self.control.ch.send(protocol.Stats(clock=0, step_time=float(np.min(times)),
                                                  loss=loss, samples=0))
        self._stats_at = time.monotonic()
        self._recent: list[float] = []  # step times since the last STATS

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
            link = Link(ch, self.cfg.bandwidth_bps, self.cfg.latency_s,
                        self.cfg.bandwidth_down_bps)
            self.held = -1  # a new connection (another group, a restarted one): whole weights
            try:
                ack = await link.expect(protocol.Ack)
                self.clock = int(ack.clock)  # the group's clock for us: pull before pushing
                await self._loop(link, self.control.address())
            except Stopped as exc:
                if exc.final:
                    self.control.end(exc.error)
                elif exc.error:  # ERROR lease: we were silent too long; rejoin on the next turn
                    self._event("lease_expired", reason=exc.error)
            except (ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError) as exc:
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

        return await net_retry.backoff(
            attempt, timeout=self.cfg.reconnect_s, what="group server lost",
            retry_on=(ConnectionError, AuthError), first=RECONNECT_FIRST_S,
            most=RECONNECT_MAX_S, wake=self.control.changed)

    async def _loop(self, link: Link, address: str) -> None:
        """Steps on one group server until done, the cap, or a new group address."""
        cap = self.run_cfg.max_steps
        while not self.control.done and address == self.control.address():
            if cap and self.clock >= cap:
                self.control.done = True
                return
            t = time.monotonic()
            await link.send(protocol.Pull(clock=self.clock, since=self.held))
            w = await link.expect(protocol.Weights)
            wait_s = time.monotonic() - t
            if w.done:
                self.control.done = True
                return
            t_step = time.perf_counter()
            info = self._load(w)
            del w  # the weights frame, a whole model's worth, is not kept through the step
            await self._step(link, info, wait_s, t_step)

    def _load(self, w: protocol.Weights) -> dict[str, Any]:
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
        self.compressor.set_epoch(self.samples / max(1, self.parts.shard_size))
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
                await self.control.ch.send(protocol.Stats(clock=self.clock, step_time=median,
                                                          loss=loss, samples=self.samples))

    def _record(self, info: dict[str, Any], wait_s: float, step_time: float, loss: float,
                push: protocol.Push, wire_bytes: int, epoch: int, link: Link,
                **phases: Any) -> None:
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


def run_worker(cfg: WorkerConfig) -> None:
    """`minips worker`: train until the server says done."""
    device.pick_device(cfg.device)  # a device that is not here fails before connecting
    transport.install_uvloop()
    asyncio.run(Worker(cfg).run())


