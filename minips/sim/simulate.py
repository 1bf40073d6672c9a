"""`minips simulate`: a whole cluster as a discrete-event simulation on the real role cores.

The global server, the group servers and the workers are ``GlobalCore``, ``GroupCore`` and
``WorkerCore``, the very rules the real processes run (grouping, SSP/BSP inside a group, SGD and
its learning rate, the compressed downlink, the exchanges and their merge, GDTopK's ratios, the
budget; what a worker does with WEIGHTS, what it pushes and records); only time is simulated.
An event queue orders what the real processes would do:

    worker: PULL ─link─► group (held while SSP says wait; the PULLs answered at one instant
            share one publish) ─link─► WEIGHTS ─► compute ─► PUSH ─link─► group applies it,
            ACK ─link─► worker, next PULL

- compute times, links (rate, latency, jitter) and failures (a worker that drops and rejoins
  later, or never): sim/timing.py (``StepTimes``, ``Links``, ``Failure``); a group's exchange
  with the global server is merged ``xchg_latency_s`` after it is due;
- gradients (sim/timing.py's ``objective``): a synthetic quadratic, cheap for thousands of
  workers, or (``real=True``) the run's model on its data set as real workers compute them
  (sim/sim_model.py, torch); workers compress with the run's compressor and the messages are
  the real protocol messages, so the bytes counted are the wire's. An ASSIGN's ratio reaches
  a group's workers when it reaches the group, as the global server sends both at once.

What is here is only what the asyncio shells do around the cores: ``SimGroup`` and
``SimGlobal`` hold a core each and perform its actions (``Simulation`` is the ``Host`` they
see) instead of sockets; they hold the PULLs that SSP says wait (``pending``), gather the
PULLs answered at one simulated instant so the group publishes once for them (``ready``: the
asyncio group server publishes once per event-loop turn), count the bytes of the worker
links, and write the group and global records with ``t`` in simulated seconds. A simulated
worker is its ``WorkerCore`` plus the objective's gradients and the timing model's seconds.

It writes a run directory as `minips local` does (config.json, worker-, group-, global- and
eval-records with ``t`` in simulated seconds, final_weights.npy, summary.json); eval.jsonl
has the accuracy too with a real model, so ``minips plot`` and ``summarize`` read it as a real
run's. What it leaves out: the handshake, heartbeats and leases, regrouping.

``sim_s`` in the summary is the simulated training time, from the groups (t = 0) to the
budget spent, the clock summary.json's ``train_s`` counts; an evaluation tick due after the
end does not stretch it. `minips simulate` prints ``report`` (the figures named; ``HEADLINE``
as JSON with --json) after ``objective_note``, the line that says what the workers train.
``SimConfig`` is one simulated run (``minips simulate``'s flags fill it) and ``simulate(cfg)``
runs it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from minips.core.actions import (
    GlobalAction,
    Log,
    RunDone,
    SendSettings,
    reply,
)
from minips.core.config import MODES, RunConfig, policy
from minips.core.exchange import ExchangeResult, exchange_message
from minips.core.global_core import GlobalCore
from minips.core.group_core import (
    Action,
    AllLeft,
    BudgetSpent,
    GroupCore,
    Reply,
    StartExchange,
    Wake,
)
from minips.core.roster import GroupHandle
from minips.core.slowdown import Schedule, Slowdown, parse_throttle
from minips.core.worker_core import Done, WorkerCore
from minips.record.metrics import summarize
from minips.record.rundir import RunDir, dump_json
from minips.sim.timing import Failure, Links, StepTimes, objective
from minips.wire import control, messages
from minips.wire.frames import wire_size

__all__ = ["SimConfig", "per_worker", "shard_size", "SimGlobal", "SimGroup",
           "Simulation", "simulate", "HEADLINE", "objective_note", "lockstep_note", "report"]


@dataclass
class SimConfig:
    """One simulated run: the run's settings and the models of time and gradients."""

    run: RunConfig
    slowdowns: list[float] = field(default_factory=lambda: [1.0])  # per worker, last repeats
    step_times: list[float] = field(default_factory=list)  # s per worker (overrides slowdowns)
    step_traces: list[list[float]] = field(default_factory=list)  # per worker: s of step k
    # per worker: F over simulated time (core/slowdown.py); a step takes its compute time x
    # F(t) / F(0) x samples / batch_size (LB-BSP's batch: WEIGHTS.batch); [] = flat
    schedules: list[Schedule] = field(default_factory=list)
    throttle: str = ""  # P,MIN-MAX,SECONDS random throttling of every worker; "" = none
    # relative spread of a step's compute time; 0: workers of one speed stay in lock-step,
    # so their staleness is 0 by construction (the labs of docs/course/ take 0.1)
    jitter: float = 0.0
    rate: float = 0.0  # link bytes per second each way per worker (0: no limit)
    latency_s: float = 0.0  # one way, per message
    latency_jitter_s: float = 0.0  # plus this times |N(0, 1)|
    xchg_latency_s: float = 0.0  # a group's exchange is merged this long after it is due
    failures: list[Failure] = field(default_factory=list)
    real: bool = False  # gradients of the run's model and data set (else synthetic)
    model_opts: dict[str, Any] = field(default_factory=dict)  # sim_model: train=, test=
    dim: int = 1000  # coordinates of the synthetic objective
    noise: float = 1.0  # gradient noise of one sample, per coordinate
    max_pushes: int = 0  # stop after this many pushes (0: the run's epochs budget)
    eval_every_s: float = 0.0  # simulated seconds between evaluations (0: the run's)
    out_dir: str = "runs"
    name: str = ""


