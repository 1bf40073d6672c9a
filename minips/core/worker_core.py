"""The worker's rules, sans-IO: what a worker does with WEIGHTS, what it pushes, what it records.

No torch, sockets, event loop or clock here: time comes in as ``now`` and gradients come in
computed. worker.py (PyTorch, asyncio, the emulated slowness, reconnects) and the simulator
(its clock and links) drive this one core, so the two cannot drift apart. One push, in the
order the shell calls it::

    pull(now)                  -> Pull(clock, since)   or Done once max_steps pushes were made
    on_weights(msg, now)       -> Step                 the copy held brought to WEIGHTS' version;
                                                       or Done (WEIGHTS.done)
    on_gradient(grad, loss, b) -> weights or None      H times (WEIGHTS.local_steps; 1 with the
                                                       optimizer on the servers): the weights of
                                                       the next local step, None after the last
    compress()                 -> packet               error feedback, the worker's optimizer
    encode(packet)             -> Payload              in the compressor's declared encoding
    push(payload, step_time)   -> Push(clock + 1)
    on_ack(ack, bytes_wire)    -> the step's record    (``step_record``: one schema for both)

``on_join(ack)`` starts a new connection (its clock, and the whole weights at the next pull);
``on_assign(msg)`` takes an ASSIGN's upload ratio (GDTopK). The core keeps these invariants:
``version`` is the version of ``replica`` on this connection (-1: none, the next WEIGHTS is
whole); ``clock`` is the number of pushes the group acknowledged; the compressor sees the
epoch of the samples pushed before this push (with local steps: and this push's), the loss of
this push (the mean of its H), and the ratio of the last ASSIGN, never WEIGHTS.ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from minips.compress.base import Compressor
from minips.core.config import RunConfig
from minips.core.downlink import apply_weights
from minips.core.local_steps import LocalSteps
from minips.core.worker_opt import Upload
from minips.sparse import SparseVector
from minips.wire import control, messages
from minips.wire.fields import Payload

__all__ = ["Step", "Done", "WorkerCore", "step_record", "RECORD_KEYS"]


@dataclass(frozen=True)
class Step:
    """What the shell computes after WEIGHTS: ``local_steps`` gradients, the first at
    ``weights``, each on ``batch`` samples."""

    weights: np.ndarray  # (n,) float32: where the first gradient is computed
    local_steps: int  # H gradients before the push (1: one gradient, pushed as it is)
    batch: int  # samples of each gradient (LB-BSP: WEIGHTS.batch); 0: the run's batch_size
    wait_s: float  # from the PULL to its WEIGHTS, in the shell's clock


@dataclass(frozen=True)
class Done:
    """The worker's run is over: the server said so, or it made ``max_steps`` pushes."""

    reason: str  # "done" (WEIGHTS.done) or "max_steps"


# The keys every step record has, worker and simulator alike; the shells add what they measure
# (``t``, ``slowdown``; the worker its phases, epoch and link counters)
RECORD_KEYS = ("worker", "group", "clock", "staleness", "wait_s", "waited_for", "step_time",
               "loss", "samples", "ratio", "kept_fraction", "bytes_raw", "bytes_wire")


def step_record(worker: int, info: dict[str, Any], push: messages.Push, clock: int,
                wait_s: float, bytes_wire: int, compressor: Compressor,
                optimizer: dict[str, float], local_steps: int | None) -> dict[str, Any]:
    """One step's record: ``RECORD_KEYS``, then ``drift`` (a compressed downlink's, from
    WEIGHTS' ``info``), ``local_steps`` (with the optimizer on the worker) and the optimizer's
    ``lr_factor`` and ``clip_scale`` (``Upload.record``)."""
    return {
        "worker": worker, "group": info.get("group"), "clock": clock,
        "staleness": info.get("lead", 0), "wait_s": wait_s,
        "waited_for": info.get("waited_for", []), "step_time": push.step_time,
        "loss": push.loss, "samples": push.samples, "ratio": compressor.ratio,
        "kept_fraction": compressor.kept_fraction, "bytes_raw": 4 * compressor.size,
        "bytes_wire": bytes_wire,
        **({"drift": info["drift"]} if "drift" in info else {}),
        **({"local_steps": local_steps} if local_steps is not None else {}),
        **optimizer}


