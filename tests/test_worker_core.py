"""The worker core (core/worker_core.py): what a worker does with WEIGHTS, what it pushes and
what it records. One scripted conversation runs through the real worker's loop (worker.py, on a
fake link and a numpy "trainer") and through the simulator's worker (simulate.py), and the two
step records agree key by key; then the core's rules one by one, by hand."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from minips import sparse
from minips.core.config import RunConfig, WorkerConfig
from minips.core.slowdown import Schedule, Slowdown
from minips.core.worker_core import RECORD_KEYS, Done, Step, WorkerCore
from minips.sim.simulate import SimConfig, Simulation, shard_size
from minips.wire import control, messages
from minips.wire.fields import Payload
from minips.wire.frames import wire_size
from minips.worker import Worker

N = 40  # coordinates of the scripted model
TARGET = np.linspace(-1.0, 1.0, N, dtype=np.float32)  # (N,) where the loss is 0
# what both shells time with their own clock: equal in kind, not in value
CLOCKED = {"t", "wait_s", "step_time", "slowdown"}


def gradient(weights: np.ndarray) -> tuple[np.ndarray, float]:
    """The fixed numpy "model": 0.5·mean((w − target)²) and its gradient, (N,) float32."""
    diff = (np.asarray(weights, np.float32) - TARGET).astype(np.float32)
    return diff, float(0.5 * np.mean(diff.astype(np.float64) ** 2))


def whole(version: int, w: np.ndarray, **info: Any) -> messages.Weights:
    encoding, codec, buffers = sparse.encode_vector(w)
    return messages.Weights(version=version, payload=Payload(encoding, codec,
                            tuple(buffers)), **info)


def changed(version: int, since: int, idx: list[int], values: list[float],
            **info: Any) -> messages.Weights:
    vec = sparse.SparseVector(np.array(idx, np.uint32), np.array(values, np.float32), N)
    encoding, codec, buffers = sparse.encode_vector(vec)
    return messages.Weights(version=version, since=since, payload=Payload(encoding, codec,
                            tuple(buffers)), **info)


def dense(push: Any) -> np.ndarray:
    """A PUSH's vector, (N,) float32."""
    got = sparse.decode_vector(push.payload, N)
    return got.to_dense() if isinstance(got, sparse.SparseVector) else np.asarray(got)


def script(h: int) -> list[messages.Message]:
    """What the group server (and once the global server) says to worker 0, in order; every
    WEIGHTS asks for ``h`` local steps."""
    assign = control.Assign(group=0, address="sim:0", ratio=0.1, staleness=2)
    common = {"group": 0, "local_steps": h}
    return [
        whole(1, np.zeros(N, np.float32), lead=0, waited_for=[], **common),
        messages.Ack(clock=1, version=2),
        changed(3, 1, [2, 7], [0.5, -0.25], lead=1, waited_for=[3], lr_factor=0.5,
                progress=0.1, **common),
        messages.Ack(clock=2, version=4),
        assign,  # GDTopK's new ratio, on the control channel between two steps
        changed(5, 3, [0], [1.0], lead=0, drift=0.125, progress=0.2, **common),
        messages.Ack(clock=3, version=6),
        messages.Weights(version=6, payload=Payload("dense", {}, ()), done=True),
    ]


def run_config(optimizer_at: str) -> RunConfig:
    return RunConfig(workers=1, groups=1, mode="bsp", compressor="gdtopk", ratio=0.05,
                     dataset="synthetic", epochs=1, batch_size=8, lr=0.1, lr_warmup=0,
                     optimizer_at=optimizer_at, base_step_s=0.0)


# -- the real worker's loop on a fake link ---------------------------------------------------

class FakeChannel:
    def __init__(self) -> None:
        self.bytes_sent = self.bytes_received = 0


class FakeLink:
    """``worker.EmulatedLink``'s face: sends are kept, ``expect`` plays the script (an ASSIGN
    goes to the control session's hook, as ``Control`` would deliver it meanwhile)."""

    def __init__(self, worker: Worker, said: list[messages.Message]) -> None:
        self.worker, self.said = worker, list(said)
        self.sent: list[messages.Message] = []
        self.ch = FakeChannel()

    async def send(self, msg: messages.Message) -> None:
        self.sent.append(msg)
        self.ch.bytes_sent += wire_size(msg)

    async def expect(self, kind: type[Any]) -> Any:
        while isinstance(self.said[0], control.Assign):
            self.worker.control.on_assign(self.said.pop(0))  # type: ignore[arg-type]
        msg = self.said.pop(0)
        assert isinstance(msg, kind), (msg, kind)
        self.ch.bytes_received += wire_size(msg)
        return msg