def per_worker(values: list[float], n: int) -> list[float]:
    """``values`` for workers 0..n-1, the last one repeated."""
    return [values[min(w, len(values) - 1)] for w in range(n)]


def shard_size(run: RunConfig, w: int) -> int:
    """Samples in worker ``w``'s shard, cut as ``data.shard_indices`` cuts an epoch into equal
    pieces: one epoch of the worker, for its compressor's warm-up by epochs."""
    n, k = run.epoch_samples(), run.workers
    return int(np.rint((w + 1) / k * n)) - int(np.rint(w / k * n))


class Host(Protocol):
    """What the cores here use of the simulation (``simulate.Simulation``) that drives them."""

    t: float
    cfg: SimConfig
    run: RunConfig
    rundir: RunDir
    glob: SimGlobal
    groups: dict[int, SimGroup]

    def at(self, delay: float, fn: Callable[..., Any], *args: Any) -> None: ...
    def assign(self, msg: control.Assign) -> None: ...
    def exchange(self, g: int, final: bool = False) -> None: ...
    def release(self, core: SimGroup) -> None: ...


class SimGroup:
    """A group core (``core``) whose actions (``group_core.py``) the simulation performs."""

    def __init__(self, sim: Host, g: int, members: list[int]) -> None:
        self.sim, self.in_flight = sim, False
        self.pending: list[tuple[int, list[int]]] = []  # PULLs held: (worker, waited for)
        self.held_at: dict[int, float] = {}  # worker -> when SSP began to hold its PULL
        self.ready: list[tuple[int, list[int]]] = []  # PULLs to answer at this instant
        self.flush_due = False  # an answer of ``ready`` is queued at this instant
        self.bytes = {"bytes_in": 0, "bytes_out": 0}
        self.writer = sim.rundir.writer(f"group-{g}")
        self.core = GroupCore(g, sim.run, sim.glob.core.weights, members=members, now=sim.t)

    def perform(self, actions: list[Action]) -> messages.Ack | None:
        """Do what the core asked; return its reply. A ``Wake`` releases the held PULLs last
        (after an exchange is scheduled); ``AllLeft`` exchanges what the group holds."""
        reply = None
        for a in actions:
            if isinstance(a, Reply):
                reply = a.msg
            elif isinstance(a, StartExchange | AllLeft) and not self.in_flight:
                self.in_flight = True
                self.sim.at(self.sim.cfg.xchg_latency_s, self.sim.exchange, self.core.group)
            elif isinstance(a, BudgetSpent):
                self.core.spend_budget()  # its Wake: the release below
            elif isinstance(a, Log):
                self.log(a.event, **a.fields)
        if any(isinstance(a, Wake | BudgetSpent) for a in actions):
            self.sim.release(self)
        return reply

    def worker_left(self, w: int) -> None:
        """``w``'s connection dropped: forget its PULLs, leave the clock table."""
        self.pending = [p for p in self.pending if p[0] != w]
        self.ready = [p for p in self.ready if p[0] != w]
        self.log("left", worker=w)
        self.perform(self.core.leave(w))

    def worker_joined(self, w: int, now: float) -> int:
        """``w`` connected again: the clock it starts from (its first ACK)."""
        ack = self.perform(self.core.join(w, now))
        assert ack is not None
        self.log("joined", worker=w, clock=ack.clock)
        return int(ack.clock)

    def budget_spent(self) -> None:
        """The global core said ``Done``: every PULL is answered with ``done``."""
        self.core.spend_budget()
        self.sim.release(self)

    def traffic(self) -> dict[str, int]:
        return dict(self.bytes)

    def log(self, event: str, **fields: Any) -> None:
        core = self.core
        self.writer.write({"t": self.sim.t, "event": event, "group": core.group, **fields,
                           "version": core.version, **core.counters, **self.traffic()})