class WorkerCore:
    """One worker's rules (the module docstring); the shell holds it and calls its entry
    points in order."""

    def __init__(self, run: RunConfig, compressor: Compressor, worker: int,
                 shard_size: int) -> None:
        self.run, self.compressor, self.worker = run, compressor, worker
        self.shard_size = max(1, shard_size)  # samples of the worker's shard: an epoch's
        self.upload = Upload(run, compressor)  # with the optimizer, if it is here
        # the inner loop of local steps, with the optimizer here
        self.local = LocalSteps(self.upload) if self.upload.opt is not None else None
        self.clock = 0  # the group's SSP clock for us: pushes of this worker's slot acknowledged
        self.pushes = 0  # this worker's own pushes acknowledged, in this process
        self.own_steps = 0  # its own optimizer steps in them (H per push with local steps)
        self.samples = 0  # samples of its pushes acknowledged
        self.replica: np.ndarray | None = None  # (n,) float32 the group's published weights
        self.version = -1  # their version on this connection; -1: none
        self.pulled_at = 0.0  # ``now`` of the last PULL
        self._start(1, {}, 1.0, 0.0)

    def _start(self, steps: int, info: dict[str, Any], lr_factor: float,
               progress: float) -> None:
        """A new push's state: its H, WEIGHTS' info, lr factor and progress."""
        self.steps, self.info = steps, info
        self.lr_factor, self.progress = lr_factor, progress
        self.losses: list[float] = []
        self.step_samples = 0  # samples of this push's gradients
        self.grad: Any = None  # H = 1: the gradient until ``compress``
        self.wait_s = 0.0
        self.pushed: messages.Push | None = None  # sent, not yet acknowledged

    def on_join(self, ack: messages.Ack) -> None:
        """A new connection's first ACK: the group's clock for us; the next WEIGHTS is whole
        (another group, or a restarted one, knows nothing of the version held)."""
        self.clock, self.version = int(ack.clock), -1

    def on_assign(self, msg: control.Assign) -> None:
        """ASSIGN: the group's upload ratio (GDTopK) for the next compress."""
        self.compressor.set_ratio(msg.ratio)

    def pull(self, now: float) -> messages.Pull | Done:
        """The next PULL, or Done once ``max_steps`` pushes were made."""
        cap = self.run.max_steps
        if cap and self.clock >= cap:
            return Done("max_steps")
        self.pulled_at = now
        return messages.Pull(clock=self.clock, since=self.version)

    def on_weights(self, msg: messages.Weights, now: float) -> Step | Done:
        """WEIGHTS: the copy held brought to its version, and the step to compute. The
        message is not kept (a whole model's worth)."""
        if msg.done:
            return Done("done")
        self.replica = apply_weights(self.replica, self.version, msg, self.compressor.size)
        self.version = int(msg.version)
        steps = int(msg.local_steps) if self.local is not None else 1
        self._start(steps, dict(msg.info), msg.lr_factor, msg.progress)
        self.wait_s = now - self.pulled_at
        first = self.replica
        if steps > 1:
            assert self.local is not None
            first = self.local.start(self.replica, steps, self.lr_factor)
        return Step(first, steps, int(msg.batch), self.wait_s)

    def on_gradient(self, grad: Any, loss: float, samples: int) -> np.ndarray | None:
        """One gradient (n,) (numpy, or a torch tensor: read before the next is computed) of
        ``samples`` samples, its loss; returns the weights of the next local step, or None
        once this push's H gradients are in."""
        self.losses.append(float(loss))
        self.step_samples += int(samples)
        if self.steps == 1:
            self.grad = grad
            return None
        assert self.local is not None
        moved = self.local.step(grad)
        return None if self.local.finished else moved

    def compress(self) -> SparseVector | np.ndarray:
        """The packet of this push: the gradient (or, with the optimizer here, the update;
        with local steps, the H updates' sum) through the compressor, with error feedback."""
        loss = float(np.mean(self.losses))
        if self.steps > 1:
            assert self.local is not None
            self.compressor.set_epoch((self.samples + self.step_samples) / self.shard_size)
            self.compressor.observe_loss(loss)
            return self.local.packet(self.progress)
        self.compressor.set_epoch(self.samples / self.shard_size)
        self.compressor.observe_loss(loss)
        grad, self.grad = self.grad, None
        return self.upload.packet(grad, self.replica, lr_factor=self.lr_factor,
                                  progress=self.progress)

    def encode(self, packet: SparseVector | np.ndarray) -> Payload:
        """``packet`` in the encoding its compressor declares."""
        return self.compressor.encode(packet)

    def push(self, payload: Payload, step_time: float) -> messages.Push:
        """PUSH(clock + 1): ``step_time`` is the mean time of one of its H steps (seconds,
        what STATS reports too); its loss the mean of theirs, its samples their sum."""
        self.pushed = messages.Push(clock=self.clock + 1, step_time=step_time,
                                    loss=float(np.mean(self.losses)),
                                    samples=self.step_samples, payload=payload)
        return self.pushed

    def on_ack(self, ack: messages.Ack, bytes_wire: int) -> dict[str, Any]:
        """The ACK of the last push (``bytes_wire`` its frame's size): the clock moves on;
        returns the step's record (``step_record``)."""
        push, self.pushed = self.pushed, None
        assert push is not None, "an ACK answers a PUSH"
        self.clock = int(ack.clock)
        self.samples += push.samples
        self.pushes += 1
        self.own_steps += self.steps
        return step_record(self.worker, self.info, push, self.clock, self.wait_s, bytes_wire,
                           self.compressor, self.upload.record(),
                           self.steps if self.local is not None else None)
