"""`minips simulate`: a whole cluster as a discrete-event simulation on the real role cores.

The global server and the group servers are ``GlobalCore`` and ``GroupCore``, the very rules the
asyncio servers run (grouping, SSP/BSP inside a group, SGD and its learning rate, the compressed
downlink, the exchanges and their merge, GDTopK's ratios, the budget); only time is simulated.
An event queue orders what the real processes would do:

    worker: PULL ─link─► group (held while SSP says wait) ─link─► WEIGHTS ─► compute ─► PUSH
            ─link─► group applies it, ACK ─link─► worker, next PULL

- **compute time** of a step: ``slowdown × base_step_s``, times ``1 + jitter·N(0, 1)`` (never
  under a tenth of it);
- **links**: each worker's messages take ``latency_s + bytes / rate`` each way (``rate`` in
  bytes/s, 0 = no limit), one after another; the exchange of a group with the global server is
  merged ``xchg_latency_s`` after it is due;
- **gradients**: a synthetic objective, cheap for thousands of workers: a quadratic
  ``0.5·mean(a·(w − w*)²)`` with curvatures ``a`` in [0.1, 1] and noise of ``noise / √batch``
  per coordinate; workers compress with the run's compressor (``sparse.make_compressor``), and
  the messages are the real protocol messages, so the bytes counted are the wire's.

It writes a run directory as `minips local` does (config.json, worker-, group-, global- and
eval-records with ``t`` in simulated seconds, final_weights.npy, summary.json); ``minips plot``
draws its worker and ratio charts (the evaluations have a loss, no accuracy). What it leaves
out: the handshake, heartbeats and leases (no worker fails), regrouping, the batching of
publishes per event-loop turn (each PULL publishes), and real models (the objective is
synthetic).

Public API: ``SimConfig``, ``simulate(cfg) -> summary``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips import metrics, protocol, sparse
from minips.config import RunConfig
from minips.downlink import apply_weights
from minips.exchange import wire_size
from minips.global_core import GlobalCore
from minips.group_actions import Action, BudgetSpent, Log, Reply, StartExchange, Wake
from minips.group_core import GroupCore
from minips.roster import GroupHandle

__all__ = ["SimConfig", "simulate"]

SMALL = 40  # bytes of a PULL or an ACK on the wire (a few fields)


@dataclass
class SimConfig:
    """One simulated run: the run's settings and the models of time and gradients."""

    run: RunConfig
    slowdowns: list[float] = field(default_factory=lambda: [1.0])  # per worker, last repeats
    jitter: float = 0.0  # relative spread of a step's compute time
    rate: float = 0.0  # link bytes per second each way per worker (0: no limit)
    latency_s: float = 0.0  # one way, per message
    xchg_latency_s: float = 0.0  # a group's exchange is merged this long after it is due
    dim: int = 1000  # coordinates of the synthetic objective
    noise: float = 1.0  # gradient noise of one sample, per coordinate
    max_pushes: int = 0  # stop after this many pushes (0: the run's epochs budget)
    eval_every_s: float = 1.0  # simulated seconds between evaluations (the CLI: --eval-every)
    out_dir: str = "runs"
    name: str = ""


