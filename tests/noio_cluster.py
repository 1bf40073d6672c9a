"""A whole cluster on the role cores alone, for tests/test_group_core.py.

A ``GlobalCore``, 4 ``GroupCore``s and 8 workers training a softmax regression (numpy, a few
hundred synthetic samples) in one thread with a fake clock: workers of different speeds pull,
compute a gradient on the weights they got and push; SSP holds a PULL until the group's lowest
clock allows it; every ``sync_every`` pushes a group exchanges with the global core. ``run``
returns the weights and the order of the events, so that the asyncio servers can be driven
through the same order (``Workers`` is the worker side both drivers share). This module imports
numpy and the cores only: the test runs it in an interpreter that refuses asyncio, socket, ssl,
selectors, time and torch to minips.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import numpy as np

from minips.compress import registry
from minips.core.actions import Log, reply
from minips.core.config import RunConfig
from minips.core.downlink import apply_weights
from minips.core.exchange import ExchangeResult
from minips.core.global_core import GlobalCore
from minips.core.group_core import Action, GroupCore, Reply, StartExchange, Wake
from minips.core.roster import GroupHandle
from minips.wire import messages

FEATURES, CLASSES, SAMPLES, BATCH = 20, 5, 400, 16
SIZE = FEATURES * CLASSES + CLASSES  # flat weights: W (FEATURES x CLASSES), then b
STEP_S = [1.0, 1.3, 0.7, 1.1, 0.9, 1.6, 1.2, 0.8]  # each worker's compute time (fake seconds)
STEPS = 12  # pushes per worker
GROUP_OF = {w: w // 2 for w in range(len(STEP_S))}  # 4 groups of 2 workers


def run_config(compressor: str) -> dict[str, Any]:
    """RunConfig fields of the cluster (the asyncio run builds its GlobalServer from them)."""
    return {"workers": len(STEP_S), "mode": "gssp", "groups": 4, "staleness": 1, "lr": 0.5,
            "momentum": 0.9, "weight_decay": 1e-4, "lr_warmup": 0.0, "sync_every": 3,
            "batch_size": BATCH, "train_size": SAMPLES, "compressor": compressor,
            "ratio": 0.2, "seed": 0}


def init_weights() -> np.ndarray:
    return (np.random.default_rng(1).standard_normal(SIZE) * 0.01).astype(np.float32)


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """Samples labelled by a random linear teacher (learnable by the model)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((FEATURES, CLASSES)), axis=1)
    return x, y


def loss_and_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of softmax(x W + b) and its gradient, flat like ``w``."""
    weights, bias = w[:FEATURES * CLASSES].reshape(FEATURES, CLASSES), w[FEATURES * CLASSES:]
    z = x @ weights + bias
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-12)))
    p[np.arange(len(y)), y] -= 1.0
    p /= np.float32(len(y))
    return loss, np.concatenate([(x.T @ p).ravel(), p.sum(axis=0)]).astype(np.float32)


class Workers:
    """The workers' side: the weights each holds, its clock, its shard, its compressor."""

    def __init__(self, compressor: str) -> None:
        self.x, self.y = dataset()
        n = len(STEP_S)
        self.copy: list[np.ndarray | None] = [None] * n
        self.held, self.clock = [-1] * n, [0] * n
        self.comp = [registry.make_compressor(compressor, SIZE, ratio=0.2, seed=w)
                     for w in range(n)]

    def step(self, w: int, msg: messages.Weights) -> messages.Push:
        """Take the WEIGHTS ``msg``, compute a gradient on this step's batch, return the PUSH."""
        copy = self.copy[w] = apply_weights(self.copy[w], self.held[w], msg, SIZE)
        self.held[w] = msg.version
        shard = np.arange(w, SAMPLES, len(STEP_S))
        batch = np.random.default_rng(1000 * w + self.clock[w]).choice(shard, BATCH)
        loss, grad = loss_and_grad(copy, self.x[batch], self.y[batch])
        payload = self.comp[w].encode(self.comp[w].compress(grad))  # as a worker does
        return messages.Push(clock=self.clock[w] + 1, step_time=STEP_S[w], loss=loss,
                             samples=BATCH, payload=payload)

    def acked(self, w: int, ack: messages.Ack) -> None:
        self.clock[w] = ack.clock


