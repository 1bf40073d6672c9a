"""The role cores as the simulator drives them: ``GroupCore`` and ``GlobalCore`` whose actions
(``group_actions.py``, ``global_actions.py``) the event queue (``simulate.Simulation``, seen
here as the ``Host`` it is, so the two modules do not import each other) performs instead of
sockets.

The rules are the cores' own; what is here is only what the asyncio shells do around them:
hold the PULLs that SSP says wait (``pending``), gather the PULLs answered at one simulated
instant so the group publishes once for them (``ready``: the asyncio group server publishes
once per event-loop turn), count the bytes of the worker links, and write the group and
global records with ``t`` in simulated seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from minips.core import global_actions
from minips.core.global_core import GlobalCore
from minips.core.group_actions import Action, AllLeft, BudgetSpent, Log, Reply, StartExchange, Wake
from minips.core.group_core import GroupCore
from minips.core.group_peer import NoGroup
from minips.run.config import RunConfig
from minips.run.rundir import RunDir
from minips.sim.sim_config import SimConfig

__all__ = ["SimGlobal", "SimGroup", "SimPeer"]


class Host(Protocol):
    """What the cores here use of the simulation (``simulate.Simulation``) that drives them."""

    t: float
    cfg: SimConfig
    run: RunConfig
    rundir: RunDir
    glob: SimGlobal
    groups: dict[int, SimGroup]

    def at(self, delay: float, fn: Callable[..., Any], *args: Any) -> None: ...
    def exchange(self, g: int, final: bool = False) -> None: ...
    def release(self, core: SimGroup) -> None: ...


class NoLink:
    """The group cores' link: unused, the simulation merges exchanges itself (``exchange``)."""

    async def exchange(self, group: int, delta: Any, stats: dict[str, Any]) -> Any:
        raise RuntimeError("a simulated group exchanges through Simulation.exchange")


class SimGroup(GroupCore):
    """A group core whose actions (``group_actions.py``) the simulation performs."""

    def __init__(self, sim: Host, g: int, members: list[int]) -> None:
        self.sim, self.in_flight = sim, False
        self.pending: list[tuple[int, list[int]]] = []  # PULLs held: (worker, waited for)
        self.ready: list[tuple[int, list[int]]] = []  # PULLs to answer at this instant
        self.flush_due = False  # an answer of ``ready`` is queued at this instant
        self.bytes = {"bytes_in": 0, "bytes_out": 0}
        self.writer = sim.rundir.writer(f"group-{g}")
        super().__init__(g, sim.run, sim.glob.weights, NoLink(), members=members, now=sim.t)

    def perform(self, actions: list[Action]) -> Any:
        """Do what the core asked; return its reply. A ``Wake`` releases the held PULLs last
        (after an exchange is scheduled); ``AllLeft`` exchanges what the group holds."""
        reply = None
        for a in actions:
            if isinstance(a, Reply):
                reply = a.msg
            elif isinstance(a, StartExchange | AllLeft) and not self.in_flight:
                self.in_flight = True
                self.sim.at(self.sim.cfg.xchg_latency_s, self.sim.exchange, self.group)
            elif isinstance(a, BudgetSpent):
                self.done = True
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
        self.perform(self.leave(w))

    def worker_joined(self, w: int, now: float) -> int:
        """``w`` connected again: the clock it starts from (its first ACK)."""
        clock = int(self.perform(self.join(w, now)).clock)
        self.log("joined", worker=w, clock=clock)
        return clock

    def traffic(self) -> dict[str, int]:
        return dict(self.bytes)

    def log(self, event: str, **fields: Any) -> None:
        self.writer.write({"t": self.sim.t, "event": event, "group": self.group, **fields,
                           "version": self.version, **self.counters, **self.traffic()})


class SimPeer(NoGroup):
    """A simulated group as the global core sees it (``group_peer.GroupPeer``): its ratio *is*
    the group core's attribute, as an in-process group server's (``serve/inproc_group.py``);
    its traffic is what its exchanges reported, as a group process's."""

    def __init__(self, core: SimGroup) -> None:
        self.core = core
        super().__init__(core.ratio)

    @property  # type: ignore[override]
    def ratio(self) -> float:
        return self.core.ratio

    @ratio.setter
    def ratio(self, value: float) -> None:
        self.core.ratio = value


class SimGlobal(GlobalCore):
    """The global core: ``done`` releases the simulated groups (GDTopK's ratios are already in
    them: ``SimPeer``)."""

    def __init__(self, sim: Host, weights: np.ndarray) -> None:
        self.sim = sim
        self.writer = sim.rundir.writer("global")
        super().__init__(sim.run, weights, regroup=False, clock=lambda: sim.t,
                         wall=lambda: sim.run.t0 + sim.t)

    def perform(self, actions: list[global_actions.Action]) -> None:
        """What the core decided (global_actions.py): the end of the run."""
        for a in actions:
            if isinstance(a, global_actions.Done):
                for core in self.sim.groups.values():
                    core.done = True
                    self.sim.release(core)

    def log(self, event: str, **fields: Any) -> None:
        self.writer.write({"t": self.sim.t, "event": event, **fields, "version": self.version,
                           "samples": self.samples})