class SimGlobal:
    """The global core (``core``): its ratios go to the simulated groups and their workers
    (``Host.assign``), ``done`` releases them, its ``Log`` lines go to the global record."""

    def __init__(self, sim: Host, weights: np.ndarray) -> None:
        self.sim = sim
        self.writer = sim.rundir.writer("global")
        self.core = GlobalCore(sim.run, weights, regroup=False, wall=lambda: sim.run.t0 + sim.t)

    def perform(self, actions: list[GlobalAction]) -> None:
        """What the core decided (global_core.py): GDTopK's ratios, the end of the run."""
        core = self.core
        for a in actions:
            if isinstance(a, Log):
                self.writer.write({"t": self.sim.t, "event": a.event, **a.fields,
                                   "version": core.version, "samples": core.samples})
            elif isinstance(a, SendSettings):
                for g in a.ratios:
                    self.sim.assign(core.assign_message(core.groups[g]))
            elif isinstance(a, RunDone):
                for grp in self.sim.groups.values():
                    grp.budget_spent()


SMALL = 40  # bytes of a PULL or an ACK on the wire (a few fields)


class Simulation:
    """The event queue, the workers' state and the cores (``simulate`` runs it)."""

    def __init__(self, cfg: SimConfig, run_dir: Path) -> None:
        self.cfg, self.run = cfg, cfg.run
        self.run.t0 = self.run.t0 or time.time()
        self.t, self.seq = 0.0, itertools.count()
        self.queue: list[tuple[float, int, Any, tuple[Any, ...]]] = []  # (time, seq, fn, args)
        self.rundir = RunDir(run_dir, t0=self.run.t0)
        self.rundir.write_config(self.run.to_info())
        self.objective = objective(self.run, real=cfg.real, dim=cfg.dim, noise=cfg.noise,
                                   **cfg.model_opts)
        n_w, size = self.run.workers, self.objective.size
        self.step_s = (per_worker(cfg.step_times, n_w) if cfg.step_times else
                       [self.run.base_step_s * f for f in per_worker(cfg.slowdowns, n_w)])
        self.steps = StepTimes(self.step_s, cfg.jitter, cfg.step_traces, self.run.seed)
        throttle = parse_throttle(cfg.throttle) if cfg.throttle else None
        self.speeds = [Slowdown(cfg.schedules[w] if w < len(cfg.schedules) else Schedule(),
                                throttle, seed=self.run.seed, worker=w) for w in range(n_w)]
        self.links = Links(n_w, cfg.rate, cfg.latency_s, cfg.latency_jitter_s, self.run.seed)
        # the workers' rules (core/worker_core.py), each with the run's compressor
        self.workers = [WorkerCore(self.run, self.run.worker_compressor(size, w), w,
                                   shard_size(self.run, w)) for w in range(n_w)]
        self.since = [-1] * n_w  # the version each worker's last PULL named
        self.glob = SimGlobal(self, self.objective.initial())
        self.groups: dict[int, SimGroup] = {}
        self.group_of: dict[int, int] = {}
        self._assign(n_w)
        self.rngs = [np.random.default_rng(self.run.seed * 1000 + w) for w in range(n_w)]
        self.gen = [0] * n_w  # a worker's connection: events of an older one are dropped
        self.alive = [True] * n_w
        self.records: list[list[dict[str, Any]]] = [[] for _ in range(n_w)]  # written at the end
        self.eval_w = self.rundir.writer("eval")
        self.pushes, self.evaluated = 0, -1

    def _assign(self, n_w: int) -> None:
        """The global core groups the workers by their step times (each reports it, as a
        worker's calibration STATS does); one group core each, and each worker its first
        ASSIGN."""
        glob = self.glob.core
        for w in range(n_w):
            glob.admit(w, 0.0)
            glob.on_stats(w, control.Stats(clock=0, step_time=self.step_s[w], loss=0.0), 0.0)
        assignment = self.group_of = glob.first_assignment(0.0)
        handles = []
        for g in sorted(set(assignment.values())):
            members = sorted(w for w, h in assignment.items() if h == g)
            self.groups[g] = SimGroup(self, g, members)
            self.groups[g].core.set_ratio(glob.ratio_of(g))
            handles.append(GroupHandle(g, f"sim:{g}", members=members, ratio=glob.ratio_of(g),
                                       served=True))
        self.glob.perform(glob.groups_formed(handles, assignment, self.t))
        for w, g in assignment.items():
            self.workers[w].on_assign(glob.assign_message(glob.groups[g]))

    def assign(self, msg: control.Assign) -> None:
        """A new ASSIGN for group ``msg.group`` (GDTopK's ratio and H): to its core and its
        workers at once, as the global server sends it to both."""
        self.groups[msg.group].core.set_ratio(msg.ratio)
        self.groups[msg.group].core.set_local_steps(msg.local_steps)
        for w, g in self.group_of.items():
            if g == msg.group:
                self.workers[w].on_assign(msg)

    # -- the queue ------------------------------------------------------------------------

    def at(self, delay: float, fn: Any, *args: Any) -> None:
        heapq.heappush(self.queue, (self.t + delay, next(self.seq), fn, args))

    def send(self, w: int, nbytes: int, fn: Any, *args: Any, after: float = 0.0) -> None:
        """A message on worker ``w``'s link, sent ``after`` seconds from now (``timing.Links``);
        ``fn(w, *args)`` runs when it arrives, unless ``w``'s connection dropped meanwhile."""
        arrival = self.links.arrival(w, self.t + after, nbytes)
        heapq.heappush(self.queue, (arrival, next(self.seq), self._deliver,
                                    (w, self.gen[w], fn, args)))

    def _deliver(self, w: int, gen: int, fn: Any, args: tuple[Any, ...]) -> None:
        if gen == self.gen[w]:
            fn(w, *args)

    def run_all(self) -> None:
        for w in range(self.run.workers):
            self._pull(w)
        for fail in self.cfg.failures:
            if fail.worker < self.run.workers:
                self.at(fail.at_s, self.fail, fail)
        self.at(0.0, self.evaluate)
        while self.queue:
            t, _, fn, args = heapq.heappop(self.queue)
            if self.glob.core.done and fn in (self.fail, self.rejoin, self.evaluate):
                continue  # a failure or an evaluation tick after the end does not stretch it
            self.t = t
            fn(*args)
        for g, grp in self.groups.items():  # what the groups hold that the global lacks
            if grp.core.xchg.since["pushes"]:
                self.exchange(g, final=True)
        self.glob.perform(self.glob.core.finish(self.glob.core.done_reason or "pushes"))
        self.evaluate(final=True)

    # -- a worker's step -------------------------------------------------------------------

    def _pull(self, w: int) -> None:
        """Worker ``w``'s next PULL, or its leaving once it made ``max_steps`` pushes (as a
        real worker leaves: --max-steps)."""
        pull = self.workers[w].pull(self.t)
        if isinstance(pull, Done):
            self._drop(w)
        else:
            self.send(w, SMALL, self.pull_arrives, pull)

    def pull_arrives(self, w: int, pull: messages.Pull) -> None:
        self.since[w] = pull.since
        grp = self.groups[self.group_of[w]]
        grp.bytes["bytes_in"] += SMALL
        grp.held_at.pop(w, None)  # one of an earlier session's, never answered
        if grp.core.may_answer(w):
            self._ready(grp, w, [])
        else:
            grp.pending.append((w, [int(v) for v in grp.core.table.waiting_for(w)]))  # type: ignore[call-overload]
            grp.held_at[w] = self.t

    def _ready(self, grp: SimGroup, w: int, waited: list[int]) -> None:
        """Answer ``w`` at the end of this instant, with the others answered at it."""
        grp.ready.append((w, waited))
        if not grp.flush_due:
            grp.flush_due = True
            self.at(0.0, self._answer_ready, grp)

    def _answer_ready(self, grp: SimGroup) -> None:
        """One publish for every PULL answered at this instant, then their WEIGHTS."""
        grp.flush_due = False
        ready, grp.ready = grp.ready, []
        grp.core.publish()
        for w, waited in ready:
            held = self.t - grp.held_at.pop(w, self.t)  # the SSP hold: no part of its iteration
            msg = grp.core.weights_message(w, waited, self.since[w], held_s=held)
            if msg.since < 0:  # the whole weights: a copy, as the socket's bytes would be
                msg = dataclasses.replace(msg, payload=msg.payload._replace(
                    buffers=tuple(np.array(b) for b in msg.payload.buffers)))
            nbytes = wire_size(msg)
            grp.bytes["bytes_out"] += nbytes
            self.send(w, nbytes, self.weights_arrive, msg)

    def release(self, grp: SimGroup) -> None:
        """Answer the held PULLs that SSP now allows (or all of them, when done)."""
        waiting, grp.pending = grp.pending, []
        for w, waited in waiting:
            if grp.core.may_answer(w):
                self._ready(grp, w, waited)
            else:
                grp.pending.append((w, waited))

    def weights_arrive(self, w: int, msg: messages.Weights) -> None:
        """Worker ``w``'s step: its core takes WEIGHTS, the objective gives its gradients and
        the timing model their seconds; the PUSH leaves once they are computed."""
        core = self.workers[w]
        step = core.on_weights(msg, self.t)
        if isinstance(step, Done):
            return
        samples = step.batch or self.run.batch_size  # LB-BSP: the group's batch for this step
        speed = self.speeds[w]
        scale = speed.factor(self.t) / speed.factor(0.0)  # a slowdown schedule or throttling
        weights: np.ndarray | None = step.weights
        total = 0.0  # the step's H computations, before the slowdown and the batch's share
        while weights is not None:
            total += self.steps.next(w)
            grad, loss = self.objective.gradient(w, weights, self.rngs[w])
            weights = core.on_gradient(grad, loss, samples)
        seconds = total * scale * (samples / self.run.batch_size)
        push = core.push(core.encode(core.compress()), seconds / step.local_steps)
        slowdown = (self.step_s[w] / self.run.base_step_s * scale if self.run.base_step_s
                    else None)
        self.send(w, wire_size(push), self.push_arrives, push, slowdown, after=seconds)

    def push_arrives(self, w: int, push: messages.Push, slowdown: float | None) -> None:
        grp = self.groups[self.group_of[w]]
        nbytes = wire_size(push)
        grp.bytes["bytes_in"] += nbytes  # counted once sent
        ack = grp.perform(grp.core.push(w, push, self.t))
        grp.bytes["bytes_out"] += SMALL
        self.pushes += 1
        if self.cfg.max_pushes and self.pushes >= self.cfg.max_pushes and not self.glob.core.done:
            self.glob.perform(self.glob.core.finish("pushes"))
        self.send(w, SMALL, self.ack_arrives, ack, nbytes, slowdown)

    def ack_arrives(self, w: int, ack: messages.Ack, nbytes: int,
                    slowdown: float | None) -> None:
        record = self.workers[w].on_ack(ack, nbytes)
        self.records[w].append({"t": self.t, **record, "slowdown": slowdown})
        self._pull(w)

    # -- failures ----------------------------------------------------------------------------

    def fail(self, fail: Failure) -> None:
        """``fail.worker``'s connection drops: what it had in flight is lost, its group sees it
        leave (a BSP round stops waiting for it); it rejoins ``down_s`` later."""
        if self.alive[fail.worker]:
            self._drop(fail.worker)
            if fail.down_s is not None:
                self.at(fail.down_s, self.rejoin, fail.worker)

    def _drop(self, w: int) -> None:
        """``w``'s connection ends: its events in flight are dropped, its group sees it leave."""
        self.alive[w], self.gen[w] = False, self.gen[w] + 1
        grp = self.groups[self.group_of[w]]
        grp.worker_left(w)

    def rejoin(self, w: int) -> None:
        """A new connection: the clock the group gives it, a fresh copy of the weights."""
        self.alive[w] = True
        self.links.reset(w, self.t)
        clock = self.groups[self.group_of[w]].worker_joined(w, self.t)
        self.workers[w].on_join(messages.Ack(clock=clock))
        self._pull(w)

    # -- the group <-> global exchange and evaluation ---------------------------------------

    def exchange(self, g: int, final: bool = False) -> None:
        """Group ``g``'s exchange, merged now; its bytes are those of the EXCHANGE and
        EXCHANGE_REPLY a `minips group` process would send and get."""
        grp, glob = self.groups[g], self.glob.core
        grp.in_flight = False
        out = grp.core.begin_exchange(final, grp.traffic())
        actions = glob.merge(g, out.delta, out.stats, self.t, traffic=self.traffic(g))
        res = reply(actions, ExchangeResult)
        res.bytes_up = wire_size(exchange_message(out.delta, out.stats))
        res.bytes_down = wire_size(glob.merger.exchange_reply(g, res.weights, glob.done))
        self.glob.perform(actions)
        grp.perform(grp.core.exchanged(out, res, self.cfg.xchg_latency_s))

    def traffic(self, g: int | None = None) -> dict[str, int]:
        """Worker <-> group bytes so far: the run's (``bytes_up``, ``bytes_down``) and, for
        group ``g``, its own (``bytes_in``, ``bytes_out``), as the global core's events take
        them."""
        counts = [c.traffic() for c in self.groups.values()]
        run = {"bytes_up": sum(b["bytes_in"] for b in counts),
               "bytes_down": sum(b["bytes_out"] for b in counts)}
        return run if g is None else {**run, **self.groups[g].traffic()}

    def evaluate(self, final: bool = False) -> None:
        """A line of eval.jsonl for the global weights, when they changed (as the evaluator)."""
        assert self.glob.core.weights is not None
        if self.glob.core.version != self.evaluated or final:
            self.evaluated = self.glob.core.version
            self.eval_w.write({"t": self.t, "samples": self.glob.core.samples,
                               **self.objective.evaluate(self.glob.core.weights),
                               "version": self.glob.core.version, "final": final,
                               **self.traffic()})
        if not final and not self.glob.core.done and self.queue:  # while anything is to happen
            self.at(self.cfg.eval_every_s or self.run.eval_every_s, self.evaluate)


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
    assert sim.glob.core.weights is not None
    np.save(run_dir / "final_weights.npy", sim.glob.core.weights)
    summary = summarize(run_dir)
    # sim_s: simulated training, the groups (t = 0) to the budget spent, as train_s counts it
    summary.update(run_dir=str(run_dir), pushes=sim.pushes, jitter=cfg.jitter,
                   sim_s=summary["train_s"], real_s=time.perf_counter() - started)
    dump_json(run_dir / "summary.json", summary)  # with them
    return summary