class Quadratic:
    """``0.5·mean(a·(w − w*)²)``; a batch's gradient is exact plus noise / √batch."""

    def __init__(self, dim: int, noise: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.target = rng.standard_normal(dim).astype(np.float32)
        self.curv = rng.uniform(0.1, 1.0, dim).astype(np.float32)
        self.noise = noise

    def loss(self, w: np.ndarray) -> float:
        return float(0.5 * np.mean(self.curv * (w - self.target) ** 2))

    def gradient(self, w: np.ndarray, batch: int, rng: np.random.Generator) -> np.ndarray:
        g = self.curv * (w - self.target)
        return (g + rng.standard_normal(w.size).astype(np.float32)
                * np.float32(self.noise / math.sqrt(batch))).astype(np.float32)


class NoLink:
    """The group cores' link: unused, the simulation merges exchanges itself (``exchange``)."""

    async def exchange(self, group: int, delta: Any, stats: dict[str, Any]) -> Any:
        raise RuntimeError("a simulated group exchanges through Simulation.exchange")


class SimGroup(GroupCore):
    """A group core whose actions (``group_actions.py``) the simulation performs."""

    def __init__(self, sim: Simulation, g: int, members: list[int]) -> None:
        self.sim, self.in_flight = sim, False
        self.pending: list[tuple[int, list[int]]] = []  # PULLs held: (worker, waited for)
        self.bytes = {"bytes_in": 0, "bytes_out": 0}
        self.writer = sim.rundir.writer(f"group-{g}")
        super().__init__(g, sim.run, sim.glob.weights, NoLink(), members=members, now=sim.t)

    def perform(self, actions: list[Action]) -> Any:
        """Do what the core asked; return its reply. A ``Wake`` releases the held PULLs last
        (after an exchange is scheduled); the simulation has no leaves, so no ``AllLeft``."""
        reply = None
        for a in actions:
            if isinstance(a, Reply):
                reply = a.msg
            elif isinstance(a, StartExchange) and not self.in_flight:
                self.in_flight = True
                self.sim.at(self.sim.cfg.xchg_latency_s, self.sim.exchange, self.group)
            elif isinstance(a, BudgetSpent):
                self.done = True
            elif isinstance(a, Log):
                self.log(a.event, **a.fields)
        if any(isinstance(a, Wake | BudgetSpent) for a in actions):
            self.sim.release(self)
        return reply

    def traffic(self) -> dict[str, int]:
        return dict(self.bytes)

    def log(self, event: str, **fields: Any) -> None:
        self.writer.write({"t": self.sim.t, "event": event, "group": self.group, **fields,
                           "version": self.version, **self.counters, **self.traffic()})


class SimGlobal(GlobalCore):
    def __init__(self, sim: Simulation, weights: np.ndarray) -> None:
        self.sim = sim
        self.writer = sim.rundir.writer("global")
        super().__init__(sim.run, weights, regroup=False, clock=lambda: sim.t,
                         wall=lambda: sim.run.t0 + sim.t)

    def on_ratios(self, new: dict[int, float]) -> None:
        for g in new:  # as the global server hands them to its in-process groups
            self.sim.groups[g].ratio = self.groups[g].ratio

    def on_done(self) -> None:
        for core in self.sim.groups.values():
            core.done = True
            self.sim.release(core)

    def log(self, event: str, **fields: Any) -> None:
        self.writer.write({"t": self.sim.t, "event": event, **fields, "version": self.version,
                           "samples": self.samples})


class Simulation:
    """The event queue, the workers' state and the cores (``simulate`` runs it)."""

    def __init__(self, cfg: SimConfig, run_dir: Path) -> None:
        self.cfg, self.run = cfg, cfg.run
        self.run.t0 = self.run.t0 or time.time()
        self.t, self.seq = 0.0, itertools.count()
        self.queue: list[tuple[float, int, Any, tuple[Any, ...]]] = []  # (time, seq, fn, args)
        self.rundir = metrics.RunDir(run_dir, t0=self.run.t0)
        self.rundir.write_config(self.run.to_info())
        self.objective = Quadratic(cfg.dim, cfg.noise, self.run.seed)
        n_w = self.run.workers
        self.step_s = [self.run.base_step_s * cfg.slowdowns[min(w, len(cfg.slowdowns) - 1)]
                       for w in range(n_w)]
        self.glob = SimGlobal(self, np.zeros(cfg.dim, np.float32))
        for w in range(n_w):
            self.glob.roster.admit(w)
            self.glob.workers[w].step_time = self.step_s[w]
        assignment = self.glob.roster.first_assignment() or dict.fromkeys(range(n_w), 0)
        self.glob.roster.first_ratios(assignment, 0.0)
        self.groups: dict[int, SimGroup] = {}
        for g in sorted(set(assignment.values())):
            members = sorted(w for w, h in assignment.items() if h == g)
            self.glob.groups[g] = GroupHandle(g, f"sim:{g}", members=members,
                                              ratio=self.glob.roster.ratio_of(g))
            self.groups[g] = SimGroup(self, g, members)
            self.groups[g].ratio = self.glob.groups[g].ratio
        self.glob.started_training = self.glob.wall()
        self.glob.log("groups", assignment={str(w): g for w, g in assignment.items()},
                      ratios={str(g): h.ratio for g, h in self.glob.groups.items()})
        self.group_of = assignment
        self.rngs = [np.random.default_rng(self.run.seed * 1000 + w) for w in range(n_w)]
        self.comp = [sparse.make_compressor(self.run.compressor, cfg.dim, ratio=self.run.ratio,
                                            seed=self.run.seed * 1000 + w,
                                            **self.run.compressor_opts) for w in range(n_w)]
        self.copy: list[np.ndarray | None] = [None] * n_w
        self.held = [-1] * n_w
        self.clock = [0] * n_w
        self.pulled_at = [0.0] * n_w
        self.busy = [0.0] * n_w  # each worker's link is busy until then
        self.records: list[list[dict[str, Any]]] = [[] for _ in range(n_w)]  # written at the end
        self.eval_w = self.rundir.writer("eval")
        self.pushes = 0

    # -- the queue ------------------------------------------------------------------------

    def at(self, delay: float, fn: Any, *args: Any) -> None:
        heapq.heappush(self.queue, (self.t + delay, next(self.seq), fn, args))

    def send(self, w: int, nbytes: int, fn: Any, *args: Any, after: float = 0.0) -> None:
        """A message of worker ``w``'s link, sent ``after`` seconds from now: once the link is
        free, latency + bytes / rate."""
        start = max(self.t + after, self.busy[w])
        self.busy[w] = start + (nbytes / self.cfg.rate if self.cfg.rate else 0.0)
        heapq.heappush(self.queue, (self.busy[w] + self.cfg.latency_s, next(self.seq), fn, args))

    def run_all(self) -> None:
        for w in range(self.run.workers):
            self.pulled_at[w] = 0.0
            self.send(w, SMALL, self.pull_arrives, w)
        self.at(0.0, self.evaluate)
        while self.queue:
            self.t, _, fn, args = heapq.heappop(self.queue)
            fn(*args)
        for core in self.groups.values():  # what the groups hold that the global lacks
            if core.xchg.since["pushes"]:
                self.exchange(core.group, final=True)
        self.glob.finish(self.glob.done_reason or "pushes")
        self.evaluate(again=False)

    # -- a worker's step -------------------------------------------------------------------

    def pull_arrives(self, w: int) -> None:
        core = self.groups[self.group_of[w]]
        core.bytes["bytes_in"] += SMALL
        if core.may_answer(w):
            self.answer(core, w, [])
        else:
            core.pending.append((w, [int(v) for v in core.table.waiting_for(w)]))  # type: ignore[call-overload]

    def answer(self, core: SimGroup, w: int, waited: list[int]) -> None:
        core.publish()
        msg = core.weights_message(w, waited, self.held[w])
        nbytes = wire_size(msg)
        core.bytes["bytes_out"] += nbytes
        self.send(w, nbytes, self.weights_arrive, w, msg)

    def release(self, core: SimGroup) -> None:
        """Answer the held PULLs that SSP now allows (or all of them, when done)."""
        waiting, core.pending = core.pending, []
        for w, waited in waiting:
            if core.may_answer(w):
                self.answer(core, w, waited)
            else:
                core.pending.append((w, waited))

    def weights_arrive(self, w: int, msg: protocol.Weights) -> None:
        if msg.done:
            return
        copy = self.copy[w] = apply_weights(self.copy[w], self.held[w], msg, self.cfg.dim)
        self.held[w] = msg.version
        wait_s = self.t - self.pulled_at[w]
        base = self.step_s[w]
        step = max(0.1 * base, base * (1 + self.cfg.jitter * self.rngs[w].standard_normal()))
        grad = self.objective.gradient(copy, self.run.batch_size, self.rngs[w])
        packet = self.comp[w].compress(grad)
        enc, codec, bufs = self.comp[w].encode(packet)  # the encoding the compressor declares
        push = protocol.Push(clock=self.clock[w] + 1, step_time=step, loss=0.0,
                             samples=self.run.batch_size, encoding=enc, codec=codec,
                             buffers=tuple(bufs))
        nbytes = wire_size(push)
        record = {"worker": w, "group": msg.info.get("group"), "staleness":
                  msg.info.get("lead", 0), "wait_s": wait_s, "waited_for":
                  msg.info.get("waited_for", []), "step_time": step, "samples": push.samples,
                  "ratio": self.comp[w].ratio, "kept_fraction": self.comp[w].kept_fraction,
                  "bytes_raw": 4 * self.cfg.dim, "bytes_wire": nbytes}
        self.send(w, nbytes, self.push_arrives, w, push, record, after=step)  # once computed

    def push_arrives(self, w: int, push: protocol.Push, record: dict[str, Any]) -> None:
        core = self.groups[self.group_of[w]]
        core.bytes["bytes_in"] += wire_size(push)
        ack = core.perform(core.push(w, push, self.t))
        core.bytes["bytes_out"] += SMALL
        self.pushes += 1
        if self.cfg.max_pushes and self.pushes >= self.cfg.max_pushes and not self.glob.done:
            self.glob.finish("pushes")
        self.send(w, SMALL, self.ack_arrives, w, ack, record)

    def ack_arrives(self, w: int, ack: protocol.Ack, record: dict[str, Any]) -> None:
        self.clock[w] = ack.clock
        self.records[w].append({"t": self.t, "clock": ack.clock, **record})
        self.pulled_at[w] = self.t
        self.send(w, SMALL, self.pull_arrives, w)

    # -- the group <-> global exchange and evaluation ---------------------------------------

    def exchange(self, g: int, final: bool = False) -> None:
        core = self.groups[g]
        core.in_flight = False
        out = core.begin_exchange(final, core.traffic())
        res = self.glob.merge_counted(g, core.xchg.delta(out), out.stats)
        core.perform(core.exchanged(out, res, self.cfg.xchg_latency_s))

    def evaluate(self, again: bool = True) -> None:
        assert self.glob.weights is not None
        traffic = [c.traffic() for c in self.groups.values()]
        self.eval_w.write({"t": self.t, "samples": self.glob.samples,
                           "loss": self.objective.loss(self.glob.weights),
                           "version": self.glob.version,
                           "bytes_up": sum(b["bytes_in"] for b in traffic),
                           "bytes_down": sum(b["bytes_out"] for b in traffic)})
        if again and not self.glob.done:
            self.at(self.cfg.eval_every_s, self.evaluate)


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Run ``cfg`` to its budget; return the run's summary (also in summary.json)."""
    name = cfg.name or f"{time.strftime('%Y%m%d-%H%M%S')}-sim-{cfg.run.mode}-{cfg.run.compressor}"
    run_dir = Path(cfg.out_dir) / name
    sim = Simulation(cfg, run_dir)
    started = time.perf_counter()
    sim.run_all()
    for writer in [sim.glob.writer, sim.eval_w, *(c.writer for c in sim.groups.values())]:
        writer.close()
    for w, records in enumerate(sim.records):  # one file open at a time, whatever the workers
        with sim.rundir.writer(f"worker-{w}") as writer:
            for record in records:
                writer.write(record)
    assert sim.glob.weights is not None
    np.save(run_dir / "final_weights.npy", sim.glob.weights)
    summary = metrics.summarize(run_dir)
    summary.update(run_dir=str(run_dir), pushes=sim.pushes,
                   sim_s=sim.t, real_s=time.perf_counter() - started)
    return summary