class FakeTrainer:
    """``device.Trainer``'s two calls the loop makes, on ``gradient`` above."""

    def __init__(self) -> None:
        self.weights: np.ndarray = np.zeros(N, np.float32)

    def load(self, w: np.ndarray) -> None:
        self.weights = np.array(w, np.float32)

    def gradient(self, xb: np.ndarray, yb: np.ndarray) -> tuple[float, np.ndarray]:
        grad, loss = gradient(self.weights)
        return loss, grad


class Records:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def write(self, line: dict[str, Any]) -> None:
        self.lines.append(line)


def batches(size: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    while True:
        yield 0, np.zeros((size, 1), np.float32), np.zeros(size, np.int64)


async def through_the_worker(run: RunConfig, said: list[messages.Message]
                             ) -> tuple[list[dict[str, Any]], list[messages.Message]]:
    """worker.py's ``Worker._loop`` over the script: its records and what it sent."""
    w = Worker(WorkerConfig(worker_id=0))
    w.run_cfg = run
    w.parts = SimpleNamespace(cursor=None, shard_size=shard_size(run, 0))  # type: ignore[assignment]
    w.trainer, w.stream = FakeTrainer(), batches(run.batch_size)  # type: ignore[assignment]
    w.compressor = run.worker_compressor(N, 0)
    w.core = WorkerCore(run, w.compressor, 0, shard_size(run, 0))
    w.control.on_assign = w.core.on_assign
    w.control.assign = control.Assign(group=0, address="sim:0", ratio=0.05, staleness=2)
    w.slowdown, w.factor = Slowdown(Schedule.flat(1.0)), 1.0
    records = Records()
    w.writer = records  # type: ignore[assignment]
    w._recent, w._stats_at, w._status_at = [], math.inf, math.inf  # no STATS in this test
    w.core.on_assign(w.control.assign)  # the first ASSIGN, before training
    link = FakeLink(w, said)
    await w._loop(link, "sim:0")  # type: ignore[arg-type]
    assert w.control.done and not link.said
    return records.lines, link.sent


# -- the simulator's worker on the same script -----------------------------------------------

class Scripted:
    """The simulator's objective, as ``gradient`` above."""

    size = N

    def gradient(self, worker: int, w: np.ndarray, rng: Any) -> tuple[np.ndarray, float]:
        return gradient(w)


def through_the_simulator(run: RunConfig, said: list[messages.Message], tmp: Path
                          ) -> tuple[list[dict[str, Any]], list[messages.Message]]:
    """simulate.py's worker events over the script: its records and what it sent."""
    sim = Simulation(SimConfig(run=run, dim=N, step_times=[0.01]), tmp / "sim")
    sim.objective = Scripted()  # type: ignore[assignment]
    group = sim.group_of[0]
    sim.assign(control.Assign(group=group, address="sim:0", ratio=0.05, staleness=2))
    sent: list[tuple[Any, tuple[Any, ...]]] = []
    sim.send = lambda w, nbytes, fn, *args, after=0.0: sent.append((fn, args))  # type: ignore
    sim._pull(0)
    for msg in said:
        if isinstance(msg, messages.Weights):
            sim.weights_arrive(0, msg)
        elif isinstance(msg, messages.Ack):
            push, slowdown = sent[-1][1]
            sim.ack_arrives(0, msg, wire_size(push), slowdown)
        elif isinstance(msg, control.Assign):
            sim.assign(dataclasses.replace(msg, group=group))
    return sim.records[0], [args[0] for _, args in sent]


@pytest.mark.parametrize("optimizer_at, h", [("server", 1), ("worker", 1), ("worker", 3)])
async def test_the_worker_and_the_simulator_record_the_same_steps(
        tmp_path: Path, optimizer_at: str, h: int) -> None:
    run = run_config(optimizer_at)
    real, real_sent = await through_the_worker(run, script(h))
    simulated, sim_sent = through_the_simulator(run, script(h), tmp_path)
    assert len(real) == len(simulated) == 3
    assert [type(m).__name__ for m in real_sent] == [type(m).__name__ for m in sim_sent]
    for a, b in zip(real_sent, sim_sent, strict=True):  # PULL and PUSH, field by field
        assert a.clock == b.clock  # type: ignore[attr-defined]
        if isinstance(a, messages.Pull):
            assert a.since == b.since  # type: ignore[attr-defined]
        else:
            assert (a.loss, a.samples, a.payload.encoding, a.payload.codec) == (  # type: ignore[attr-defined]
                b.loss, b.samples, b.payload.encoding, b.payload.codec)  # type: ignore[attr-defined]
            np.testing.assert_array_equal(dense(a), dense(b))  # what was sent, bit for bit
    for mine, theirs in zip(real, simulated, strict=True):
        core_keys = set(theirs) - CLOCKED
        assert set(RECORD_KEYS) - CLOCKED <= core_keys <= set(mine)
        for key in sorted(core_keys):
            assert mine[key] == pytest.approx(theirs[key]), key
        for key in ("wait_s", "step_time"):
            assert mine[key] >= 0 and theirs[key] >= 0
    assert [r["clock"] for r in real] == [1, 2, 3]
    assert [r["ratio"] for r in real] == [0.05, 0.05, 0.1]  # the ASSIGN's, not WEIGHTS'
    assert "drift" in real[2] and "drift" not in real[0]
    assert ("local_steps" in real[0]) == (optimizer_at == "worker")
    assert real[0]["samples"] == h * run.batch_size


# -- the core's rules, by hand ---------------------------------------------------------------

def core(optimizer_at: str = "server", **run: Any) -> WorkerCore:
    cfg = RunConfig(**{**vars(run_config(optimizer_at)), **run})
    return WorkerCore(cfg, cfg.worker_compressor(N, 0), 0, 100)


def test_a_pull_names_the_version_held_and_weights_bring_the_copy_to_theirs() -> None:
    c = core()
    pull = c.pull(1.0)
    assert isinstance(pull, messages.Pull) and (pull.clock, pull.since) == (0, -1)
    w0 = np.arange(N, dtype=np.float32)
    step = c.on_weights(whole(4, w0), 1.25)
    assert isinstance(step, Step) and step.wait_s == 0.25 and step.local_steps == 1
    np.testing.assert_array_equal(step.weights, w0)
    assert c.pull(2.0) == messages.Pull(clock=0, since=4)
    step = c.on_weights(changed(6, 4, [1], [-3.0]), 2.0)
    assert isinstance(step, Step) and step.weights[1] == -3.0 and c.version == 6


def test_a_new_connection_starts_from_the_whole_weights_and_the_groups_clock() -> None:
    c = core()
    c.pull(0.0)
    c.on_weights(whole(4, np.ones(N, np.float32)), 0.0)
    c.on_join(messages.Ack(clock=7))
    assert c.pull(0.0) == messages.Pull(clock=7, since=-1)


def test_done_ends_the_run_and_max_steps_stops_pulling() -> None:
    done = messages.Weights(version=0, payload=Payload("dense", {}, ()), done=True)
    assert core().on_weights(done, 0.0) == Done("done")
    c = core(max_steps=2)
    c.on_join(messages.Ack(clock=2))
    assert c.pull(0.0) == Done("max_steps")


def test_one_push_carries_the_steps_mean_loss_and_their_samples() -> None:
    c = core("worker")
    c.pull(0.0)
    step = c.on_weights(whole(1, np.zeros(N, np.float32), local_steps=3), 0.5)
    assert isinstance(step, Step) and step.local_steps == 3
    weights: np.ndarray | None = step.weights
    losses = []
    while weights is not None:
        grad, loss = gradient(weights)
        losses.append(loss)
        weights = c.on_gradient(grad, loss, 8)
    assert len(losses) == 3 and losses[2] < losses[0]  # each step moved the local weights
    push = c.push(c.encode(c.compress()), 0.01)
    assert (push.clock, push.samples) == (1, 24)
    assert push.loss == pytest.approx(np.mean(losses))
    record = c.on_ack(messages.Ack(clock=1, version=2), 123)
    assert (c.clock, c.samples) == (1, 24)
    assert record["bytes_wire"] == 123 and record["local_steps"] == 3
    assert record["wait_s"] == 0.5 and record["bytes_raw"] == 4 * N


def test_the_ratio_comes_from_assign_not_from_weights() -> None:
    c = core()
    c.on_assign(control.Assign(group=0, address="a", ratio=0.2, staleness=0))
    c.on_weights(whole(1, np.zeros(N, np.float32), ratio=0.9), 0.0)
    assert c.compressor.ratio == 0.2