# -- what `minips simulate` prints ----------------------------------------------------------------

HEADLINE = ("run_dir", "mode", "compressor", "workers", "groups", "pushes", "samples", "sim_s",
            "real_s", "mean_staleness", "mean_wait_s", "bytes_total", "final_accuracy",
            "final_loss")  # the keys of `minips simulate --json`


def objective_note(run: RunConfig, real: bool, dim: int) -> str:
    """One line saying what the simulated workers train: the synthetic quadratic has no
    accuracy, whatever model and data set the run's flags or --config name."""
    if real:
        return f"minips simulate: workers train {run.model} on {run.dataset} (--objective model)"
    named = (f" (the run's {run.model} on {run.dataset} is not trained: --objective model "
             "does)") if run.dataset != "synthetic" else ""
    return (f"minips simulate: workers train a synthetic quadratic of {dim:,} coordinates: "
            f"a loss but no accuracy{named}")


def lockstep_note(summary: dict[str, Any]) -> str:
    """Why a bounded or unbounded mode shows no staleness: without jitter, workers of one
    speed push in lock-step (an empty string when that is not the reason)."""
    mode = summary.get("mode")
    if (summary.get("jitter") != 0 or summary.get("mean_staleness") != 0
            or mode not in MODES or policy(mode).bound == "zero"):
        return ""
    return " (0 by construction: no --jitter, so workers of one speed stay in step)"