def accuracy(w: np.ndarray) -> float:
    x, y = dataset()
    z = x @ w[:FEATURES * CLASSES].reshape(FEATURES, CLASSES) + w[FEATURES * CLASSES:]
    return float(np.mean(np.argmax(z, axis=1) == y))


class Cluster:
    """The cores and an event queue in fake seconds; ``events`` records what happened, in
    order: ("pull", w, t) when a PULL is answered, ("push", w, t), ("flush", g, t)."""

    def __init__(self, compressor: str, **fields: Any) -> None:
        self.t, self.seq = 0.0, itertools.count()
        self.run = RunConfig(**{**run_config(compressor), **fields})
        self.glob = GlobalCore(self.run, init_weights(), regroup=False,
                               wall=lambda: 1e9 + self.t)
        self.cores: dict[int, GroupCore] = {}
        handles = []
        for g in sorted(set(GROUP_OF.values())):
            members = [w for w, h in GROUP_OF.items() if h == g]
            handles.append(GroupHandle(g, "", members))
            self.cores[g] = GroupCore(g, self.run, self.glob.weights, members=members)
            self.glob.merger.share(g, self.cores[g].xchg)  # groups in one process, as opened
        for w in GROUP_OF:
            self.glob.admit(w, 0.0)
        self.glob.groups_formed(handles, dict(GROUP_OF), 0.0)  # its record line: none kept here
        self.workers = Workers(compressor)
        self.held: dict[int, list[int]] = {g: [] for g in self.cores}  # PULLs SSP holds
        self.waits = 0  # PULLs SSP held
        self.queue: list[tuple[float, int, str, int, Any]] = []
        self.events: list[tuple[str, int, float]] = []
        self.logs: list[Log] = []

    def at(self, delay: float, kind: str, w: int, msg: Any = None) -> None:
        heapq.heappush(self.queue, (self.t + delay, next(self.seq), kind, w, msg))

    def run_all(self) -> None:
        for w in GROUP_OF:
            self.at(0.0, "pull", w)
        while self.queue:
            self.t, _, kind, w, msg = heapq.heappop(self.queue)
            if kind == "pull":
                self.pull(w)
            else:
                self.push(w, msg)
        for g, core in self.cores.items():  # what the groups applied since their last exchange
            self.events.append(("flush", g, self.t))
            self.exchange(core, final=True)

    def pull(self, w: int) -> None:
        core = self.cores[GROUP_OF[w]]
        if not core.may_answer(w):
            self.held[core.group].append(w)
            self.waits += 1
            return
        self.events.append(("pull", w, self.t))
        core.publish()
        push = self.workers.step(w, core.weights_message(w, [], self.workers.held[w]))
        self.at(STEP_S[w], "push", w, push)

    def push(self, w: int, msg: messages.Push) -> None:
        core = self.cores[GROUP_OF[w]]
        self.events.append(("push", w, self.t))
        self.perform(core, core.push(w, msg, self.t))

    def perform(self, core: GroupCore, actions: list[Action]) -> None:
        """Do what the core asked; an exchange at once (none is ever in flight), the held
        PULLs after it (the asyncio run awaits a push's exchange before the next event)."""
        for a in actions:
            if isinstance(a, Reply):
                self.workers.acked(a.worker, a.msg)
                if a.msg.clock < STEPS:
                    self.at(0.0, "pull", a.worker)
            elif isinstance(a, StartExchange):
                self.exchange(core)
            elif isinstance(a, Log):
                self.logs.append(a)
        if any(isinstance(a, Wake) for a in actions):
            waiting, self.held[core.group] = self.held[core.group], []
            for v in waiting:
                self.pull(v)

    def exchange(self, core: GroupCore, final: bool = False) -> None:
        out = core.begin_exchange(final, {"bytes_in": 0, "bytes_out": 0})
        actions = self.glob.merge(core.group, out.delta, out.stats, self.t)  # no shell: its
        res = reply(actions, ExchangeResult)  # Log lines are not kept
        self.perform(core, core.exchanged(out, res, 0.0))


def run(compressor: str, **fields: Any) -> Cluster:
    """The cluster trained to the end; ``fields`` override RunConfig fields of run_config."""
    cluster = Cluster(compressor, **fields)
    cluster.run_all()
    return cluster