def _count(n: Any, noun: str) -> str:
    """``n`` ``noun``s, the noun singular for one ("1 group", "4 workers"; "-" unknown)."""
    if n is None:
        return f"- {noun}s"
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def report(summary: dict[str, Any], plots: list[str]) -> str:
    """The summary's figures, named, in a few lines (``minips local``'s last lines' shape)."""
    s = summary

    def fig(key: str, fmt: str, unit: str = "") -> str:
        v = s.get(key)
        return "-" if v is None else f"{v:{fmt}}{unit}"

    acc = s.get("final_accuracy")
    end = (f"final accuracy {acc:.4f}" if acc is not None
           else f"final loss {fig('final_loss', '.4g')} (no accuracy: synthetic objective)")
    wait = None if s.get("mean_wait_s") is None else 1e3 * s["mean_wait_s"]
    staleness = fig('mean_staleness', '.2f', ' steps') + lockstep_note(s)
    lines = [
        f"minips simulate: {s.get('mode')}/{s.get('compressor')}, "
        f"{_count(s.get('workers') or 0, 'worker')} in {_count(s.get('groups'), 'group')}: "
        f"{fig('sim_s', '.2f', ' s')} of simulated training "
        f"(computed in {fig('real_s', '.1f', ' s')})",
        f"  pushes {s.get('pushes') or 0:,}, samples {int(s.get('samples') or 0):,}, "
        f"mean staleness {staleness}, mean wait "
        f"{'-' if wait is None else f'{wait:.1f} ms'}, bytes (every hop) "
        f"{(s.get('bytes_total') or 0) / 1e6:.2f} MB, {end}",
        f"  run directory: {s.get('run_dir')}",
        f"  summary:       {Path(str(s.get('run_dir'))) / 'summary.json'}",
        *(f"  plot:          {p}" for p in plots),
    ]
    return "\n".join(lines)
